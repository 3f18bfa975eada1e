"""The 1F1B schedule computes the 1-device training run: same losses, same gradients.

Three train steps from the same init and data on 8 simulated devices (float32) give losses and
gradients equal to one device (relative difference < 1e-5), for the pipeline meshes of the
equivalence tests with M = 4 and 8 microbatches (M = 8 > 2S-1 = 3 stash slots for S = 2, so the
ring buffer wraps; S = 4 with M = 8 > 7 is exhaustive) and with gradient accumulation. Under
float16 loss scaling, LoRA and tied embeddings 1F1B's gradients and evaluation loss match GPipe's.
"""

import jax
import numpy as np
import pytest

from jaxscale import config as config_lib
from jaxscale.errors import ConfigError
from jaxscale.mesh import make_mesh
from jaxscale.parallel.schedules import SCHEDULES, make_layer_runner
from jaxscale.rules import use_rules
from jaxscale.train.loop import Trainer
from jaxscale.train.step import accumulate_grads, loss_and_metrics
from jaxscale.weights.tree import flatten
from tests.test_parallel_equivalence import assert_equal_runs, make_config, run_steps


@pytest.fixture(scope="module")
def reference():
    """The 1-device run of the 16-row batch every mesh below is compared with."""
    return run_steps(make_config({}), jax.devices()[:1])


@pytest.mark.parametrize("mesh, microbatches, grad_accum", [
    # S = 4 with M = 8 > 2S-1 = 7: the rows below prove S = 4 on data replicas (M = 4) and the
    # stash ring wrapping around (M = 8 > 3 on S = 2).
    pytest.param({"pipeline": 4, "data": 2}, 8, 1, marks=pytest.mark.exhaustive),
    ({"pipeline": 4, "data": 2}, 4, 2),  # accumulation over data replicas (one all-reduce)
    ({"pipeline": 2, "fsdp": 2, "tensor": 2}, 8, 1),  # M > 2S-1: the stash ring wraps around;
    # FSDP + tensor parallel inside stages
])
def test_1f1b_equals_one_device(reference, mesh, microbatches, grad_accum):
    config = make_config(mesh, "pp", microbatches=microbatches, schedule="1f1b")
    config.train.grad_accum = grad_accum
    assert_equal_runs(run_steps(config, jax.devices()), reference)


def _float16_run(schedule: str) -> tuple[dict, float, float | None, bool]:
    """16-mixed with LoRA and tied embeddings on `pipeline=2`: the loss-scaled gradients (as
    the train step computes them), the loss, 1F1B's undifferentiated loss, and whether the
    gradients stay finite at a loss scale of 2^30, at which float16 cotangents overflow."""
    c = make_config({"pipeline": 2}, "pp", microbatches=4, schedule=schedule)
    c.precision = "16-mixed"
    c.model.tie_embeddings = True
    c.lora.update(rank=4, targets=("attn/w[qv]$", "mlp/w_up"))
    trainer = Trainer.build(c, workdir=None, devices=jax.devices()[:2])
    ctx, state = trainer.ctx, trainer.state
    batch = trainer.to_global(next(trainer.batches.iterator()))

    @jax.jit
    def grads(state, scale):
        with use_rules(ctx.rules, ctx.mesh):
            return accumulate_grads(state.params, state.frozen, batch, ctx.model_def,
                                    ctx.grad_accum, ctx.run_layers, scale)

    scale = state.extra["loss_scale"]
    loss, flat = jax.device_get(grads(state, scale))
    huge = jax.device_get(grads(state, jax.numpy.float32(2.0 ** 30))[1])
    finite = all(np.all(np.isfinite(g)) for g in jax.tree.leaves(huge))
    plain = None
    if schedule == "1f1b":  # the schedule's primal: its loss where nothing differentiates it
        with use_rules(ctx.rules, ctx.mesh):
            plain = float(jax.jit(lambda p, f, b: loss_and_metrics(
                p, f, b, ctx.model_def, ctx.run_layers)[0])(state.params, state.frozen, batch))
    return ({k: np.asarray(v) for k, v in flatten(flat).items()}, float(loss / scale), plain,
            finite)


def test_1f1b_equals_gpipe_with_float16_loss_scaling_lora_and_tied_embeddings():
    """The backward inside the schedule starts from the loss scale: float16 cotangents are
    scaled (they overflow exactly when GPipe's do, which dynamic loss scaling relies on). Frozen
    LoRA base weights, a frozen embedding that the head reads, and the undifferentiated loss
    (1F1B's primal: GPipe's forward) all match GPipe."""
    (want, want_loss, _, want_finite), (got, got_loss, got_eval, got_finite) = (
        _float16_run("gpipe"), _float16_run("1f1b"))
    assert set(got) == set(want) and all(k.endswith(("_lora_a", "_lora_b")) for k in got)
    for k in want:
        assert np.all(np.isfinite(got[k]))
        assert np.linalg.norm(got[k] - want[k]) <= 1e-3 * np.linalg.norm(want[k]), k
    # Two programs computing one float16 forward: equal up to XLA's rounding of each (3e-6
    # apart with the older CPU emitters of tests/child_env.py); a wrong micro-batch or a loss
    # scale not undone would be off by far more.
    np.testing.assert_allclose([got_loss, got_eval], want_loss, rtol=2e-5)
    assert not want_finite and not got_finite


def test_1f1b_config_errors():
    mesh = make_mesh({"pipeline": 2, "data": 4})
    with pytest.raises(ConfigError, match="1f1b.*interleaved 1F1B is not implemented"):
        make_layer_runner(dict(microbatches=2, repeats=2, schedule="1f1b"), mesh, "none", 8)
    with pytest.raises(ConfigError, match="num_layers=7 is not divisible"):
        make_layer_runner(dict(microbatches=2, schedule="1f1b"), mesh, "none", 7)
    runner = make_layer_runner(dict(microbatches=2, schedule="1f1b"), mesh, "none", 8)
    with pytest.raises(ConfigError, match="only the\\s+language-model loss"):
        runner(None, None, None)  # a model that is not an LM calls it as a layer runner
    assert SCHEDULES["1f1b"].bubble_fraction(4, 8, 1) == SCHEDULES["gpipe"].bubble_fraction(4, 8, 1)
    # The head's positions are split over the stages: the length must divide among them.
    c = make_config({"pipeline": 4, "data": 2}, "pp", microbatches=4, schedule="1f1b")
    c.data.seq_len = 30
    with pytest.raises(ConfigError, match=r"seq_len=30 positions over the mesh.pipeline=4"):
        config_lib.validate(c)
    c.pipeline.schedule = "gpipe"
    config_lib.validate(c)
    c.data.seq_len, c.model.loss_chunks, c.pipeline.schedule = 32, 16, "1f1b"
    with pytest.raises(ConfigError, match=r"model.loss_chunks=16 must divide the 8 positions"):
        config_lib.validate(c)
