"""Fused q/k/v and gate/up weights (models/nn/fused.py): the fused model computes what separate
projections compute, the parts convert exactly, and weights of the pre-fusion layout load
(converted) while a pre-fusion training checkpoint refuses to resume with a clear error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.models import ModelDef
from jaxscale.models.nn.fused import GATE_UP, QKV, fuse_parts, is_legacy, unfuse
from jaxscale.precision import get_policy
from jaxscale.train.checkpoint import Checkpointer
from jaxscale.train.state import TrainState
from jaxscale.weights.init_from import export_params
from jaxscale.weights.restore import CheckpointError
from jaxscale.weights.sources import open_weights
from jaxscale.weights.tree import flatten, unflatten

MODEL = dict(name="llama", vocab_size=64, embed=32, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, mlp=48)


@pytest.fixture(scope="module")
def model():
    model_def = ModelDef.build(MODEL, get_policy("32-true"))
    return model_def, jax.device_get(model_def.init_params(jax.random.key(0)))


def test_split_join_exact_and_grouped_by_kv_head():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 6, 8)), rng.normal(size=(3, 2, 8)), rng.normal(size=(3, 2, 8))
    w = QKV.join(q, k, v)
    assert w.shape == (3, 2, 3 + 2, 8)  # (E, K, G + 2, D): G = 3 query heads per kv head
    for got, want in zip(QKV.split(w), (q, k, v)):
        np.testing.assert_array_equal(got, want)
    # kv head 1 holds query heads 3..5 (query head h reads kv head h // G), then k, then v.
    np.testing.assert_array_equal(w[:, 1, :3], q[:, 3:6])
    np.testing.assert_array_equal(w[:, 1, 3], k[:, 1])
    g, u = rng.normal(size=(2, 4, 5))
    assert [x.tolist() for x in GATE_UP.split(GATE_UP.join(g, u))] == [g.tolist(), u.tolist()]


def _reference_block_out(params, x_BTE):
    """Attention q/k/v and MLP gate/up of layer 0 as separate projections (the old layout)."""
    flat, _ = unfuse(flatten(params))
    h, kv, d = MODEL["num_heads"], MODEL["num_kv_heads"], MODEL["head_dim"]
    q = jnp.einsum("bte,ehd->bthd", x_BTE, flat["layers/attn/wq"][0])
    k = jnp.einsum("bte,ekd->btkd", x_BTE, flat["layers/attn/wk"][0])
    v = jnp.einsum("bte,ekd->btkd", x_BTE, flat["layers/attn/wv"][0])
    gate = jnp.einsum("bte,ef->btf", x_BTE, flat["layers/mlp/w_gate"][0])
    up = jnp.einsum("bte,ef->btf", x_BTE, flat["layers/mlp/w_up"][0])
    assert q.shape[2:] == (h, d) and k.shape[2:] == (kv, d)
    return q, k, v, jax.nn.silu(gate) * up


def test_fused_projections_equal_separate_ones(model):
    model_def, params = model
    m = model_def.module(params)
    x_BTE = jax.random.normal(jax.random.key(1), (2, 5, MODEL["embed"]))
    layer0 = jax.tree.map(lambda a: a[0], nnx_state_of(m.layers))
    attn, mlp = layer0["attn"], layer0["mlp"]
    qkv = QKV.split(jnp.einsum("bte,ekcd->btkcd", x_BTE, attn["wqkv"]))
    gate, up = GATE_UP.split(jnp.einsum("bte,ecf->btcf", x_BTE, mlp["w_gate_up"]))
    q, k, v, hidden = _reference_block_out(params, x_BTE)
    for got, want in zip(qkv, (q, k, v)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.nn.silu(gate) * up, hidden, rtol=1e-6, atol=1e-6)


def nnx_state_of(module):
    from flax import nnx
    return nnx.to_pure_dict(nnx.state(module))


def test_legacy_weights_load_converted(model, tmp_path):
    """Weights saved in the pre-fusion layout (separate parts) open as the fused leaves, bit
    for bit, and give the same logits."""
    model_def, params = model
    legacy, _ = unfuse(flatten(params))
    assert is_legacy(legacy) and not is_legacy(flatten(params))
    export_params(str(tmp_path / "old"), legacy)
    weights = open_weights(str(tmp_path / "old"))
    assert set(weights.leaves) == set(flatten(params))
    assert weights.leaves["layers/attn/wqkv"].shape == flatten(params)["layers/attn/wqkv"].shape
    loaded = weights.arrays()
    for path, want in flatten(params).items():
        np.testing.assert_array_equal(loaded[path], want, err_msg=path)
    tokens = jnp.arange(12).reshape(2, 6) % MODEL["vocab_size"]
    np.testing.assert_array_equal(model_def.module(unflatten(loaded))(tokens),
                                  model_def.module(params)(tokens))
    assert set(fuse_parts(legacy)) == set(flatten(params))


def test_legacy_training_checkpoint_refuses_to_resume_naming_the_fix(model, tmp_path):
    model_def, params = model
    legacy = unflatten(unfuse(flatten(params))[0])
    old = TrainState(jnp.int32(3), legacy, {}, {}, jax.random.key_data(jax.random.key(0)), {})
    ckpt = Checkpointer(str(tmp_path), every=1, keep=2)
    ckpt.save(3, old, None)
    ckpt.manager.wait_until_finished()
    new = TrainState(jnp.int32(0), params, {}, {}, jax.random.key(0), {})
    shardings = jax.tree.map(lambda a: jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                             new)
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(new, shardings)
    text = str(e.value)
    assert "step 3" in text and "fused" in text and "--config.init_from" in text
    assert (tmp_path / "checkpoints" / "3").is_dir()  # nothing moved aside or deleted


def test_gpipe_head_runs_split_over_stages():
    """Under GPipe the head's logits are split over `pipeline` by rows (each stage computes the
    head once for its share, not every stage for every row), and the logits equal the scan's."""
    from jaxscale.mesh import make_mesh
    from jaxscale.parallel.schedules import make_layer_runner
    from jaxscale.rules import PRESETS, AxisRules, use_rules

    mesh = make_mesh({"pipeline": 2, "data": 4})
    model_def = ModelDef.build(MODEL, get_policy("32-true"))
    params = model_def.init_params(jax.random.key(0))
    runner = make_layer_runner(dict(microbatches=2), mesh, num_layers=MODEL["num_layers"])
    rules = AxisRules(tuple(PRESETS["pp"]))
    tokens = jnp.arange(16 * 6).reshape(16, 6) % MODEL["vocab_size"]

    def logits(params, run_layers):
        with use_rules(rules, mesh):
            return model_def.module(params)(tokens, run_layers=run_layers)

    got = jax.jit(logits, static_argnums=1)(params, runner)
    want = jax.jit(logits, static_argnums=1)(params, None)
    assert "pipeline" in str(got.sharding.spec[0]), got.sharding.spec
    assert "pipeline" not in str(want.sharding.spec[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
