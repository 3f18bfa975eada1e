"""The sharding inspector: every parameter listed, per-device totals, replication warning."""

from configs.tiny_lm import get_config
from jaxscale.sharding_report import build_report, format_report


def test_report_lists_every_param_and_divides_bytes():
    c = get_config("test")
    c.mesh.update(data=1, fsdp=8)
    report = build_report(c, compile_step=True)
    paths = {r.path for r in report.rows}
    assert {"embedding", "layers/attn/wq", "layers/mlp/w_down", "lm_head"} <= paths
    wq = next(r for r in report.rows if r.path == "layers/attn/wq")
    assert wq.bytes_per_device * 8 == wq.bytes_total
    assert report.opt_bytes_per_device >= 2 * report.params_bytes_per_device * 0.99
    assert report.compiled_memory.argument_size_in_bytes > 0
    text = format_report(report)
    assert "layers/attn/wq" in text and "('layers', 'embed', 'heads', 'head_dim')" in text
    assert report.replicated_warning() is None


def test_warns_naming_replicated_tensors():
    c = get_config("test")
    c.mesh.update(data=1, fsdp=8)
    c.rules = [("batch", ("data", "fsdp")), ("mlp", "fsdp")]  # attention weights stay whole
    warning = build_report(c, compile_step=False).replicated_warning()
    assert warning is not None and "layers/attn/wq" in warning and "replicated" in warning
