"""Precision policies: dtypes where the policy says, bf16-mixed tracks float32, and float16
dynamic loss scaling skips exactly the overflowed update and recovers."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from configs.tiny_lm import get_config
from jaxscale.errors import ConfigError
from jaxscale.models import ModelDef
from jaxscale.models.decoder.lm_task import lm_loss
from jaxscale.optim import make_optimizer
from jaxscale.precision import POLICIES, DynamicLossScale, get_policy
from jaxscale.train import step as step_lib
from jaxscale.train.loop import Trainer
from jaxscale.weights.tree import flatten
from tests.helpers import train_steps

# (policy, param dtype, matmul compute dtype)
CASES = [("32-true", jnp.float32, jnp.float32), ("bf16-mixed", jnp.float32, jnp.bfloat16),
         ("bf16-true", jnp.bfloat16, jnp.bfloat16), ("16-mixed", jnp.float32, jnp.float16),
         ("params=float32,compute=bfloat16,output=float32", jnp.float32, jnp.bfloat16)]


def _dot_dtypes(jaxpr) -> list:
    """Output dtypes of every matmul in a jaxpr, including inside scans (the layer stack)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append(eqn.outvars[0].aval.dtype)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out.extend(_dot_dtypes(sub))
    return out


@pytest.mark.parametrize("name,param_dtype,compute_dtype", CASES)
def test_policy_dtypes(name, param_dtype, compute_dtype):
    c = get_config("test")
    policy = get_policy(name)
    model_def = ModelDef.build(c.model, policy)
    params = jax.eval_shape(model_def.init_params, jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(param_dtype)}
    tokens = jnp.zeros((2, 8), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: model_def.module(p)(tokens))(params).jaxpr
    dots = _dot_dtypes(jaxpr)
    # Every projection inside the blocks runs in the compute dtype; the logits in float32.
    assert dots[-1] == jnp.float32
    assert set(dots[:-1]) - {jnp.dtype(jnp.float32)} <= {jnp.dtype(compute_dtype)}
    assert jnp.dtype(compute_dtype) in set(dots[:-1])
    logits = jax.eval_shape(lambda p: model_def.module(p)(tokens), params)
    assert logits.dtype == jnp.float32
    batch = {"tokens": jnp.zeros((2, 9), jnp.int32)}
    loss = lambda p: step_lib.loss_and_metrics(p, {}, batch, model_def)[0]
    grads = jax.eval_shape(jax.grad(loss), params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(param_dtype)}
    optimizer, _ = make_optimizer(c.optim, 10)
    opt = jax.eval_shape(optimizer.init, params)
    floats = {x.dtype for x in jax.tree.leaves(opt) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert floats == {jnp.dtype(param_dtype)}


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ConfigError) as e:
        get_policy("bf17-mixed")
    assert "'bf17-mixed'" in str(e.value)
    assert all(name in str(e.value) for name in POLICIES)


@pytest.mark.slow
def test_bf16_mixed_tracks_float32():
    """Tolerance: 20 steps of the tiny LM; bf16 matmuls shift each loss by well under 0.05 nats
    (measured max 0.0007) while the loss itself falls by ~2 nats over these steps."""
    c = get_config("test")
    c.train.steps = 20
    f32, _ = train_steps(c, 20)[:2]
    c.precision = "bf16-mixed"
    bf16, state = train_steps(c, 20)[:2]
    print("max |loss(bf16-mixed) - loss(32-true)|:", np.abs(bf16 - f32).max())
    np.testing.assert_allclose(bf16, f32, atol=0.05)
    assert bf16[-1] < bf16[0] - 1.0
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


@jax.custom_vjp
def _grad_bomb(loss, bomb):
    return loss


def _bomb_fwd(loss, bomb):
    return loss, bomb


def _bomb_bwd(bomb, g):
    return g * bomb, jnp.zeros_like(bomb)


_grad_bomb.defvjp(_bomb_fwd, _bomb_bwd)


def _bomb_loss(model, batch, run_layers=None):
    """The LM loss whose gradient is multiplied by batch['bomb'][0] (inf: a gradient overflow
    with a perfectly finite loss, as float16 produces when the scale is too large)."""
    return _grad_bomb(lm_loss(model, batch, run_layers), batch["bomb"][0])


def test_loss_scale_update_rules():
    ls = DynamicLossScale(init_scale=8.0, growth_interval=2)
    e = ls.init()
    e = ls.update(e, jnp.asarray(True))
    assert float(e["loss_scale"]) == 8.0 and int(e["good_steps"]) == 1
    e = ls.update(e, jnp.asarray(True))
    assert float(e["loss_scale"]) == 16.0 and int(e["good_steps"]) == 0
    e = ls.update(e, jnp.asarray(False))
    assert float(e["loss_scale"]) == 8.0 and int(e["skipped_steps"]) == 1
    assert float(ls.unscale(e, ls.scale(e, jnp.asarray(3.0)))) == 3.0


