"""Segment ids with the KV cache: prompts of different lengths, left-padded into one batch
(segment 0 on padding, positions from each prompt's first token), prefill and decode exactly as
each prompt alone: logits to 1e-5 in float32, greedy tokens equal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.inference import generate as gen
from jaxscale.models.attention.kernels import ATTENTION_IMPLS
from tests.test_generate import tiny

LENGTHS = (3, 8, 5)
WIDTH, STEPS = 8, 4


def _prompts() -> tuple[list[np.ndarray], np.ndarray]:
    """The prompts alone and left-padded into one (3, WIDTH) batch (padding token 7: any
    value, the segment mask must hide it)."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 256, n).astype(np.int32) for n in LENGTHS]
    batch = np.full((len(prompts), WIDTH), 7, np.int32)
    for r, p in enumerate(prompts):
        batch[r, WIDTH - len(p):] = p
    return prompts, batch


@pytest.mark.parametrize("impl", sorted(ATTENTION_IMPLS))
def test_padded_prefill_and_decode_equal_each_prompt_alone(impl):
    model_def, params = tiny(attention=impl, num_kv_heads=1)
    prompts, batch = _prompts()
    follow = np.random.default_rng(3).integers(1, 256, (len(prompts), STEPS)).astype(np.int32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)

    @jax.jit
    def cached(p, batch, follow):
        model = model_def.module(p)
        cache = model.init_cache(len(LENGTHS), WIDTH + STEPS)
        rows = gen.left_padded_rows(lengths, WIDTH)
        first, cache = gen.forward_cached(model, batch, jnp.int32(0), cache, **rows)
        out = [first[:, -1]]
        for i in range(STEPS):  # one token at a time, positions continuing each prompt
            logits, cache = gen.forward_cached(
                model, follow[:, i:i + 1], jnp.int32(WIDTH + i), cache,
                positions_BT=(lengths + i)[:, None],
                segments_BT=jnp.ones((len(LENGTHS), 1), jnp.int32))
            out.append(logits[:, -1])
        return jnp.stack(out, axis=1)  # (B, STEPS + 1, V): the next-token logits

    got = np.asarray(cached(params, batch, follow))
    alone = jax.jit(lambda p, t: model_def.module(p)(t))
    for r, prompt in enumerate(prompts):
        seq = np.concatenate([prompt, follow[r]])[None]
        want = np.asarray(alone(params, seq))[0, len(prompt) - 1:]
        np.testing.assert_allclose(got[r], want, atol=1e-5, rtol=1e-5)


def test_ragged_greedy_generation_equals_each_prompt_alone():
    model_def, params = tiny()
    prompts, batch = _prompts()
    fn = gen.make_generate(model_def, steps=STEPS)
    out = np.asarray(fn(params, batch, jax.random.key(0), jnp.asarray(LENGTHS, jnp.int32)))
    for r, prompt in enumerate(prompts):
        alone = np.asarray(fn(params, prompt[None], jax.random.key(0)))[0]
        np.testing.assert_array_equal(out[r, WIDTH - len(prompt):], alone)


def test_without_segments_padding_would_leak():
    """The property above is not vacuous: decoding the padded batch without segment ids
    differs from the short prompt alone."""
    model_def, params = tiny()
    prompts, batch = _prompts()
    plain = jax.jit(lambda p, t: model_def.module(p)(t))
    padded = np.asarray(plain(params, batch[:1]))[0, -1]
    alone = np.asarray(plain(params, prompts[0][None]))[0, -1]
    assert np.abs(padded - alone).max() > 1e-3
