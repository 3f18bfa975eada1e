"""LoRA beyond the Llama basics: dropout acts in training only (per example, on the adapter's
input), and adapters work on the ViT (targets on its paths, sharded by the rules, merge)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny_lm, vit_digits
from jaxscale.errors import ConfigError
from jaxscale.models import ModelDef
from jaxscale.models.adapters import lora, lora_matmul
from jaxscale.models.adapters.lora_matmul import adapter_dropout
from jaxscale.models.nn.layers import ADAPTED_PROJECTION, param, project
from jaxscale.precision import get_policy
from jaxscale.train.loop import Trainer
from jaxscale.weights.place import param_specs
from jaxscale.weights.tree import flatten, merge_trees
from test_lora import assert_adapters_follow_base
from tests.helpers import run_steps


class _Probe(nnx.Module):
    """One adaptable weight W = 0 with identity adapters: project() returns the adapter path
    alone, scale * drop(x), so the dropout mask can be read off the output."""

    LORA_WEIGHTS = ("w",)

    def __init__(self, dim: int, rate: float):
        self.w = param(None, (dim, dim), ("embed", "mlp"), init="zeros")
        self.w_lora_a = nnx.Param(jnp.eye(dim), logical_axes=("embed", "lora_rank"))
        self.w_lora_b = nnx.Param(jnp.eye(dim), logical_axes=("lora_rank", "mlp"))
        self.w_lora_scale, self.w_lora_dropout = 1.0, rate
        setattr(self, ADAPTED_PROJECTION, lora_matmul.project)  # as lora.add_adapters does


def test_dropout_masks_the_adapter_input_in_training_only():
    rate, x = 0.25, jnp.asarray(np.random.default_rng(0).normal(size=(8, 16, 32)), jnp.float32)
    probe = _Probe(32, rate)
    y_eval = project(probe, "w", "bte,ef->btf", x, jnp.float32)
    np.testing.assert_allclose(np.asarray(y_eval), np.asarray(x), rtol=1e-6)  # no dropout
    with adapter_dropout(jax.random.key(1)):
        y = np.asarray(project(probe, "w", "bte,ef->btf", x, jnp.float32))
        again = np.asarray(project(probe, "w", "bte,ef->btf", x, jnp.float32))
    with adapter_dropout(jax.random.key(2)):
        other = np.asarray(project(probe, "w", "bte,ef->btf", x, jnp.float32))
    dropped = y == 0
    kept = np.isclose(y, np.asarray(x) / (1 - rate), rtol=1e-6)
    assert np.all(dropped | kept)                       # each input either zeroed or rescaled
    assert abs(dropped.mean() - rate) < 0.03            # 4096 draws: rate within ~3 sigma
    assert not np.array_equal(dropped[0], dropped[1])   # each example has its own mask
    np.testing.assert_array_equal(y, again)             # same key, same mask
    assert not np.array_equal(y, other)                 # the key (step) changes the mask


def test_dropout_masks_differ_between_microbatches_under_one_key():
    """Gradient-accumulation / pipeline microbatches and data replicas run under the step's one
    key (inside scans and vmaps): their different inputs still get different masks."""
    rate, probe = 0.5, _Probe(32, 0.5)
    rng = np.random.default_rng(0)
    micro = jnp.asarray(rng.normal(size=(4, 2, 16, 32)), jnp.float32)  # 4 microbatches

    def body(carry, x):
        return carry, project(probe, "w", "bte,ef->btf", x, jnp.float32) == 0

    with adapter_dropout(jax.random.key(1)):
        _, masks = jax.lax.scan(body, 0, micro)
        replicas = jax.vmap(lambda x: body(0, x)[1])(micro)
    masks, replicas = np.asarray(masks), np.asarray(replicas)
    for m in (masks, replicas):
        assert all(not np.array_equal(m[0], m[i]) for i in range(1, 4))
        assert abs(m.mean() - rate) < 0.05


def test_dropout_acts_in_the_train_step_not_in_the_held_out_metrics():
    """With adapters that matter (B != 0 after two steps), the train step's loss differs from
    the held-out loss of the same params and batch; evaluation stays deterministic. (The mask
    semantics themselves are checked exactly by the test above.)"""
    c = tiny_lm.get_config("test")
    c.lora.update(rank=4, alpha=8.0, targets=("attn/w[qv]$", "mlp/w_down"), dropout=0.5)
    c.optim.warmup_steps = 0
    trainer = Trainer.build(c, workdir=None)
    _, state, it = run_steps(trainer, 2)
    local = next(it)
    trainer.eval_data = [local]
    evals = [trainer.evaluate(state)["loss"] for _ in range(2)]
    assert evals[0] == evals[1]
    _, metrics = trainer.train_fn(state, trainer.to_global(local))
    assert abs(float(metrics["loss"]) - evals[0]) > 1e-4


VIT_TARGETS = ("attn/w[qkvo]$", "mlp/w_(in|out)$")


@pytest.fixture(scope="module")
def vit_trained():
    c = vit_digits.get_config("test")
    c.mesh.update(data=1, fsdp=4, tensor=2)
    c.lora.update(rank=4, alpha=8.0, targets=VIT_TARGETS)
    c.optim.warmup_steps = 0
    trainer = Trainer.build(c, workdir=None)
    frozen0 = jax.device_get(trainer.state.frozen)
    _, state, _ = run_steps(trainer, 3)
    return c, trainer, frozen0, state


def test_vit_lora_trains_only_adapters_sharded_by_the_rules(vit_trained):
    c, trainer, frozen0, state = vit_trained
    adapters = flatten(state.params)
    assert set(adapters) == {f"layers/{m}_lora_{ab}" for m in (
        "attn/wq", "attn/wk", "attn/wv", "attn/wo", "mlp/w_in", "mlp/w_out") for ab in "ab"}
    for path, base in flatten(frozen0).items():
        np.testing.assert_array_equal(np.asarray(flatten(state.frozen)[path]), base, err_msg=path)
    assert np.any(np.asarray(adapters["layers/attn/wq_lora_b"]))  # B moved off zero
    md = trainer.ctx.model_def
    specs = param_specs(md, trainer.ctx.rules, trainer.ctx.mesh)
    assert_adapters_follow_base(specs, md.logical_axes(), list(adapters))
    for path, arr in adapters.items():
        assert arr.sharding.spec == specs[path], path


def test_vit_merge_gives_the_same_logits(vit_trained):
    c, trainer, _, state = vit_trained
    full = jax.device_get(merge_trees(state.params, state.frozen))
    merged = lora.merge(full, c.lora)
    base_def = ModelDef.build(c.model, get_policy(c.precision))
    assert set(flatten(merged)) == set(base_def.shapes())
    images = jnp.asarray(np.random.default_rng(0).uniform(size=(4, 8, 8, 1)), jnp.float32)
    want = trainer.ctx.model_def.module(full)(images)
    np.testing.assert_allclose(np.asarray(base_def.module(merged)(images)), np.asarray(want),
                               atol=1e-5)
    with pytest.raises(ConfigError, match="no base weight"):  # adapters alone cannot merge
        lora.merge(jax.device_get(state.params), c.lora)


def test_vit_biases_cannot_take_adapters():
    c = vit_digits.get_config("test")
    c.lora.update(rank=2, targets=("attn/b[qv]$",))
    with pytest.raises(ConfigError, match="cannot take adapters"):
        lora.with_adapters(ModelDef.build(c.model, get_policy(c.precision)), c.lora)
