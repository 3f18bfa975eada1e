"""YaRN rotary scaling (`models/nn/rope.py`) against transformers' own `_compute_yarn_parameters`
(the frequencies and the cos/sin `attention_factor`) and DeepSeek's `yarn_apply_mscale` (the
softmax scale), for GPT-OSS's settings (truncate off), DeepSeek-V3's (mscale terms) and the
defaults; the HF rope mapping reads and writes them back unchanged."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxscale.errors import ConfigError
from jaxscale.interop.hf_rope import rope_from_hf, rope_scaling_to_hf
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.nn.rope import Rope, check_rope, rotary

# name -> (HF config class, its kwargs). Head dims 64 (GPT-OSS, DeepSeek's rope dims) and 128.
CASES = {
    "gpt_oss": (transformers.GptOssConfig, dict(
        head_dim=64, rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                          beta_slow=1.0, truncate=False, rope_theta=150000.0,
                                          original_max_position_embeddings=4096))),
    "deepseek_v3": (transformers.DeepseekV3Config, dict(
        qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=dict(
            rope_type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0,
            mscale_all_dim=1.0, rope_theta=10000.0, original_max_position_embeddings=4096))),
    "defaults": (transformers.LlamaConfig, dict(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=131072,
        rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e6,
                             original_max_position_embeddings=32768))),
    "explicit_factor": (transformers.LlamaConfig, dict(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=65536,
        rope_parameters=dict(rope_type="yarn", factor=8.0, attention_factor=1.3,
                             rope_theta=5e5, original_max_position_embeddings=8192))),
}


def _hf(name):
    config_cls, kwargs = CASES[name]
    config = config_cls(**kwargs)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    return config, inv_freq.numpy(), attention_factor


def _ours(config) -> tuple[Rope, int]:
    fields = rope_from_hf(config.to_dict(), "config.json")
    dim = getattr(config, "qk_rope_head_dim", None) or config.head_dim
    return LlamaConfig.from_config(fields).rope, dim


@pytest.mark.parametrize("name", sorted(CASES))
def test_frequencies_and_attention_factor_equal_transformers(name):
    config, ref_freq, ref_factor = _hf(name)
    rope, dim = _ours(config)
    np.testing.assert_allclose(np.asarray(rope.inv_frequencies(dim)), ref_freq, rtol=1e-6)
    assert math.isclose(rope.attention_factor, ref_factor, rel_tol=1e-12)
    plain = 1.0 / (rope.theta ** (np.arange(0, dim, 2) / dim))
    ratio = plain / ref_freq  # kept, interpolated and ramped dimensions are all present
    assert np.isclose(ratio, 1.0).any() and np.isclose(ratio, rope.factor, rtol=1e-5).any()
    assert ((ratio > 1.01) & (ratio < rope.factor * 0.99)).any()


def test_deepseek_softmax_scale_equals_transformers():
    """DeepSeek's attention multiplies 1/sqrt(d) by `yarn_apply_mscale`'s factor; GPT-OSS's
    and the plain rotary's is 1."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    config, _, _ = _hf("deepseek_v3")
    rope, _ = _ours(config)
    assert math.isclose(rope.score_scale, yarn_apply_mscale(config.rope_parameters, 1.0))
    assert rope.score_scale > 1.3
    assert _ours(_hf("gpt_oss")[0])[0].score_scale == 1.0 and Rope().score_scale == 1.0


def test_rotary_scales_cos_and_sin_like_transformers():
    """q rotated by our `rotary` equals transformers' GPT-OSS rotary (cos, sin times the
    attention factor) applied to the same q."""
    from transformers.models.gpt_oss.modeling_gpt_oss import (
        GptOssRotaryEmbedding,
        apply_rotary_pos_emb,
    )
    config, _, _ = _hf("gpt_oss")
    rope, dim = _ours(config)
    x = np.random.default_rng(0).standard_normal((1, 40, 2, dim)).astype(np.float32)
    positions = np.arange(100, 140)[None]
    emb = GptOssRotaryEmbedding(config)
    xt = torch.from_numpy(x).transpose(1, 2)
    cos, sin = emb(xt, torch.from_numpy(positions))
    ref, _ = apply_rotary_pos_emb(xt, xt, cos, sin)
    got = np.asarray(rotary(x, positions, rope))
    np.testing.assert_allclose(got, ref.transpose(1, 2).numpy(), atol=2e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hf_mapping_round_trips(name):
    config, _, _ = _hf(name)
    fields = rope_from_hf(config.to_dict(), "config.json")
    written = rope_scaling_to_hf(fields)
    again = rope_from_hf({"rope_scaling": {**written, "rope_theta": fields["rope_theta"]}},
                         "config.json")
    assert again == fields
    assert ("attention_factor" in written) == (name == "explicit_factor")


def test_bad_yarn_fields_are_refused():
    m = dict(rope_scaling="yarn", rope_factor=4.0, rope_low_freq_factor=1.0,
             rope_high_freq_factor=4.0, rope_original_max_len=4096, rope_beta_fast=1.0,
             rope_beta_slow=32.0)
    with pytest.raises(ConfigError, match=r"rope_beta_slow \(32.0\) < rope_beta_fast") as err:
        check_rope(m)
    assert "\n" not in str(err.value)
    check_rope(dict(m, rope_beta_fast=32.0, rope_beta_slow=1.0))
