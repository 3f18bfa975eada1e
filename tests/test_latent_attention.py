"""Multi-head latent attention (`model.attention_kind=latent`, DeepSeek-V2/V3).

It trains; decoding from its compressed cache (the latent and the rope key, absorbed
up-projections) gives the full forward's logits; its cache is kv_lora_rank + qk_rope_head_dim
numbers per token and layer; its parameter and FLOP counts are the hand-computed ones.
"""

import jax
import ml_collections as mlc
import numpy as np
import pytest

from configs import tiny_lm
from helpers import assert_cached_decoding_is_the_full_forward
from jaxscale.aot.memory import Dims
from jaxscale.config import validate
from jaxscale.errors import ConfigError
from jaxscale.inference import generate as gen
from jaxscale.models import ModelDef, entry_of
from jaxscale.models.adapters import lora
from jaxscale.models.attention.latent import LatentCache
from jaxscale.precision import get_policy
from jaxscale.weights.tree import flatten, unflatten
from test_generate import uncached_greedy
from test_parallel_equivalence import assert_equal_runs, make_config, run_steps

# Unequal widths everywhere, so a swapped dimension cannot pass unnoticed.
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12,
           v_head_dim=10)


def _config(mla=MLA, **model):
    c = tiny_lm.get_config("test")
    c.model.update(attention_kind="latent", **model)
    c.model.mla.update(mla)
    return c


def _model(c, seed=1):
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    return model_def, model_def.init_params(jax.random.key(seed))


def test_parameters_cache_and_flops_are_the_hand_counts():
    c = _config()
    validate(c)
    m = c.model
    L, E, H, F, V, T = m.num_layers, m.embed, m.num_heads, m.mlp, m.vocab_size, c.data.seq_len
    model_def, params = _model(c)
    shapes = model_def.shapes()
    assert shapes["layers/attn/wq_a"].shape == (L, E, 24)
    assert shapes["layers/attn/wq_b"].shape == (L, 24, H, 20)
    assert shapes["layers/attn/wkv_a"].shape == (L, E, 16 + 8)
    assert shapes["layers/attn/wkv_b"].shape == (L, 16, H, 12 + 10)
    assert shapes["layers/attn/wo"].shape == (L, H, 10, E)
    attn = E * 24 + 24 * H * 20 + E * 24 + 16 * H * (12 + 10) + H * 10 * E
    assert model_def.num_params() == entry_of(m).config_cls.from_config(m).num_params()
    assert model_def.num_params() == V * E * 2 + E + L * (attn + 24 + 16 + 2 * E + 3 * E * F)
    # The cache: the latent and the rope key, per token and layer, not per head.
    cache = model_def.module(params).init_cache(2, 8)
    assert isinstance(cache, LatentCache)
    assert cache.latent.shape == (L, 2, 8, 16) and cache.k_rope.shape == (L, 2, 8, 8)
    assert Dims.from_model(m, 1).attention_widths["attn_out"] == H * 10
    # PaLM's count: 6 per matmul parameter, and QK^T (20 wide) plus AV (10 wide) per head.
    assert entry_of(m).flops_per_token(m, T) == 6 * (L * (attn + 3 * E * F) + E * V) \
        + 6 * L * H * (20 + 10) * T


@pytest.mark.parametrize("mla", [MLA, dict(MLA, q_lora_rank=0)], ids=["q_lora", "q_direct"])
def test_decoding_from_the_latent_cache_is_the_full_forward(mla):
    model_def, params = _model(_config(mla))
    tokens = np.random.default_rng(1).integers(0, 256, (2, 7)).astype(np.int32)

    assert_cached_decoding_is_the_full_forward(model_def, params, tokens)
    prompt = tokens[:, :4]
    out = gen.make_generate(model_def, steps=5)(params, prompt, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out), uncached_greedy(model_def, params, prompt, 5))


@pytest.mark.parametrize("impl", ["dot_product_attention"])
def test_kernels_that_need_equal_head_dims_get_the_same_attention(impl):
    """The fused kernel takes one head dim: the values are zero-padded to the key's width."""
    c = _config()
    model_def, params = _model(c)
    tokens = np.random.default_rng(2).integers(0, 256, (2, 8)).astype(np.int32)
    want = jax.jit(lambda p, t: model_def.module(p)(t))(params, tokens)
    c.model.attention = impl
    other = ModelDef.build(c.model, get_policy("32-true"))
    got = jax.jit(lambda p, t: other.module(p)(t))(params, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_trains_and_matches_one_device_on_fsdp_x_tensor():
    configs = [make_config(mesh) for mesh in (dict(data=1), dict(fsdp=2, tensor=2))]
    for c in configs:
        c.model.attention_kind = "latent"
        c.model.mla.update(MLA)
    one = run_steps(configs[0], jax.devices()[:1])
    sharded = run_steps(configs[1], jax.devices()[:4])
    assert_equal_runs(sharded, one)


@pytest.mark.exhaustive  # the fsdp x tensor run above is the default proof
@pytest.mark.parametrize("mesh, variant", [
    (dict(context=2, fsdp=2, tensor=2), "allgather"),
    (dict(context=4, data=2), "ring")])
def test_sequence_shards_train_as_one_device(mesh, variant):
    """Across sequence shards the values are zero-padded to the key's width (`_attend`)."""
    configs = [make_config(m) for m in (dict(data=1), mesh)]
    for c in configs:
        c.model.update(attention_kind="latent", context_attention=variant)
        c.model.mla.update(MLA)
    one = run_steps(configs[0], jax.devices()[:1])
    assert_equal_runs(run_steps(configs[1], jax.devices()), one)


@pytest.mark.parametrize("field,value", [("qk_norm", True), ("sliding_window", 16),
                                         ("attn_sinks", True)])
def test_switches_latent_attention_lacks_are_refused(field, value):
    c = _config(**{field: value})
    with pytest.raises(ConfigError, match=f"model.{field}=.* has no place in latent"):
        validate(c)


def test_odd_rope_width_is_refused():
    c = _config(dict(MLA, qk_rope_head_dim=7))
    with pytest.raises(ConfigError, match="qk_rope_head_dim \\(even"):
        validate(c)


def test_lora_adapts_every_latent_projection_and_merges_exactly():
    """Adapters on all six projections (`LORA_WEIGHTS`): the adapted model decodes from its
    cache (the absorbed up-projection reads the adapted weight) as its full forward, and
    equals the model with the adapters merged."""
    c = _config()
    lora_cfg = mlc.ConfigDict(dict(rank=2, alpha=4.0, targets=("attn/w",), dropout=0.0))
    model_def = lora.with_adapters(ModelDef.build(c.model, get_policy("32-true")), lora_cfg)
    params = flatten(model_def.init_params(jax.random.key(0)))
    adapted = {p.removesuffix("_lora_a") for p in params if p.endswith("_lora_a")}
    assert adapted == {f"layers/attn/{w}" for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")}
    rng = np.random.default_rng(0)
    params = unflatten({k: rng.normal(scale=0.1, size=v.shape).astype(np.float32)
                        if k.endswith("_lora_b") else v for k, v in params.items()})
    tokens = np.random.default_rng(1).integers(0, 256, (2, 6)).astype(np.int32)
    full = jax.jit(lambda p, t: model_def.module(p)(t))(params, tokens)

    assert_cached_decoding_is_the_full_forward(model_def, params, tokens, prefill=4)
    plain = ModelDef.build(c.model, get_policy("32-true"))
    merged = lora.merge(params, lora_cfg)
    np.testing.assert_allclose(np.asarray(plain.module(merged)(tokens)), np.asarray(full),
                               atol=1e-4)
