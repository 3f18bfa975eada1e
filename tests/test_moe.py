"""The mixture-of-experts block (jaxscale/models/moe/layer.py): both compute paths equal a plain loop
over tokens and experts, the capacity path drops exactly the assignments expected, the router's
losses equal hand-computed values, gradients reach every weight, config mistakes are one
paragraph, and a tiny MoE decoder trains (losses and `moe_*` metrics from the step)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.tiny_lm import get_config
from jaxscale.config import validate
from jaxscale.errors import ConfigError
from jaxscale.models.decoder import lm_task
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.decoder.llama import Llama
from jaxscale.models.moe.config import MoEConfig
from jaxscale.models.moe.layer import MoE, capacity, check_moe
from jaxscale.models.moe.routers import METRICS, STATS, route
from jaxscale.models.task import step_metrics
from jaxscale.precision import get_policy
from jaxscale.train.loop import Trainer

POLICY = get_policy("32-true")


def _block(embed=8, mlp=16, **fields) -> MoE:
    return MoE(embed, mlp, MoEConfig(**fields), POLICY, nnx.Rngs(0))


@nnx.jit
def _apply(block: MoE, x_BTE: jax.Array) -> jax.Array:
    """The block's output, jitted (its sown `router_stats` land on `block`)."""
    return block(x_BTE)


def _loop(block: MoE, x_BTE: jax.Array, keep=None) -> np.ndarray:
    """The block's output token by token and choice by choice; `keep[n, j]` False drops token
    n's j-th choice."""
    x_NE = np.asarray(x_BTE.reshape(-1, x_BTE.shape[-1]), np.float64)
    weights, experts, _, _ = jax.device_get(jax.jit(route, static_argnums=2)(
        jnp.asarray(x_NE, jnp.float32), block.router[...], block.moe))
    gate, up, down = (np.asarray(w[...], np.float64) for w in (block.w_gate, block.w_up,
                                                                block.w_down))
    out = np.zeros_like(x_NE)
    for n in range(x_NE.shape[0]):
        for j, e in enumerate(experts[n]):
            if keep is None or keep[n][j]:
                g, u = x_NE[n] @ gate[e], x_NE[n] @ up[e]
                out[n] += float(weights[n, j]) * ((g / (1 + np.exp(-g)) * u) @ down[e])
    out = out.reshape(x_BTE.shape)
    if block.moe.shared_experts:
        out = out + np.asarray(nnx.jit(lambda mlp, x: mlp(x))(block.shared, x_BTE))
    return out


@pytest.mark.parametrize("fields", [
    dict(num_experts=4, experts_per_token=2),                                   # Mixtral-like
    dict(num_experts=6, experts_per_token=3, norm_topk_prob=False, shared_experts=1, mlp=12),
    dict(num_experts=4, experts_per_token=1, capacity_factor=4.0),  # buffers hold every token
    dict(num_experts=5, experts_per_token=2, capacity_factor=5.0, shared_experts=2),
])
def test_compute_paths_equal_a_loop_over_experts(fields):
    block = _block(**fields)
    x = jax.random.normal(jax.random.key(1), (2, 7, 8))
    got = np.asarray(_apply(block, x))
    np.testing.assert_allclose(got, _loop(block, x), rtol=1e-5, atol=1e-6)
    assert float(block.router_stats.get_value()[STATS.index("dropped")]) == 0.0


@pytest.mark.parametrize("capacity_factor", [0.0, 2.0])
def test_remat_policies_keep_the_experts_gate_up_by_name(capacity_factor, capsys):
    """The experts' gate/up outputs carry the dense MLP's `mlp_gate_up` name, so a policy that
    keeps it (`minimal`) saves them for the backward pass and `save_qkv_proj` does not."""
    from jaxscale.models.nn.scan import REMAT_POLICIES

    graphdef, state = nnx.split(_block(num_experts=4, experts_per_token=2,
                                       capacity_factor=capacity_factor))

    def saved(remat: str) -> int:
        fn = jax.checkpoint(lambda s, x: nnx.merge(graphdef, s)(x).sum(),
                            policy=REMAT_POLICIES[remat])
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(fn, state, jnp.ones((2, 5, 8)))
        return capsys.readouterr().out.count("named 'mlp_gate_up'")

    assert (saved("minimal"), saved("save_qkv_proj")) == (2, 0)  # gate and up


def test_capacity_path_drops_the_expected_assignments():
    """3 tokens, 3 experts, top-2, capacity 1.0: ceil(6 / 3) = 2 slots per expert. Choices
    (0, 1), (1, 0), (0, 1): the first choices fill expert 0's two slots and one of expert 1's;
    then token 0's second choice takes expert 1's last slot, and tokens 1 and 2's second
    choices find their experts full."""
    block = _block(embed=4, num_experts=3, experts_per_token=2, capacity_factor=1.0)
    block.router[...] = jnp.array([[2.0, 1, 0], [1, 2, 0], [2, 1, 0], [0, 0, 0]])
    x = jnp.eye(4)[None, :3]
    assert capacity(1.0, 6, 3) == 2
    got = np.asarray(_apply(block, x))
    keep = [[True, True], [True, False], [True, False]]
    np.testing.assert_allclose(got, _loop(block, x, keep), rtol=1e-5, atol=1e-6)
    stats = dict(zip(STATS, np.asarray(block.router_stats.get_value())))
    assert stats["dropped"] == pytest.approx(2 / 6)
    # Loads count routed assignments (before drops): 3, 3, 0 of 6 over 3 experts.
    assert (stats["load_max"], stats["load_min"]) == pytest.approx((1.5, 0.0))


