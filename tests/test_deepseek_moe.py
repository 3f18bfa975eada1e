"""DeepSeek-V3's mixture of experts: the `sigmoid_group` router (sigmoid scores, group-limited
top-k, routed_scaling_factor), the dense first layers (`first_k_dense_replace`) and the
auxiliary-loss-free balancing bias (moved by the step, held with the frozen parameters, saved in
checkpoints, exact on resume)."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.tiny_lm import get_config
from helpers import assert_cached_decoding_is_the_full_forward, run_steps
from jaxscale.config import validate
from jaxscale.errors import ConfigError
from jaxscale.models import ModelDef, entry_of
from jaxscale.models.moe.config import MoEConfig
from jaxscale.models.moe.routers import route
from jaxscale.precision import get_policy
from jaxscale.train.loop import Trainer, train
from jaxscale.train.state import flatten

DEEPSEEK = dict(num_experts=8, experts_per_token=2, router="sigmoid_group", n_group=4,
                topk_group=2, routed_scaling_factor=2.5, shared_experts=1, mlp=32,
                first_k_dense_replace=1, router_aux_loss_coef=0.0)


def _reference_route(logits, bias, moe):
    """DeepSeek-V3's routing written out token by token in numpy."""
    scores = 1 / (1 + np.exp(-logits))
    weights, experts = [], []
    size = moe.num_experts // moe.n_group
    for s in scores:
        choice = s + bias
        groups = [np.sort(choice[g * size:(g + 1) * size])[-2:].sum() for g in range(moe.n_group)]
        kept = np.argsort(groups)[::-1][:moe.topk_group]
        masked = np.array([c if i // size in kept else -np.inf for i, c in enumerate(choice)])
        top = np.argsort(masked, kind="stable")[::-1][:moe.experts_per_token]
        w = s[top] / s[top].sum()
        weights.append(w * moe.routed_scaling_factor)
        experts.append(top)
    return np.array(weights), np.array(experts)


def test_sigmoid_group_router_is_deepseeks_routing():
    moe = MoEConfig(**{k: v for k, v in DEEPSEEK.items() if k != "first_k_dense_replace"})
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(16, 8)).astype(np.float32)
    bias = rng.normal(scale=0.5, size=8).astype(np.float32)
    weights, experts, stats, load = route(jnp.eye(16), jnp.asarray(logits), moe,
                                          balance_X=jnp.asarray(bias))
    want_w, want_e = _reference_route(logits, bias, moe)
    np.testing.assert_array_equal(np.sort(np.asarray(experts), -1), np.sort(want_e, -1))
    order = lambda e, w: np.take_along_axis(w, np.argsort(e, -1), -1)
    np.testing.assert_allclose(order(np.asarray(experts), np.asarray(weights)),
                               order(want_e, want_w), rtol=1e-6)
    # The load: assignments per expert relative to an even share (16 tokens x 2 / 8).
    counts = np.bincount(np.asarray(experts).ravel(), minlength=8)
    np.testing.assert_allclose(np.asarray(load), counts * 8 / 32)
    # Each token's experts lie in at most topk_group groups.
    assert max(len(set(e // 2)) for e in np.asarray(experts)) <= moe.topk_group


def test_the_sequence_wise_balance_statistic_asks_each_sequence_to_balance():
    """Two sequences each sending every token to its own two experts: balanced over the batch
    (Switch's statistic near its floor of 1), not within either sequence (about 2)."""
    moe = MoEConfig(num_experts=4, experts_per_token=2, router="sigmoid_group",
                    aux_per_sequence=True)
    x = np.full((2, 3, 4), -2.0, np.float32)
    x[0, :, :2], x[1, :, 2:] = 2.0, 2.0
    x += np.random.default_rng(0).normal(scale=0.1, size=x.shape).astype(np.float32)
    _, experts, stats, _ = route(jnp.asarray(x), jnp.eye(4), moe)
    assert set(np.asarray(experts)[0].ravel()) == {0, 1} and set(
        np.asarray(experts)[1].ravel()) == {2, 3}
    scores = 1 / (1 + np.exp(-x))
    probs = scores / scores.sum(-1, keepdims=True)
    share = np.array([[0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5]])
    want = 4 * np.mean(np.sum(share * probs.mean(1), -1))
    np.testing.assert_allclose(float(stats[0]), want, rtol=1e-6)
    batch = route(jnp.asarray(x), jnp.eye(4), MoEConfig(**{**moe.__dict__,
                                                           "aux_per_sequence": False}))[2]
    np.testing.assert_allclose(float(batch[0]), 4 * np.sum(share.mean(0) * probs.mean((0, 1))),
                               rtol=1e-6)
    assert float(stats[0]) > 1.5 > 1.05 > float(batch[0])


def _config(**moe):
    c = get_config("test")
    c.model.moe.update({**DEEPSEEK, **moe})
    c.mesh.data = 1
    return c


def test_dense_first_layers_and_the_bias_in_the_parameters_and_counts():
    c = _config()
    validate(c)
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    shapes = model_def.shapes()
    L = c.model.num_layers
    assert shapes["dense_layers/mlp/w_down"].shape == (1, c.model.mlp, c.model.embed)
    assert shapes["layers/mlp/w_gate"].shape == (L - 1, 8, c.model.embed, 32)
    assert shapes["layers/mlp/balance_bias"].shape == (L - 1, 8)
    assert model_def.num_params() == entry_of(c.model).config_cls.from_config(
        c.model).num_params()
    # FLOPs: the one dense first layer saves a MoE layer's router and 2 routed + 1 shared
    # experts of width 32 (three E x 32 matrices each) for the dense SwiGLU's E x mlp ones.
    E, F = c.model.embed, c.model.mlp
    all_moe = {**dict(c.model), "moe": {**DEEPSEEK, "first_k_dense_replace": 0}}
    flops = entry_of(c.model).flops_per_token
    assert flops(all_moe, 64) - flops(c.model, 64) == pytest.approx(
        6 * (3 * E * 32 * 3 + E * 8 - 3 * E * F))


def test_decoding_through_dense_and_moe_stacks_is_the_full_forward():
    c = _config()
    c.model.update(attention_kind="latent")
    c.model.mla.update(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8)
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    params = model_def.init_params(jax.random.key(0))
    tokens = np.random.default_rng(1).integers(0, 256, (2, 6)).astype(np.int32)

    assert_cached_decoding_is_the_full_forward(model_def, params, tokens)


def test_the_bias_moves_outside_the_gradient_and_resumes_exactly(tmp_path):
    rate = 1e-3
    c = _config(bias_update_rate=rate)
    c.mesh.update(data=2, fsdp=2, expert=2)  # the 8 experts over the expert axis
    c.train.update(steps=4, log_every=1, eval_every=0)
    c.optim.update(warmup_steps=0, min_lr_ratio=1.0)  # the same lr whatever the run length
    c.checkpoint.every = 2
    whole = train(c, str(tmp_path / "whole"))
    # The same run resumed from its step-2 checkpoint.
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    resumed = train(c, str(tmp_path / "resumed"))
    path = "layers/mlp/balance_bias"
    assert path not in flatten(whole.params)
    assert not any("balance_bias" in str(p) for p, _ in
                   jax.tree_util.tree_flatten_with_path(whole.opt_state)[0])
    bias = np.asarray(flatten(whole.frozen)[path])
    # Four steps of +-rate (0 where an expert's load was exactly even): multiples of rate.
    assert np.abs(bias).max() > 0 and np.abs(bias).max() <= 4 * rate + 1e-9
    np.testing.assert_allclose(bias / rate, np.round(bias / rate), atol=1e-3)
    np.testing.assert_array_equal(np.asarray(flatten(resumed.frozen)[path]), bias)
    for p, v in flatten(whole.params).items():
        np.testing.assert_allclose(np.asarray(flatten(resumed.params)[p]), np.asarray(v),
                                   rtol=1e-5, atol=1e-6)


def _run(config, devices, steps: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(losses, the last balancing bias) of `steps` train steps on `devices`."""
    trainer = Trainer.build(config, workdir=None, devices=devices)
    losses, state, _ = run_steps(trainer, steps)
    return losses, np.asarray(flatten(state.frozen)["layers/mlp/balance_bias"])


# The default proof is test_mtp.py's training test: this model with its MTP block, the experts
# split over fsdp x tensor x expert (dropless: each token to its experts), against one device.
@pytest.mark.exhaustive
@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2, expert=2), dict(fsdp=4, tensor=2)])
def test_deepseek_trains_sharded_as_on_one_device(mesh):
    """Latent attention, dense first layer, sigmoid group routing with a shared expert and bias
    balancing: the losses and the moved biases of a sharded run equal one device's."""
    c = _config(bias_update_rate=1e-3)
    c.model.update(attention_kind="latent")
    c.model.mla.update(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8)
    one_losses, one_bias = _run(c, jax.devices()[:1])
    assert one_losses[-1] < one_losses[0] and np.abs(one_bias).max() > 0
    c.mesh.update({**dict(data=1, fsdp=1, tensor=1, expert=1), **mesh})
    losses, bias = _run(c, jax.devices())
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    np.testing.assert_array_equal(bias, one_bias)


@pytest.mark.parametrize("moe,culprit", [
    (dict(n_group=3), "n_group=3"),
    (dict(topk_group=5), "topk_group=5"),
    (dict(router="softmax_topk"), "n_group=4"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor=0.0"),
    (dict(first_k_dense_replace=4), "first_k_dense_replace=4"),
])
def test_deepseek_routing_mistakes_are_one_paragraph(moe, culprit):
    with pytest.raises(ConfigError, match=culprit):
        validate(_config(**moe))


@pytest.mark.parametrize("change, culprit", [
    (dict(mesh=dict(data=1, pipeline=2)), "bias_update_rate=0.001 with mesh.pipeline"),
    (dict(lora=dict(rank=4, save_adapters_only=True)), "lora.save_adapters_only=True saves"),
])
def test_where_the_bias_moves_would_be_lost_it_is_refused(change, culprit):
    c = _config(bias_update_rate=1e-3, first_k_dense_replace=0)
    for section, fields in change.items():
        c[section].update(fields)
    with pytest.raises(ConfigError, match=culprit) as err:
        validate(c)
    assert "\n" not in str(err.value)