def test_float16_loss_scaling_skips_overflow_and_recovers():
    c = get_config("test")
    c.precision = "16-mixed"
    c.loss_scale.growth_interval = 2
    c.optim.warmup_steps = 0  # so every applied update moves the parameters
    trainer = Trainer.build(c, workdir=None)
    model_def = trainer.ctx.model_def  # its task, with the loss swapped for the bomb's
    task = dataclasses.replace(model_def.task, loss=_bomb_loss)
    bombed = dataclasses.replace(model_def, task=task)
    ctx = dataclasses.replace(trainer.ctx, model_def=bombed,  # the objective runs the task's loss
                              objective=dataclasses.replace(trainer.ctx.objective, task=task))
    train = jax.jit(lambda s, b: step_lib.train_step(ctx, s, b))
    it = trainer.batches.iterator()
    state, scale0 = trainer.state, float(trainer.state.extra["loss_scale"])
    history = []
    for i in range(6):
        bomb = np.full((c.data.batch_size,), np.inf if i == 2 else 1.0, np.float32)
        before = jax.device_get(state)
        state, m = train(state, {**trainer.to_global(next(it)), "bomb": bomb})
        history.append((before, jax.device_get(state), jax.device_get(m)))
    scales = [float(h[2]["loss_scale"]) for h in history]
    skipped = [int(h[2]["skipped_steps"]) for h in history]
    # Growth after 2 finite steps, halving on the overflow, growth again 2 steps later.
    assert scales == [scale0, 2 * scale0, scale0, scale0, 2 * scale0, 2 * scale0]
    assert skipped == [0, 0, 1, 1, 1, 1]
    for i, (before, after, m) in enumerate(history):
        assert np.isfinite(m["loss"])
        same = jax.tree.map(np.array_equal, before.params, after.params)
        same_opt = jax.tree.map(np.array_equal, before.opt_state, after.opt_state)
        if i == 2:  # exactly this update skipped: params and optimizer state untouched
            assert all(jax.tree.leaves(same)) and all(jax.tree.leaves(same_opt))
            assert not np.isfinite(m["grad_norm"])
        else:
            assert not any(jax.tree.leaves(same)), i
            assert np.isfinite(m["grad_norm"])
    assert int(history[-1][1].extra["nonfinite_steps"]) == 0  # an overflow is not a divergence
    assert float(history[-1][2]["loss"]) < float(history[0][2]["loss"])


def test_bf16_true_trains_end_to_end():
    c = get_config("test")
    c.precision = "bf16-true"
    losses, state = train_steps(c, 6)[:2]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert {x.dtype for x in flatten(state.params).values()} == {jnp.dtype(jnp.bfloat16)}


def test_explicit_form_errors_name_the_problem():
    for text, culprit in [("params=float32,compute=bf17", "'bf17'"),
                          ("params=float32,kompute=bfloat16", "'kompute'"),
                          ("params=float32,compute", "'compute'"),
                          ("params=float32,params=bfloat16", "twice")]:
        with pytest.raises(ConfigError) as e:
            get_policy(text)
        assert culprit in str(e.value) and "norm" in str(e.value), text
    with pytest.raises(ConfigError, match="logits=bfloat16"):  # a low-precision loss is refused
        get_policy("params=float32,compute=bfloat16,output=bfloat16")


def test_per_module_overrides_reach_the_model():
    policy = get_policy("params=float32,compute=bfloat16,logits=bfloat16,softmax=float32")
    assert policy.dtype_for("logits") == jnp.bfloat16
    assert policy.dtype_for("softmax") == jnp.float32 and policy.dtype_for("norm") == jnp.float32
    assert policy.output == jnp.float32
    model_def = ModelDef.build(get_config("test").model, policy)
    params = jax.eval_shape(model_def.init_params, jax.random.key(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    logits = jax.eval_shape(lambda p: model_def.module(p)(tokens), params)
    assert logits.dtype == jnp.bfloat16  # the override, not the float32 default of mixed policies
    batch = {"tokens": jnp.zeros((2, 9), jnp.int32)}
    loss = jax.eval_shape(lambda p: step_lib.loss_and_metrics(p, {}, batch, model_def)[0], params)
    assert loss.dtype == jnp.float32  # the loss still reduces in float32
    assert get_policy("params=float32,compute=float32,logits=float16").loss_scaling


def test_persistent_overflow_at_min_scale_is_a_clear_error():
    ls = DynamicLossScale(init_scale=4.0, min_scale=1.0, max_skips_at_min=3)
    e = ls.init()
    for _ in range(4):  # 4 -> 2 -> 1 -> 1 (at min) ...
        ls.check(e)
        e = ls.update(e, jnp.asarray(False))
    assert int(e["skips_at_min"]) == 2
    ls.check(e)
    e = ls.update(e, jnp.asarray(False))
    with pytest.raises(Exception, match="minimum loss scale") as err:
        ls.check(e)
    assert "bf16-mixed" in str(err.value)
    e = ls.update(e, jnp.asarray(True))  # one finite step resets the count
    assert int(e["skips_at_min"]) == 0
    ls.check(e)


@pytest.mark.parametrize("chunks", [pytest.param(1, marks=pytest.mark.exhaustive), 4])
def test_bf16_logits_give_the_float32_logits_loss_within_bf16_tolerance(chunks):
    """`bf16-mixed,logits=bfloat16`: the logits are stored in bfloat16 (the head's matmul
    output), the loss is still float32 and equals bf16-mixed's (float32 logits) to bfloat16's
    precision (8 mantissa bits: 0.4% of a logit), whole and in loss chunks."""
    c = get_config("test")
    c.model.loss_chunks = chunks
    tokens = np.random.default_rng(0).integers(0, 256, (4, 33)).astype(np.int32)

    def loss_and_grads(precision):
        model_def = ModelDef.build(c.model, get_policy(precision))
        params = model_def.init_params(jax.random.key(0))
        loss = lambda p: lm_loss(model_def.module(p), {"tokens": tokens})
        return jax.jit(jax.value_and_grad(loss))(params)

    policy = get_policy("bf16-mixed,logits=bfloat16")
    assert policy.dtype_for("logits") == jnp.bfloat16 and policy.param == jnp.float32
    (loss, grads), (want, want_grads) = loss_and_grads(policy.name), loss_and_grads("bf16-mixed")
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, want, rtol=4e-3)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, atol=0.02 * float(jnp.abs(w).max()) + 1e-6)
    with pytest.raises(ConfigError, match="per-module overrides"):
        get_policy("bf16-mixed,compute=float32")
