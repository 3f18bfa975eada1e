"""Every parallelism strategy computes the 1-device training run: same losses, same gradients.

Three train steps from the same init and data on a strategy's 8-device mesh give losses and
gradients equal to one device (relative difference < 1e-5 in float32). The model shape is one
that all meshes divide: embed 64, 4 heads, 4 kv heads, mlp 128, 4 layers, vocab 256.
"""

import jax
import numpy as np
import pytest

from configs.tiny_lm import get_config
from jaxscale.aot.hlo import collectives
from jaxscale.rules import use_rules
from jaxscale.train.loop import Trainer
from jaxscale.train.step import accumulate_grads
from jaxscale.weights.tree import flatten

STEPS = 3
RTOL = 1e-5


def make_config(mesh: dict, preset: str = "", batch: int = 16, **pipeline):
    c = get_config("test")
    c.model.update(embed=64, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=16, mlp=128)
    c.data.batch_size = batch
    c.train.steps = STEPS
    c.mesh.update({**dict(data=1, pipeline=1, fsdp=1, tensor=1), **mesh})
    c.rules_preset = preset
    c.pipeline.update(pipeline)
    return c


def run_steps(config, devices) -> tuple[np.ndarray, list[dict]]:
    """Losses of STEPS train steps and, before each, the gradients of that step's batch."""
    trainer = Trainer.build(config, workdir=None, devices=devices)
    ctx = trainer.ctx

    def grads_of(state, batch):
        with use_rules(ctx.rules, ctx.mesh):
            return accumulate_grads(state.params, state.frozen, batch, ctx.model_def,
                                    ctx.grad_accum, ctx.run_layers)[1]

    grad_fn = jax.jit(grads_of)
    it = trainer.batches.iterator()
    state, losses, grads = trainer.state, [], []
    for _ in range(STEPS):
        batch = trainer.to_global(next(it))
        grads.append({k: np.asarray(v) for k, v in flatten(jax.device_get(
            grad_fn(state, batch))).items()})
        state, metrics = trainer.train_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), grads


def assert_equal_runs(got, want):
    (losses, grads), (ref_losses, ref_grads) = got, want
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert ref_losses[-1] < ref_losses[0]  # training really moved
    for step, (g, r) in enumerate(zip(grads, ref_grads)):
        assert set(g) == set(r)
        for path in r:
            rel = np.linalg.norm(g[path] - r[path]) / np.linalg.norm(r[path])
            assert rel < RTOL, f"step {step} {path}: relative gradient difference {rel:.2e}"


@pytest.fixture(scope="module")
def reference():
    """The 1-device run of the 16-row batch every mesh below is compared with."""
    return run_steps(make_config({}), jax.devices()[:1])


@pytest.mark.parametrize("mesh, preset, pipeline", [
    pytest.param({"data": 8}, "dp", {}, marks=pytest.mark.exhaustive),  # data x fsdp x tensor below covers it
    ({"fsdp": 8}, "fsdp", {}),
    pytest.param({"tensor": 4, "data": 2}, "tp", {}, marks=pytest.mark.exhaustive),
    ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp", {}),
])
def test_spmd_strategies_equal_one_device(reference, mesh, preset, pipeline):
    assert_equal_runs(run_steps(make_config(mesh, preset, **pipeline), jax.devices()), reference)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, pipeline", [
    ({"pipeline": 4, "data": 2}, dict(microbatches=4)),
    pytest.param({"pipeline": 2, "fsdp": 2, "tensor": 2}, dict(microbatches=2), marks=pytest.mark.exhaustive),
    ({"pipeline": 2, "data": 4}, dict(microbatches=2, repeats=2, schedule="circular")),
])
def test_pipeline_equals_one_device(reference, mesh, pipeline):
    assert_equal_runs(run_steps(make_config(mesh, "pp", **pipeline), jax.devices()), reference)


@pytest.mark.slow
def test_grad_accum_equals_large_batch(reference):
    """grad_accum=2 over the 16-row batch on 8 devices (a row per device and microbatch) == the
    16-row batch at once on one (the module's reference run)."""
    accum = make_config({"data": 8}, "dp")
    accum.train.grad_accum = 2
    assert_equal_runs(run_steps(accum, jax.devices()), reference)


def test_grad_accum_reduces_over_data_once_per_step():
    """The compiled step all-reduces the gradients once, after the microbatch loop."""
    config = make_config({"data": 8}, "dp", batch=64)
    config.train.grad_accum = 4
    trainer = Trainer.build(config, workdir=None)
    batch = trainer.to_global(next(trainer.batches.iterator()))
    found = collectives(trainer.train_fn.lower(trainer.state, batch).compile().as_text())
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.state.params))
    reductions = [c for c in found if c.kind in ("all-reduce", "reduce-scatter")]
    assert sum(c.bytes for c in reductions) >= param_bytes  # the gradients are reduced ...
    assert all(c.executions == 1 and not c.in_loop for c in reductions)  # ... once per step
