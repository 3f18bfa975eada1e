"""The sharding inspector: every parameter listed, per-device totals, replication warning, and
the train step it compiles is the one `launch.train` compiles."""

import dataclasses
import json

import jax
import pytest

from configs import vit_digits
from configs.tiny_lm import get_config
from jaxscale.aot.sharding_report import build_report, fingerprint, format_report
from jaxscale.mesh import make_mesh
from jaxscale.train.build import batch_spec, build_step
from jaxscale.train.loop import Trainer


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


def trainer_program(config) -> jax.stages.Lowered:
    """The program `launch.train` compiles: `Trainer.build`'s jitted step lowered on its first
    batch, as `Trainer._compile` does (nothing is run)."""
    trainer = Trainer.build(config, workdir=None)
    batch = trainer.to_global(next(trainer.batches.iterator()))
    return trainer.train_fn.lower(trainer.state, batch)


def pipeline_config():
    c = get_config("test")
    c.mesh.update(data=4, pipeline=2)
    c.rules_preset = "pp"
    c.pipeline.update(microbatches=2)
    return c


def lora_config():
    c = get_config("test")
    c.mesh.update(data=1, fsdp=4, tensor=2)
    c.lora.update(rank=4, targets=("attn/w[qo]$", "mlp/w_down"))
    c.train.skip_nonfinite = True
    return c


@pytest.mark.parametrize("make_config, left_out", [
    (pipeline_config, dict(run_layers=None)),  # the pipeline runner
    (lora_config, dict(skip_nonfinite=False)),
])
def test_inspector_compiles_the_training_step(make_config, left_out):
    """`launch.inspect` reports the program `launch.train` runs: the same lowered step (so the
    same compiled memory) for a pipeline and a LoRA config, where a step assembled by hand
    without the pipeline runner or `skip_nonfinite` is a different program."""
    c = make_config()
    report = build_report(c, compile_step=True)
    assert report.compiled_memory.argument_size_in_bytes > 0
    assert report.step_fingerprint == fingerprint(trainer_program(c))
    setup = build_step(c, make_mesh(c.mesh))
    partial = dataclasses.replace(setup, ctx=dataclasses.replace(setup.ctx, **left_out))
    assert fingerprint(partial.lower(batch_spec(c))) != report.step_fingerprint


@pytest.mark.slow
def test_batches_of_other_datasets_match_the_training_step(tmp_path):
    """The batch the inspector lowers against is the one the loop feeds: images and labels for
    the ViT, tokens with segment ids and positions for packed file sources."""
    texts = [f"def f{i}(): return {i * i}" for i in range(400)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    packed = get_config("test")
    packed.data.update(sources=f"jsonl={tmp_path}/docs.jsonl", packing="pack",
                       eval_fraction=0.2, eval_batches=1)
    for c in (vit_digits.get_config("test"), packed):
        c.mesh.update(data=8)
        lowered = build_step(c, make_mesh(c.mesh)).lower(batch_spec(c))
        assert fingerprint(lowered) == fingerprint(trainer_program(c))
    assert set(batch_spec(packed)) == {"tokens", "segment_ids", "positions"}


def test_init_from_is_checked_as_train_checks_it(tmp_path):
    """inspect reports no run that train would refuse: init_from's weights must be readable and
    of the model's shapes (metadata only, as `load_params` checks them)."""
    import numpy as np

    from jaxscale.errors import JaxscaleError
    from jaxscale.models import ModelDef
    from jaxscale.precision import get_policy
    from jaxscale.weights.init_from import check_init_from, export_params

    c = get_config("test")
    c.init_from = str(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(JaxscaleError, match="holds no weights jaxscale can read"):
        check_init_from(c)
    like = ModelDef.build(c.model, get_policy(c.precision)).shapes()
    export_params(str(tmp_path / "w"), {k: np.zeros(v.shape, v.dtype) for k, v in like.items()})
    c.init_from = str(tmp_path / "w")
    check_init_from(c)
    c.model.embed *= 2
    with pytest.raises(JaxscaleError, match="config.init_from=.* the model expects"):
        check_init_from(c)


def test_inspect_cli_names_its_default_config_and_refuses_empty_init_from(tmp_path):
    import subprocess
    import sys

    from child_env import child_env

    def inspect(*args):
        return subprocess.run([sys.executable, "-m", "jaxscale", "inspect", "--compile=false",
                               *args], env=child_env(), capture_output=True, text=True,
                              timeout=300)

    out = inspect()
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("config: ") and "tiny_lm.py (the default" in out.stdout
    (tmp_path / "empty").mkdir()
    out = inspect("--config=finetune_lm:test", f"--config.init_from={tmp_path / 'empty'}")
    assert out.returncode == 2 and out.stderr.startswith("jaxscale: error: config.init_from")
    assert "holds no weights" in out.stderr and not out.stdout
