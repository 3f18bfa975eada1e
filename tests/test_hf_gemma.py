"""Gemma 3 (text) through the Llama decoder's switches: logits and greedy generation (past the
sliding window, through the KV cache) equal transformers', import -> export -> import is bit for
bit, a mixed local/global pattern is scanned per layer, and what the decoder cannot reproduce is
refused."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale import generate as gen
from jaxscale.errors import ConfigError
from jaxscale.interop import convert, hf
from jaxscale.models import ModelDef, check_model
from jaxscale.models.gemma import Gemma3Config
from jaxscale.precision import get_policy
from jaxscale.weights.sources import open_huggingface
from jaxscale.weights.tree import flatten
from tests.test_hf_qwen import assert_same_training, train_steps
from tests.test_parallel_equivalence import make_config

VOCAB, PROMPT, NEW, WINDOW = 96, 6, 32, 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
HF_CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                 max_position_embeddings=128, rms_norm_eps=1e-6,
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 1e4}},
                 bos_token_id=None, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(transformers Gemma3ForCausalLM, its save_pretrained directory), built once; its norm
    weights (zero at init) are made non-trivial so a dropped or misplaced norm shows."""
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**HF_CONFIG)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("hf") / "gemma3")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.fixture(scope="module")
def converted(hf_model):
    return hf.load_pretrained(open_huggingface(hf_model[1]))


def jax_logits(model_cfg, params, tokens):
    model_def = ModelDef.build(model_cfg, get_policy("32-true"))
    return np.asarray(jax.jit(lambda p, t: model_def.module(p)(t))(params, tokens))


def test_logits_match_transformers(hf_model, converted):
    model, _ = hf_model
    model_cfg, params = converted
    assert model_cfg["name"] == "gemma3" and model_cfg["layer_types"] == LAYER_TYPES
    assert model_cfg["sliding_window"] == WINDOW and model_cfg["rope_local_theta"] == 1e4
    assert "lm_head" not in params and model_cfg["tie_embeddings"]
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jax_logits(model_cfg, params, tokens)
    err = np.max(np.abs(got - ref))
    assert got.shape == ref.shape and err < 1e-4
    # The pattern is read and matters (40 tokens > the window): every layer global misses.
    full = jax_logits(dict(model_cfg, layer_types=["full_attention"] * 4), params, tokens)
    assert np.max(np.abs(full - ref)) > 100 * max(err, 1e-6)


def test_greedy_generation_equals_transformers(hf_model):
    """32 greedy tokens through the KV cache (past the window) equal transformers' `generate`."""
    model, path = hf_model
    prompt = np.random.default_rng(1).integers(1, VOCAB, (2, PROMPT)).astype(np.int32)
    with torch.no_grad():
        ref = model.generate(torch.from_numpy(prompt).long(), max_new_tokens=NEW,
                             do_sample=False,
                             attention_mask=torch.ones(2, PROMPT, dtype=torch.long)).numpy()
    assert ref.shape == (2, PROMPT + NEW)
    config, params = gen.load_model(hf_dir=path)
    assert config.model.name == "gemma3"
    np.testing.assert_array_equal(gen.generate_from_config(config, params, prompt, NEW), ref)


def test_import_export_import_is_exact(hf_model, converted, tmp_path):
    """HF -> launch.convert's workdir -> HF: the original tensors bit for bit, a config
    transformers loads with equal logits, and the same import again."""
    model, path = hf_model
    model_cfg = convert.hf_to_workdir(path, str(tmp_path / "converted"))
    out = convert.workdir_to_hf(str(tmp_path / "converted"), str(tmp_path / "export"))
    original = {k: v.numpy() for k, v in model.state_dict().items()}
    exported = hf.SafetensorsReader(out)
    assert set(exported.keys()) == set(original) - {"lm_head.weight"}
    for k in exported.keys():
        np.testing.assert_array_equal(exported.get(k), original[k])
    reloaded = transformers.Gemma3ForCausalLM.from_pretrained(out).eval()
    tokens = torch.arange(20).reshape(1, 20)
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(),
                                      model(tokens).logits.numpy())
    again = hf.load_pretrained(open_huggingface(out))
    assert again.config == converted.config == model_cfg
    for k, v in flatten(converted.params).items():
        np.testing.assert_array_equal(flatten(again.params)[k], v)


def _edited(path, tmp_path, change):
    out = str(tmp_path / "edited")
    shutil.copytree(path, out)
    cfg_path = os.path.join(out, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(change)
    json.dump(cfg, open(cfg_path, "w"))
    return out


@pytest.mark.parametrize("change, culprit", [
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(hidden_activation="silu"), "hidden_activation='silu'"),
    (dict(layer_types=["sliding_attention"]), r"must give each of the 4 layers"),
    (dict(model_type="gemma2"), "model_type='gemma2'; jaxscale converts"),
])
def test_unsupported_configs_are_refused(hf_model, tmp_path, change, culprit):
    with pytest.raises(hf.ConversionError, match=culprit):
        open_huggingface(_edited(hf_model[1], tmp_path, change))


def test_switches_carry_axes_and_patterns_refuse_static_kernels():
    """Gemma's new parameters carry logical axes, the count matches the module's, and a mixed
    pattern is refused with a kernel that needs a static window."""
    base = dict(vocab_size=64, embed=32, num_layers=4, num_heads=4, num_kv_heads=2,
                head_dim=16, mlp=64, max_len=64, name="gemma3", sliding_window=4,
                layer_types=LAYER_TYPES)
    model_def = ModelDef.build(base, get_policy("32-true"))
    axes = model_def.logical_axes()
    assert axes["layers/attn_post_norm/scale"] == axes["layers/mlp_post_norm/scale"] == (
        "layers", "norm")
    assert axes["layers/attn/q_norm/scale"] == ("layers", "head_dim")
    assert model_def.num_params() == Gemma3Config.from_config(base).num_params()
    check_model(base, 16)
    with pytest.raises(ConfigError, match="model.attention='splash' cannot follow a mixed"):
        check_model(dict(base, attention="splash"), 16)


def gemma_style(mesh: dict, preset: str = ""):
    """test_parallel_equivalence's model as a Gemma 3-style one: its switches, a mixed
    local/global pattern with a window shorter than the sequence and its own local rotary."""
    c = make_config(mesh, preset, batch=8)
    c.model.update(name="gemma3", num_layers=3, sliding_window=5, rope_local_theta=100.0,
                   layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                   query_pre_attn_scalar=24.0)
    return c


@pytest.mark.exhaustive  # ~40 s; the mesh machinery is the Qwen3-style test's (test_hf_qwen)
def test_gemma_style_trains_on_fsdp_tensor_mesh_as_on_one_device():
    """Three steps on fsdp=4 x tensor=2 (full remat, so the per-layer flag is scanned through
    the rematerialised layers): the 1-device losses and parameters after the steps."""
    reference = train_steps(gemma_style({}), jax.devices()[:1])
    config = gemma_style({"fsdp": 4, "tensor": 2}, "fsdp_tp")
    config.model.remat = "full"
    got = train_steps(config, jax.devices())
    assert_same_training(got, reference, new_leaves={"layers/attn_post_norm/scale",
                                                     "layers/mlp_post_norm/scale"})
