"""GPT-OSS (`GptOssForCausalLM`) through `model.name=gpt_oss`: a tiny random transformers model
(sliding-window and full layers alternating, a window shorter than the sequence, YaRN, attention
sinks, q/k/v/o biases, biased top-2-of-4 experts with the clamped SwiGLU) gives equal logits and
greedy tokens, imports, exports and re-imports bit for bit, and what the decoder cannot
reproduce is refused in one paragraph."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale.interop import hf, hf_gpt_oss
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

VOCAB, WINDOW = 96, 6
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
              eos_token_id=None, pad_token_id=0,
              rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                   truncate=False, rope_theta=1e4,
                                   original_max_position_embeddings=64))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(transformers model, its directory, the import), built once. Norms, biases, sinks and
    the router get noise (each starts at a constant: a dropped one would not show); the
    experts' gate/up weights are scaled so that the clamp at 7 bites."""
    path = str(tmp_path_factory.mktemp("hf") / "gpt_oss")
    model = make_tiny(transformers.GptOssForCausalLM, transformers.GptOssConfig(**CONFIG), path,
                      noise=0.5, noisy=("norm", "bias", "sinks", "router"),
                      scaled=("gate_up_proj",), factor=60.0)
    return model, path, load(path)


def test_logits_match_transformers_past_the_window(gpt_oss):
    model, _, (model_cfg, params) = gpt_oss
    assert model_cfg["name"] == "gpt_oss" and model_cfg["rope_scaling"] == "yarn"
    assert model_cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert model_cfg["moe"]["router"] == "topk_softmax" and model_cfg["moe"]["swiglu_limit"] == 7
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    ref = hf_logits(model, tokens)
    got = jax_logits(model_cfg, params, tokens)
    err = np.max(np.abs(got - ref))
    assert got.shape == ref.shape and err < 1e-4, err
    # Each GPT-OSS switch is read and matters: off, the logits miss the reference.
    for change in (dict(attn_sinks=False), dict(sliding_window=0, layer_types=[]),
                   dict(moe=dict(model_cfg["moe"], swiglu_limit=0.0)),
                   dict(rope_scaling="none")):
        changed = {**model_cfg, **change}
        if change.get("attn_sinks") is False:
            params_ = {**params, "layers": {**params["layers"], "attn": {
                k: v for k, v in params["layers"]["attn"].items() if k != "sinks"}}}
        else:
            params_ = params
        off = np.max(np.abs(jax_logits(changed, params_, tokens) - ref))
        assert off > 100 * max(err, 1e-6), change


def test_greedy_generation_equals_transformers(gpt_oss):
    """32 greedy tokens through the KV cache, past the window, equal `generate`."""
    model, path, _ = gpt_oss
    assert_greedy_equals_transformers(model, path, "gpt_oss", VOCAB)


def test_import_export_import_is_exact(gpt_oss, tmp_path):
    model, path, converted = gpt_oss
    assert assert_import_export_import_exact(model, path, tmp_path / "convert") == \
        converted.config
    assert_load_and_save_dispatch(path, hf_gpt_oss.open_gpt_oss, tmp_path / "load")


@pytest.mark.parametrize("change, culprit", [
    (dict(sliding_window=None), "sliding_window=None is not a positive integer"),
    (dict(model_type="mixtral"), "only model_type='gpt_oss'"),
    (dict(num_local_experts=None), "num_local_experts"),
])
def test_unsupported_configs_are_refused(gpt_oss, tmp_path, change, culprit):
    _, path, _ = gpt_oss
    copy = edited_copy(path, str(tmp_path / "edited"), change)
    with pytest.raises(hf.ConversionError, match=culprit) as err:
        hf.load_pretrained(hf_gpt_oss.open_gpt_oss(copy))
    assert "\n" not in str(err.value)


def test_exports_refuse_what_the_family_lacks(gpt_oss, tmp_path):
    _, _, (model_cfg, params) = gpt_oss
    bad = {**model_cfg, "moe": {**model_cfg["moe"], "router": "softmax_topk"}}
    with pytest.raises(hf.ConversionError, match="model.moe.router does not fit"):
        hf_gpt_oss.save_gpt_oss((bad, params), str(tmp_path / "out"))


def test_mxfp4_experts_dequantise_as_transformers_does(tmp_path):
    """A tiny checkpoint in the published layout: each layer's experts as MXFP4 `*_blocks` /
    `*_scales` (random codes and exponents). The import equals transformers' own
    dequantisation (`convert_moe_packed_tensors`) bit for bit, and its logits equal the
    transformers model holding those dequantised experts."""
    import json
    import os

    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = transformers.GptOssConfig(**{**CONFIG, "intermediate_size": 32})
    model = make_tiny(transformers.GptOssForCausalLM, config, str(tmp_path / "plain"),
                      noisy=("norm", "bias", "sinks", "router"))
    rng = np.random.default_rng(3)
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for i in range(config.num_hidden_layers):
        for proj, rows, cols in (("gate_up_proj", 64, 32), ("down_proj", 32, 32)):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            blocks = rng.integers(0, 256, (4, rows, cols // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 129, (4, rows, cols // 32), dtype=np.uint8)
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                             dtype=torch.float32)
            with torch.no_grad():  # transformers' model with its own dequantisation
                getattr(model.model.layers[i].mlp.experts, proj).copy_(ref)
    path = str(tmp_path / "mxfp4")
    os.makedirs(path)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(tmp_path / "plain", "config.json")) as f:
        hf_config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**hf_config, "quantization_config": {"quant_method": "mxfp4"}}, f)

    model_cfg, params = load(path)
    experts = model.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj.detach().numpy()
    mlp = {k: np.asarray(v)[1] for k, v in params["layers"]["mlp"].items()}
    np.testing.assert_array_equal(mlp["w_gate"], gate_up[..., ::2])
    np.testing.assert_array_equal(mlp["w_up"], gate_up[..., 1::2])
    np.testing.assert_array_equal(mlp["w_down"], experts.down_proj.detach().numpy())
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24)).astype(np.int32)
    err = np.max(np.abs(jax_logits(model_cfg, params, tokens) - hf_logits(model, tokens)))
    assert err < 1e-4, err
    with pytest.raises(hf.ConversionError, match="quant_method='bitsandbytes' is not read"):
        hf_gpt_oss.gpt_oss_config_from_hf(
            {**hf_config, "quantization_config": {"quant_method": "bitsandbytes"}})


@pytest.mark.parametrize("size, layers, experts", [("20b", 24, 32), ("120b", 36, 128)])
def test_presets_have_the_published_models_parameters(size, layers, experts):
    """configs/gpt_oss.py's 20b / 120b count what transformers builds for those configs (on
    the meta device: no memory), and their config.json maps to the same `config.model`."""
    from jaxscale.configs import sibling
    presets, llama = sibling("gpt_oss"), sibling("llama")
    hf_cfg = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
    with torch.device("meta"):
        count = sum(p.numel() for p in transformers.GptOssForCausalLM(hf_cfg).parameters())
    assert llama.num_params(size, presets.SIZES) == count
    converted = hf_gpt_oss.gpt_oss_config_from_hf(hf_cfg.to_dict())
    preset = presets.SIZES[size].model
    assert {k: converted[k] for k in preset if k != "moe"} == {
        k: v for k, v in preset.items() if k != "moe"}
    assert {k: converted["moe"][k] for k in preset["moe"]} == preset["moe"]
