"""The sharding inspector: every parameter listed, per-device totals, replication warning."""

from configs.tiny_lm import get_config
from jaxscale.observe.sharding_report import build_report, format_report


def test_report_lists_every_param_and_divides_bytes():
    c = get_config("test")
    c.mesh.update(data=1, fsdp=8)
    report = build_report(c, compile_step=True)
    paths = {r.path for r in report.rows}
    assert {"embedding", "layers/attn/wqkv", "layers/mlp/w_down", "lm_head"} <= paths
    wq = next(r for r in report.rows if r.path == "layers/attn/wqkv")  # q/k/v, fused
    assert wq.bytes_per_device * 8 == wq.bytes_total
    assert report.opt_bytes_per_device >= 2 * report.params_bytes_per_device * 0.99
    assert report.compiled_memory.argument_size_in_bytes > 0
    text = format_report(report)
    assert "layers/attn/wqkv" in text and "('layers', 'embed', 'kv', 'fused', 'head_dim')" in text
    assert report.replicated_warning() is None


def test_warns_naming_replicated_tensors():
    c = get_config("test")
    c.mesh.update(data=1, fsdp=8)
    c.rules = [("batch", ("data", "fsdp")), ("mlp", "fsdp")]  # attention weights stay whole
    warning = build_report(c, compile_step=False).replicated_warning()
    assert warning is not None and "layers/attn/wqkv" in warning and "replicated" in warning


def test_lora_adapters_are_listed_trainable_and_sharded():
    """With LoRA the inspector lists every adapter next to its frozen base weight, with the
    adapter's own logical axes and spec, and counts optimizer state for the adapters only."""
    c = get_config("test")
    c.mesh.update(data=1, fsdp=4, tensor=2)
    c.lora.update(rank=4, targets=("attn/w[qo]$", "mlp/w_down"))
    report = build_report(c, compile_step=True)
    rows = {r.path: r for r in report.rows}
    adapters = {p for p in rows if "_lora_" in p}
    assert adapters == {f"layers/{m}_lora_{ab}" for m in ("attn/wq", "attn/wo", "mlp/w_down")
                        for ab in "ab"}
    assert all(rows[p].trainable for p in adapters)
    assert not any(r.trainable for p, r in rows.items() if p not in adapters)
    a = rows["layers/attn/wq_lora_a"]
    assert a.logical[-1] == "lora_rank" and "fsdp" in tuple(a.spec)
    assert a.bytes_per_device * 4 == a.bytes_total  # embed over fsdp=4, rank replicated
    adapter_bytes = sum(rows[p].bytes_per_device for p in adapters)
    assert report.opt_bytes_per_device < 3 * adapter_bytes  # AdamW: two moments, adapters only
    text = format_report(report)
    assert "layers/attn/wq_lora_a" in text and "lora_rank" in text and "frozen" in text
    assert f"{len(adapters)} of {len(rows)} tensors trainable" in text
