"""Attention sinks (GPT-OSS's `model.attn_sinks`): a learned logit per head joins each query's
softmax as a key without a value. The einsum kernel equals a numpy reference with the sink
column (and plain attention when the sink is very negative), splash (interpret mode) equals
einsum, attention across sequence shards (every variant, einsum and splash blocks; `ring_vjp` by
its custom backward) equals one device in the output and in the gradients of q, k, v and the
sinks, and the fused kernel, which cannot take them, is refused in one paragraph."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.errors import ConfigError
from jaxscale.mesh import make_mesh
from jaxscale.models.attention.kernels import attend
from jaxscale.models.attention.mask import Mask
from jaxscale.models.decoder.config import check_config, check_mesh
from jaxscale.rules import PRESETS, AxisRules, constrain, normalize_rules, use_rules

B, T, H, K, D = 2, 16, 4, 2, 8
SEGMENTS = np.array([[1] * 5 + [2] * 9 + [0] * 2, [1] * T], np.int32)
RULES = AxisRules(normalize_rules(PRESETS["fsdp_tp"]))


def _inputs(t=T, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (B, t, H, D)), jax.random.normal(keys[1], (B, t, K, D)),
            jax.random.normal(keys[2], (B, t, K, D)), jax.random.normal(keys[3], (H,)) + 1.0)


def _reference(q, k, v, sinks, visible):
    """numpy: scores, a sink column per head, softmax, the sink's column dropped."""
    q, k, v, sinks = map(np.asarray, (q, k, v, sinks))
    k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
    scores = np.where(visible[:, None], scores, -np.inf)
    sink = np.broadcast_to(sinks[None, :, None, None], (*scores.shape[:-1], 1))
    full = np.concatenate([scores, sink], -1)
    probs = np.exp(full - full.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., :-1]
    return np.einsum("bhts,bshd->bthd", probs, v)


def test_einsum_sinks_equal_the_reference_and_vanish_when_very_negative():
    q, k, v, sinks = _inputs()
    causal = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    same = SEGMENTS[:, :, None] == SEGMENTS[:, None, :]
    mask = Mask.sequence(T, jnp.asarray(SEGMENTS))
    out = attend(q, k, v, mask, sinks_H=sinks)
    np.testing.assert_allclose(out, _reference(q, k, v, sinks, causal & same), atol=1e-5)
    plain = attend(q, k, v, mask)
    assert np.abs(np.asarray(out - plain)).max() > 0.05  # the sinks take weight
    np.testing.assert_allclose(attend(q, k, v, mask, sinks_H=jnp.full((H,), -1e4)), plain,
                               atol=1e-6)
    # Decoding: two new queries over an 8-slot cache take the same sinks.
    q2, k8, v8, _ = _inputs(t=8, seed=1)
    visible = (np.arange(8)[None, :] <= np.array([3, 4])[:, None])[None].repeat(B, 0)
    out = attend(q2[:, :2], k8, v8, Mask.cached(2, jnp.int32(3), 8), sinks_H=sinks)
    np.testing.assert_allclose(out, _reference(q2[:, :2], k8, v8, sinks, visible), atol=1e-5)


def test_splash_sinks_equal_einsum_with_gradients():
    """The splash kernel's own sinks (interpret mode off TPU), 128 tokens (its lane grid)."""
    q, k, v, sinks = _inputs(t=128, seed=2)

    def loss(impl):
        return lambda *a: jnp.sum(jnp.sin(attend(*a[:3], Mask.sequence(128), impl=impl,
                                                 sinks_H=a[3])))
    with pytest.warns(UserWarning, match="interpret mode"):
        got = jax.value_and_grad(loss("splash"), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    ref = jax.value_and_grad(loss("einsum"), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for name, g, r in zip(("q", "k", "v", "sinks"), got[1], ref[1]):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=f"d loss / d {name}")


def _sharded_loss(mesh, variant, impl="einsum", t=T, segments=SEGMENTS):
    def loss(q, k, v, sinks):
        mask = Mask.sequence(t, jnp.asarray(segments), window=5)
        if mesh is None:
            return jnp.sum(jnp.sin(attend(q, k, v, mask, sinks_H=sinks)))
        with use_rules(RULES, mesh):
            q = constrain(q, "batch", "length", "heads", "head_dim")
            k = constrain(k, "batch", "length", "kv", "head_dim")
            v = constrain(v, "batch", "length", "kv", "head_dim")
            out = attend(q, k, v, mask, impl=impl, context_impl=variant, sinks_H=sinks)
        return jnp.sum(jnp.sin(out))
    return loss


@pytest.mark.parametrize("variant, mesh", [
    ("allgather", {"context": 4, "data": 2}),
    ("ring_vjp", {"context": 4, "data": 2}),
    ("ring", {"context": 2, "tensor": 2, "fsdp": 2}),
    pytest.param("ring", {"context": 4, "data": 2}, marks=pytest.mark.exhaustive),
    pytest.param("allgather", {"context": 2, "tensor": 2, "fsdp": 2},
                 marks=pytest.mark.exhaustive)])
def test_sinks_across_sequence_shards_equal_one_device(variant, mesh):
    """Packed documents with padding and a window shorter than a shard; heads split over
    `tensor` in the second mesh, so the sinks are split with them."""
    grad = lambda m: jax.jit(jax.value_and_grad(_sharded_loss(m, variant),
                                                argnums=(0, 1, 2, 3)))(*_inputs())
    (loss, grads), (ref_loss, ref_grads) = grad(make_mesh(mesh)), grad(None)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name, g, r in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=f"d loss / d {name}")
    assert np.abs(np.asarray(ref_grads[3])).min() > 0  # every head's sink is trained


@pytest.mark.filterwarnings("ignore:model.attention=splash")
@pytest.mark.parametrize("variant", [
    "ring_vjp", pytest.param("allgather", marks=pytest.mark.exhaustive)])
def test_splash_blocks_take_the_sinks_across_shards(variant):
    """The splash blocks (interpret mode) over 2 sequence shards of 256 tokens start their
    log-sum-exp merge from the sinks; the custom backward adds d sink."""
    t = 256
    segments = np.array([[1] * 100 + [2] * 140 + [0] * 16, [1] * t], np.int32)
    grad = lambda m, impl: jax.jit(jax.value_and_grad(
        _sharded_loss(m, variant, impl, t, segments), argnums=(0, 1, 2, 3)))
    traced = grad(make_mesh({"context": 2}, jax.devices()[:2]), "splash").trace(
        *_inputs(t, seed=4))
    assert "pallas_call" in str(traced.jaxpr)  # the splash kernels run, not the einsum blocks
    loss, grads = traced.lower().compile()(*_inputs(t, seed=4))
    ref_loss, ref_grads = grad(None, "einsum")(*_inputs(t, seed=4))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name, g, r in zip(("q", "k", "v", "sinks"), grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=2e-5, err_msg=f"d loss / d {name}")


def _model(**fields):
    return dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, embed=32, mlp=64,
                max_len=64, vocab_size=64, attn_sinks=True, **fields)


def test_the_fused_kernel_is_refused_in_one_paragraph_and_every_shard_variant_runs():
    with pytest.raises(ConfigError, match="model.attention='dot_product_attention' has no "
                                          "attention sinks") as err:
        check_config(_model(attention="dot_product_attention"), 16)
    assert "\n" not in str(err.value)
    for variant in ("allgather", "ring", "ring_vjp"):  # every variant takes them
        check_mesh(_model(context_attention=variant), {"context": 4}, 16)