def test_router_losses_equal_hand_computed_values():
    logits = np.array([[1.0, 0.0, -1.0, 0.5], [0.0, 2.0, 0.0, 0.0], [0.3, 0.2, 0.1, 0.0]])
    cfg = MoEConfig(num_experts=4, experts_per_token=2)
    # x = identity rows, so the router's rows are the logits.
    weights, experts, stats, _ = route(jnp.eye(3), jnp.asarray(logits, jnp.float32), cfg)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    top2 = [[0, 3], [1, 0], [0, 1]]  # by hand from the logits
    np.testing.assert_array_equal(np.asarray(experts), top2)
    want_w = np.take_along_axis(probs, np.array(top2), 1)
    np.testing.assert_allclose(weights, want_w / want_w.sum(-1, keepdims=True), rtol=1e-6)
    share = np.array([3, 2, 0, 1]) / 6  # assignments per expert / (3 tokens x 2)
    aux = 4 * np.sum(share * probs.mean(0))
    z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(stats, [aux, z, 0.0, 4 * 3 / 6, 0.0], rtol=1e-6)


def _tiny_moe_config(**moe_fields):
    c = get_config("test")
    c.model.moe.update({**dict(num_experts=4, experts_per_token=2, router_z_loss_coef=1e-3),
                        **moe_fields})
    c.mesh.data = 1
    return c


def test_the_decoder_adds_its_router_losses_and_records_the_metrics():
    c = _tiny_moe_config(router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    cfg = LlamaConfig.from_config(c.model)
    model = Llama(cfg, nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 9), 0, 256)

    @nnx.jit
    def run(model):
        total = lm_task.lm_loss(model, {"tokens": tokens})
        metrics = step_metrics(model)
        positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
        h = model.hidden(tokens[:, :-1], positions)  # the same forward pass, stats kept
        plain = lm_task.mean_head_loss(model, h, tokens[:, 1:])
        return total, metrics, plain, model.layers.mlp.router_stats.get_value()

    total, metrics, plain, stats_LS = run(model)
    assert sorted(metrics) == sorted(METRICS.values())
    assert stats_LS.shape == (2, len(STATS))  # stacked over the 2 layers
    mean = dict(zip(STATS, np.asarray(stats_LS).mean(0)))
    assert float(metrics["moe_aux_loss"]) == pytest.approx(mean["aux"], rel=1e-6)
    assert float(total) == pytest.approx(
        float(plain) + 0.5 * mean["aux"] + 0.25 * mean["z"], rel=1e-6)
    assert cfg.num_params() == models_num_params(c.model)


def models_num_params(model_cfg) -> int:
    from jaxscale.models import ModelDef
    return ModelDef.build(model_cfg, POLICY).num_params()


