"""DeepSeek-V3 through the decoder with latent attention and `sigmoid_group` routing: logits
and greedy generation equal transformers' `DeepseekV3ForCausalLM`, import -> export -> import
is bit for bit (through `interop.hf.load` / `hf.save`'s dispatch), and what the decoder cannot
reproduce is refused."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale.interop import hf, hf_deepseek
from jaxscale.weights.sources import open_huggingface
from jaxscale.weights.tree import flatten
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
# Unequal widths everywhere; 8 experts in 4 groups of which 2 are kept, top-2, one shared
# expert, the first layer dense (V3's shape, tiny). "lite": V2-Lite's direct query projection
# (q_lora_rank null), no groups, every layer with experts.
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              intermediate_size=48, moe_intermediate_size=16, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
              norm_topk_prob=True, max_position_embeddings=128, rms_norm_eps=1e-6,
              rope_theta=1e4, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
              pad_token_id=0)
VARIANTS = {
    "v3": dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1),
    "lite": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0),
    # The published V3's YaRN (a tiny original context, so the 40-token test passes it): its
    # frequencies, the rotation's attention factor (mscale / mscale_all_dim) and the softmax
    # scale's mscale_all_dim term squared.
    "yarn": dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1,
                 rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                      original_max_position_embeddings=16, beta_fast=32.0,
                                      beta_slow=1.0, mscale=0.8, mscale_all_dim=1.0)),
}


def _make(path: str, overrides: dict):
    """A tiny random DeepseekV3ForCausalLM saved to `path`, with noisy norms, router and
    selection bias (a dropped norm or bias shows; the choices are far from ties)."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**COMMON, **overrides})).eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "norm" in name or "gate.weight" in name:
                p.add_(0.2 * torch.randn_like(p))
            if "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
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
    assert model_cfg["attention_kind"] == "latent" and model_cfg["moe"]["router"] == \
        "sigmoid_group"
    dense = VARIANTS[name]["first_k_dense_replace"]
    assert params["layers"]["mlp"]["w_gate"].shape == (3 - dense, 8, 32, 16)
    assert np.abs(params["layers"]["mlp"]["balance_bias"]).max() > 0
    assert model_cfg["rope_scaling"] == ("yarn" if name == "yarn" else "none")
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    ref = hf_logits(model, tokens)
    got = jax_logits(model_cfg, params, tokens)
    err = np.max(np.abs(got - ref))
    assert got.shape == ref.shape and err < 1e-4
    # The selection bias is read and matters: without it the logits miss the reference.
    unbiased = {**params, "layers": {**params["layers"], "mlp": {
        **params["layers"]["mlp"], "balance_bias": 0 * params["layers"]["mlp"]["balance_bias"]}}}
    assert np.max(np.abs(jax_logits(model_cfg, unbiased, tokens) - ref)) > 100 * max(err, 1e-6)


@pytest.mark.parametrize("name", ["lite", "v3"])
def test_greedy_generation_equals_transformers(hf_models, name):
    """32 greedy tokens decoded from the latent cache equal `generate`."""
    model, path, _ = hf_models[name]
    assert_greedy_equals_transformers(model, path, "deepseek_v3", VOCAB)


def test_import_export_import_is_exact(hf_models, tmp_path):
    """launch.convert both ways, bit for bit (the rope rows interleaved back), and
    `hf.load` / `hf.save`."""
    model, path, converted = hf_models["v3"]
    assert assert_import_export_import_exact(model, path, tmp_path / "convert") == \
        converted.config
    assert_load_and_save_dispatch(path, hf_deepseek.open_deepseek_v3, tmp_path / "load")


@pytest.mark.parametrize("change, culprit", [
    (dict(rope_scaling=dict(rope_type="longrope", factor=4.0)), "rope scaling of type 'longrope'"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(rope_interleave=False), "rope_interleave=False"),
    (dict(kv_lora_rank=None), "lacks the field.*kv_lora_rank"),
])
def test_unsupported_configs_are_refused(hf_models, tmp_path, change, culprit):
    path = edited_copy(hf_models["v3"][1], str(tmp_path / "edited"), change)
    with pytest.raises(hf.ConversionError, match=culprit) as err:
        open_huggingface(path)
    assert "\n" not in str(err.value)


def test_exports_refuse_what_the_family_lacks(hf_models, tmp_path):
    model_cfg, params = hf_models["v3"][2]
    for change, culprit in ((dict(router="softmax_topk"), "model.moe.router='softmax_topk'"),
                            (dict(shared_experts=0), "model.moe.shared_experts=0")):
        with pytest.raises(hf.ConversionError, match=culprit):
            hf.save((dict(model_cfg, moe=dict(model_cfg["moe"], **change)), params),
                    str(tmp_path / "out"))


def test_multi_token_prediction_layers_are_left_unread(hf_models, tmp_path):
    """The published checkpoints hold `num_nextn_predict_layers` MTP layers after the last:
    left unread with that count in config.json, refused as extra layers without it."""
    from safetensors.numpy import load_file, save_file

    _, path, (model_cfg, params) = hf_models["v3"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    mtp = {n.replace("layers.2.", "layers.3."): v for n, v in tensors.items() if "layers.2." in n}
    with_mtp = edited_copy(path, str(tmp_path / "mtp"), dict(num_nextn_predict_layers=1))
    save_file({**tensors, **mtp}, os.path.join(with_mtp, "model.safetensors"),
              metadata={"format": "pt"})
    again = hf.load(with_mtp)
    assert again.config == model_cfg
    for k, v in flatten(params).items():
        np.testing.assert_array_equal(flatten(again.params)[k], v)
    without = edited_copy(with_mtp, str(tmp_path / "no_mtp"), dict(num_nextn_predict_layers=0))
    with pytest.raises(hf.ConversionError, match="holds tensor model.layers.3"):
        hf.load(without)
