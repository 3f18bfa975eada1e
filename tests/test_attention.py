"""The one attention implementation: both kernels agree under every mask kind (whole sequence,
KV cache, packed segments), and decoding through the model's own cache equals the full forward
pass for each kernel."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_lm
from jaxscale.models import ModelDef
from jaxscale.models.attention.grouped_query import KVCache
from jaxscale.models.attention.kernels import ATTENTION_IMPLS, attend
from jaxscale.models.attention.mask import Mask
from jaxscale.precision import get_policy


def _qkv(b=2, t=6, s=6, h=4, k=2, d=8, seed=0):
    q, kk, v = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(q, (b, t, h, d)), jax.random.normal(kk, (b, s, k, d)),
            jax.random.normal(v, (b, s, k, d)))


def _reference(q_BTHD, k_BSKD, v_BSKD, visible_BTS):
    """Plain numpy attention, heads repeated for grouped queries."""
    q, k, v = map(np.asarray, (q_BTHD, k_BSKD, v_BSKD))
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.asarray(visible_BTS)[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", probs, v)


@pytest.mark.parametrize("impl", sorted(ATTENTION_IMPLS))
def test_kernels_match_reference_under_every_mask(impl):
    q, k, v = _qkv()
    causal = np.tril(np.ones((6, 6), bool))[None].repeat(2, 0)
    segments = jnp.asarray([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    same = np.asarray(segments)[:, :, None] == np.asarray(segments)[:, None, :]
    cases = [(Mask.sequence(6), causal),
             (Mask.sequence(6, segments_BT=segments), causal & same),
             (Mask.sequence(6, causal=False), np.ones((2, 6, 6), bool))]
    for mask, visible in cases:
        out = attend(q, k, v, mask, impl=impl)
        chex.assert_shape(out, q.shape)
        chex.assert_trees_all_close(out, _reference(q, k, v, visible), atol=1e-5, rtol=1e-5)
    # Two new queries at cache slots 3, 4 of an 8-slot cache: slots 5.. are not written yet.
    q2, k8, v8 = _qkv(t=2, s=8, seed=1)
    visible = (np.arange(8)[None, :] <= np.array([3, 4])[:, None])[None].repeat(2, 0)
    out = attend(q2, k8, v8, Mask.cached(2, jnp.int32(3), 8), impl=impl)
    chex.assert_trees_all_close(out, _reference(q2, k8, v8, visible), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", sorted(ATTENTION_IMPLS))
def test_decoding_through_the_model_cache_equals_full_forward(impl):
    c = tiny_lm.get_config("test")
    c.model.update(attention=impl)
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    params = model_def.init_params(jax.random.key(2))
    tokens = np.random.default_rng(3).integers(0, 256, (2, 7)).astype(np.int32)

    @jax.jit
    def cached(p, toks):
        model = model_def.module(p)
        cache = model.init_cache(2, 7)
        chex.assert_shape(cache.k, (c.model.num_layers, 2, c.model.num_kv_heads, 7,
                                    c.model.head_dim))
        first, cache = model(toks[:, :3], cache=cache, cache_index=jnp.int32(0))
        rest = []
        for i in range(3, 7):
            logits, cache = model(toks[:, i:i + 1], cache=cache, cache_index=jnp.int32(i))
            rest.append(logits)
        return jnp.concatenate([first] + rest, axis=1), cache

    logits, cache = cached(params, tokens)
    assert isinstance(cache, KVCache)
    full = jax.jit(lambda p, t: model_def.module(p)(t))(params, tokens)
    chex.assert_trees_all_close(logits, full, atol=1e-5, rtol=1e-5)


def test_unknown_kernel_is_named():
    c = tiny_lm.get_config("test")
    c.model.update(attention="flash9")
    with pytest.raises(ValueError, match="flash9.*einsum"):
        ModelDef.build(c.model, get_policy("32-true"))
