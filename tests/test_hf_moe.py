"""Mixtral and Qwen3-MoE through the decoder with `model.moe` (dropless, top-2 of 4 experts):
logits and greedy generation equal transformers', import -> export -> import is bit for bit
(through `interop.hf.load` / `hf.save`'s dispatch), the router's loss coefficient is mapped, and
what the decoder cannot reproduce is refused."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale.interop import hf, hf_moe
from jaxscale.weights.sources import open_huggingface
from tests.hf_common import (
    assert_greedy_equals_transformers,
    assert_import_export_import_exact,
    assert_load_and_save_dispatch,
    edited_copy,
    hf_logits,
    jax_logits,
    load,
    make_tiny,
)

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
              num_experts_per_tok=2, bos_token_id=None, eos_token_id=None, pad_token_id=0)
# name -> (HF config class, model class, overrides). Mixtral: a window shorter than the
# sequence, untied; Qwen3-MoE: head_dim 16 != hidden / heads, an expert width of its own
# (moe_intermediate_size), norm_topk_prob off (transformers' default), tied.
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        intermediate_size=48, num_local_experts=4, sliding_window=8, rope_theta=1e4,
        tie_word_embeddings=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        intermediate_size=64, moe_intermediate_size=24, num_experts=4, head_dim=16,
        norm_topk_prob=False, rope_theta=1e6, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{name: (transformers model, its directory, the import)}, built once; norm scales and the
    router made non-trivial (a dropped norm shows, top-2 choices are far from ties)."""
    out = {}
    for name, (config_cls, model_cls, overrides) in FAMILIES.items():
        path = str(tmp_path_factory.mktemp("hf") / name)
        model = make_tiny(model_cls, config_cls(**{**COMMON, **overrides}), path,
                          noisy=("norm", "gate.weight"))
        out[name] = (model, path, load(path))
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_transformers(hf_models, name):
    model, _, (model_cfg, params) = hf_models[name]
    moe = model_cfg["moe"]
    assert model_cfg["name"] == name and (moe["num_experts"], moe["experts_per_token"]) == (4, 2)
    assert moe["capacity_factor"] == 0.0 and moe["norm_topk_prob"] == (name == "mixtral")
    assert params["layers"]["mlp"]["w_gate"].shape[1:] == (4, 32, 48 if name == "mixtral" else 24)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    ref = hf_logits(model, tokens)
    got = jax_logits(model_cfg, params, tokens)
    err = np.max(np.abs(got - ref))
    assert got.shape == ref.shape and err < 1e-4
    # The routing switch is read and matters: flipped, the logits miss the reference.
    flipped = dict(model_cfg, moe=dict(moe, norm_topk_prob=not moe["norm_topk_prob"]))
    assert np.max(np.abs(jax_logits(flipped, params, tokens) - ref)) > 100 * max(err, 1e-6)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_generation_equals_transformers(hf_models, name):
    """32 greedy tokens through the KV cache (Mixtral: past its window) equal `generate`."""
    model, path, _ = hf_models[name]
    assert_greedy_equals_transformers(model, path, name, VOCAB)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_import_export_import_is_exact(hf_models, name, tmp_path):
    """launch.convert both ways, bit for bit (`hf_common`), and `hf.load` / `hf.save`."""
    model, path, converted = hf_models[name]
    assert assert_import_export_import_exact(model, path, tmp_path / "convert") == \
        converted.config
    assert converted.config["moe"]["num_experts"] == 4  # what init_from's run takes
    assert_load_and_save_dispatch(path, getattr(hf_moe, f"open_{name}"), tmp_path / "load")


def test_router_loss_coefficient_follows_output_router_logits(hf_models, tmp_path):
    """transformers trains on `router_aux_loss_coef` x its loss (experts_per_token x jaxscale's
    `aux`) only with `output_router_logits`; off, the loss is reported, not trained on."""
    path = hf_models["qwen3_moe"][1]
    assert hf_models["qwen3_moe"][2].config["moe"]["router_aux_loss_coef"] == 0.0
    on = edited_copy(path, str(tmp_path / "on"), dict(output_router_logits=True,
                                                       router_aux_loss_coef=0.02))
    model_cfg = open_huggingface(on).model_cfg
    assert model_cfg["moe"]["router_aux_loss_coef"] == 0.04
    written = hf_moe.moe_config_to_hf(model_cfg)
    assert written["output_router_logits"] and written["router_aux_loss_coef"] == 0.02


def test_a_decoder_sparse_step_is_moe_every(tmp_path):
    """Qwen3-MoE's decoder_sparse_step=2 (layer 0 a dense intermediate_size SwiGLU, layer 1 the
    experts) is model.moe.every=2: logits equal transformers', and hf.save writes the original
    tensors and the step back, bit for bit."""
    config_cls, model_cls, overrides = FAMILIES["qwen3_moe"]
    path = str(tmp_path / "step2")
    model = make_tiny(model_cls, config_cls(**{**COMMON, **overrides, "decoder_sparse_step": 2}),
                      path, noisy=("norm", "gate.weight"))
    model_cfg, params = load(path)
    assert model_cfg["moe"]["every"] == 2
    assert params["layers"]["moe"]["mlp"]["w_gate"].shape == (1, 4, 32, 24)
    assert params["layers"]["dense_0"]["mlp"]["w_down"].shape == (1, 64, 32)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    assert np.max(np.abs(jax_logits(model_cfg, params, tokens) - hf_logits(model, tokens))) < 1e-4
    assert hf_moe.moe_config_to_hf(model_cfg)["decoder_sparse_step"] == 2
    assert_load_and_save_dispatch(path, hf_moe.open_qwen3_moe, tmp_path / "load")


@pytest.mark.parametrize("name, change, culprit", [
    ("qwen3_moe", dict(decoder_sparse_step=3), "decoder_sparse_step=3 .*no repeating"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\]"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    ("mixtral", dict(sliding_window=-1), "sliding_window=-1 is not a positive integer"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), "use_sliding_window=True"),
    ("mixtral", dict(num_experts_per_tok=None), "lacks the field.*num_experts_per_tok"),
])
def test_unsupported_configs_are_refused(hf_models, tmp_path, name, change, culprit):
    path = edited_copy(hf_models[name][1], str(tmp_path / "edited"), change)
    with pytest.raises(hf.ConversionError, match=culprit) as err:
        open_huggingface(path)
    assert "\n" not in str(err.value)


def test_exports_refuse_what_the_family_lacks(hf_models, tmp_path):
    model_cfg, params = hf_models["mixtral"][2]
    for change, culprit in ((dict(shared_experts=1), "model.moe.shared_experts=1"),
                            (dict(norm_topk_prob=False), "Mixtral always renormalises")):
        with pytest.raises(hf.ConversionError, match=culprit):
            hf.save((dict(model_cfg, moe=dict(model_cfg["moe"], **change)), params),
                    str(tmp_path / "out"))
