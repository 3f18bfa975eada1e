"""DeepSeek-V2 / V2-Lite through the decoder with latent attention and softmax routing
(`interop/hf_deepseek_v2.py`): logits and greedy generation equal transformers'
`DeepseekV2ForCausalLM` (greedy and group-limited routing, routed_scaling_factor, YaRN),
import -> export -> import is bit for bit, and what the family cannot be is refused."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale.interop import hf, hf_deepseek_v2
from jaxscale.weights.sources import open_huggingface
from tests.hf_common import (
    assert_greedy_equals_transformers,
    assert_import_export_import_exact,
    assert_load_and_save_dispatch,
    edited_copy,
    hf_logits,
    jax_logits,
    load,
)

VOCAB = 96
# V2-Lite's shape, tiny: the query projected directly (q_lora_rank null), top-k of a softmax
# (greedy) unnormalised, two shared experts, the first layer dense. "v2": V2's low-rank query
# and group-limited routing (both experts from the best group) scaled by 16; "yarn": V2-Lite's YaRN (mscale 0.707).
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              intermediate_size=48, moe_intermediate_size=16, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=0)
VARIANTS = {
    "lite": dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0),
    "v2": dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=1,
               routed_scaling_factor=16.0),
    "yarn": dict(q_lora_rank=None, topk_method="greedy",
                 rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                      original_max_position_embeddings=16, beta_fast=32.0,
                                      beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)),
}


def _make(path: str, overrides: dict):
    """A tiny random DeepseekV2ForCausalLM saved to `path`, with noisy norms and router (a
    dropped norm shows; the choices are far from ties)."""
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(
        transformers.DeepseekV2Config(**{**COMMON, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            if "gate.weight" in name:
                p.mul_(20.0)  # a peaked softmax: the routing decides, far from ties
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    out = {}
    for name, overrides in VARIANTS.items():
        path = str(tmp_path_factory.mktemp("hf") / name)
        out[name] = (_make(path, overrides), path, load(path))
    return out


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_match_transformers(hf_models, name):
    model, _, (model_cfg, params) = hf_models[name]
    router = "softmax_group" if name == "v2" else "softmax_topk"
    assert model_cfg["name"] == "deepseek_v2" and model_cfg["moe"]["router"] == router
    assert model_cfg["moe"]["norm_topk_prob"] is False
    assert "balance_bias" not in params["layers"]["mlp"]
    assert model_cfg["rope_scaling"] == ("yarn" if name == "yarn" else "none")
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    ref = hf_logits(model, tokens)
    got = jax_logits(model_cfg, params, tokens)
    assert got.shape == ref.shape and np.max(np.abs(got - ref)) < 1e-4


def test_group_limited_routing_and_its_scale_matter(hf_models):
    """Without the group limit, or without routed_scaling_factor, the logits miss: both are
    read and computed."""
    model, _, (model_cfg, params) = hf_models["v2"]
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    ref = hf_logits(model, tokens)
    for change in (dict(router="softmax_topk", n_group=1, topk_group=1),
                   dict(routed_scaling_factor=1.0)):
        other = dict(model_cfg, moe=dict(model_cfg["moe"], **change))
        assert np.max(np.abs(jax_logits(other, params, tokens) - ref)) > 1e-2


@pytest.mark.parametrize("name", ["lite", "v2"])
def test_greedy_generation_equals_transformers(hf_models, name):
    """32 greedy tokens decoded from the latent cache equal `generate`."""
    model, path, _ = hf_models[name]
    assert_greedy_equals_transformers(model, path, "deepseek_v2", VOCAB)


@pytest.mark.parametrize("name", ["lite", "v2"])
def test_import_export_import_is_exact(hf_models, tmp_path, name):
    """launch.convert both ways, bit for bit, a config transformers loads with equal logits,
    and `hf.load` / `hf.save`'s dispatch on model_type / model.name."""
    model, path, converted = hf_models[name]
    assert assert_import_export_import_exact(model, path, tmp_path / "convert") == \
        converted.config
    assert_load_and_save_dispatch(path, hf_deepseek_v2.open_deepseek_v2, tmp_path / "load")


@pytest.mark.parametrize("change, culprit", [
    (dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    (dict(norm_topk_prob=True), "norm_topk_prob=True"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2"),
    (dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    (dict(kv_lora_rank=None), "lacks the field.*kv_lora_rank"),
])
def test_unsupported_configs_are_refused(hf_models, tmp_path, change, culprit):
    path = edited_copy(hf_models["lite"][1], str(tmp_path / "edited"), change)
    with pytest.raises(hf.ConversionError, match=culprit) as err:
        open_huggingface(path)
    assert "\n" not in str(err.value)


def test_exports_refuse_what_the_family_lacks(hf_models, tmp_path):
    model_cfg, params = hf_models["lite"][2]
    for change, culprit in ((dict(router="sigmoid_group"), "model.moe.router='sigmoid_group'"),
                            (dict(norm_topk_prob=True), "norm_topk_prob=True")):
        with pytest.raises(hf.ConversionError, match=culprit):
            hf.save((dict(model_cfg, moe=dict(model_cfg["moe"], **change)), params),
                    str(tmp_path / "out"))