@pytest.mark.parametrize("capacity_factor", [0.0, 8.0])
def test_gradients_reach_router_and_experts(capacity_factor):
    """Both paths give the same gradients when nothing is dropped, none zero or non-finite."""
    x = jax.random.normal(jax.random.key(3), (2, 5, 8))

    def grads(cf):
        block = _block(num_experts=4, experts_per_token=2, shared_experts=1,
                       capacity_factor=cf)
        graphdef, params, rest = nnx.split(block, nnx.Param, ...)

        def loss(p):
            m = nnx.merge(graphdef, p, rest)
            return jnp.sum(jnp.square(m(x))) + m.router_stats.get_value()[0]
        return nnx.to_flat_state(jax.jit(jax.grad(loss))(params))

    got, dropless = grads(capacity_factor), grads(0.0)
    for (path, g), (_, ref) in zip(got, dropless):
        g = np.asarray(g.get_value())
        assert np.isfinite(g).all() and np.abs(g).max() > 0, path
        np.testing.assert_allclose(g, np.asarray(ref.get_value()), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("override, culprit", [
    (dict(experts_per_token=5), "model.moe.experts_per_token=5"),
    (dict(capacity_factor=-1.0), "model.moe.capacity_factor=-1.0"),
    (dict(every=3), "model.moe.every=3"),  # does not divide the 2 layers
    (dict(router_aux_loss_coef=-0.1), "model.moe.router_aux_loss_coef=-0.1"),
])
def test_config_mistakes_are_one_paragraph(override, culprit):
    c = _tiny_moe_config()
    c.model.moe.update(override)
    with pytest.raises(ConfigError) as err:
        validate(c)
    assert culprit in str(err.value) and "\n" not in str(err.value)


def test_pipeline_stages_must_hold_whole_groups_of_every_layers():
    c = _tiny_moe_config(every=2)  # 2 layers: one group, which 2 stages cannot split
    c.mesh.update(data=4, pipeline=2)
    with pytest.raises(ConfigError, match="model.num_layers=2 must be divisible by 4") as err:
        validate(c)
    assert "\n" not in str(err.value)


def test_expert_axis_must_divide_the_experts():
    mesh = dict(data=2, expert=3)
    with pytest.raises(ConfigError, match=r"num_experts=4 is not divisible by the 3"):
        check_moe({"moe": dict(num_experts=4, experts_per_token=2)}, mesh)


@pytest.mark.parametrize("mesh, moe_fields, culprit", [
    (dict(data=2, expert=2, dcn_expert=2), dict(num_experts=6, capacity_factor=1.0),
     "num_experts=6 is not divisible by the 4 devices"),
    (dict(data=4, expert=2), dict(num_experts=0), "model.moe.num_experts=0"),
])
def test_expert_axis_mistakes_are_one_paragraph(mesh, moe_fields, culprit):
    c = _tiny_moe_config(**moe_fields)
    c.mesh.update(mesh)
    with pytest.raises(ConfigError) as err:
        validate(c)
    assert culprit in str(err.value) and "\n" not in str(err.value)


def test_flops_per_token_count_the_active_experts():
    """Top-2 of 4 experts plus one shared expert: a token passes 3 expert widths and the
    router (2 layers x embed 64 x 4 experts), not all 4 experts."""
    from jaxscale.models.decoder import flops

    c = _tiny_moe_config(shared_experts=1)
    dense = get_config("test").model
    dense.mlp = 3 * c.model.mlp
    extra = flops.flops_per_token(c.model, 32) - flops.flops_per_token(dense, 32)
    assert extra == 6.0 * 2 * 64 * 4


def _train(config, devices, steps: int = 4) -> tuple[np.ndarray, dict[str, float]]:
    """Losses of `steps` train steps and the last step's metrics."""
    trainer = Trainer.build(config, workdir=None, devices=devices)
    it = trainer.batches.iterator()
    state, losses = trainer.state, []
    for _ in range(steps):
        state, metrics = trainer.train_fn(state, trainer.to_global(next(it)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("capacity_factor, sharded", [
    (0.0, False),  # the sharded dropless proof by default: tests/test_moe_parallel.py
    pytest.param(0.0, True, marks=pytest.mark.exhaustive),
    pytest.param(1.0, True, marks=pytest.mark.exhaustive)])
def test_a_tiny_moe_decoder_trains_sharded_as_on_one_device(capacity_factor, sharded):
    """A scanned, rematerialised MoE decoder with a shared expert trains; its step reports the
    router's metrics; on data=2 x fsdp=2 x tensor=2 (expert weights' embed over fsdp, mlp over
    tensor; the router's statistics global under GSPMD) the losses equal one device's."""
    c = _tiny_moe_config(capacity_factor=capacity_factor, shared_experts=1,
                         router_aux_loss_coef=0.1)
    c.model.remat = "full"
    validate(c)
    one, m = _train(c, jax.devices()[:1])
    assert one[-1] < one[0] - 0.3, one
    assert m["moe_aux_loss"] >= 1.0 - 1e-5  # Switch's loss is 1 when balanced, more otherwise
    assert m["moe_load_max"] >= 1.0 >= m["moe_load_min"] >= 0.0
    assert m["moe_z_loss"] > 0.0 and all(math.isfinite(v) for v in m.values())
    assert (m["moe_dropped"] == 0.0) == (capacity_factor == 0.0)
    if sharded:
        c.mesh.update(data=2, fsdp=2, tensor=2)
        np.testing.assert_allclose(_train(c, jax.devices())[0], one, rtol=1e-5)


def test_greedy_decoding_with_the_cache_equals_the_full_forward():
    from jaxscale.inference.generate import make_generate
    from jaxscale.models import ModelDef

    model_def = ModelDef.build(_tiny_moe_config().model, POLICY)
    params = model_def.init_params(jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(4), (2, 5), 0, 256)
    tokens = make_generate(model_def, 3)(params, prompt, jax.random.key(0))
    logits = jax.jit(lambda p, t: model_def.module(p)(t))(params, tokens[:, :-1])
    np.testing.assert_array_equal(jnp.argmax(logits[:, 4:], -1), tokens[:, 5:])


def test_hugging_face_llama_export_refuses_experts():
    from jaxscale.interop.hf import ConversionError, llama_config_to_hf

    with pytest.raises(ConversionError, match="num_experts=4") as err:
        llama_config_to_hf(_tiny_moe_config().model)
    assert "\n" not in str(err.value)


def test_the_progress_line_shows_the_expert_load():
    import io

    from jaxscale.observe.progress import ProgressBar

    out = io.StringIO()
    ProgressBar(2, print_every=1, stream=out).update(1, {"loss": 2.0, "moe_load_max": 1.5,
                                                         "moe_load_min": 0.25})
    assert "load=1.50/0.25" in out.getvalue()
