"""Gemma 3 (text) through the Llama decoder's switches: logits and greedy generation (past the
sliding window, through the KV cache) equal transformers', import -> export -> import is bit for
bit, a mixed local/global pattern is scanned per layer, and what the decoder cannot reproduce is
refused."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale.errors import ConfigError
from jaxscale.interop import hf, hf_gemma
from jaxscale.models import ModelDef, check_model
from jaxscale.models.decoder.gemma import Gemma3Config
from jaxscale.models.nn.scan import scan_layers
from jaxscale.precision import get_policy
from jaxscale.weights.init_from import check_model_config
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
from tests.test_hf_qwen import assert_same_training, train_steps
from tests.test_parallel_equivalence import make_config

VOCAB, WINDOW = 96, 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=LAYER_TYPES,
              max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=None,
              eos_token_id=None, pad_token_id=0)
# name -> (HF config class, model class, overrides). Gemma 3: a local rotary base of its own;
# Gemma 2: one rotary base and soft-caps small enough to bite on a tiny random model.
FAMILIES = {
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        attn_logit_softcapping=0.5, final_logit_softcapping=0.8)),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{name: (transformers model, its save_pretrained directory, the import)}, built once;
    norm weights (zero at init) made non-trivial so a dropped or misplaced norm shows, q/k
    scaled so that the scores are large enough for the soft-cap to bite."""
    out = {}
    for name, (config_cls, model_cls, overrides) in FAMILIES.items():
        path = str(tmp_path_factory.mktemp("hf") / name)
        model = make_tiny(model_cls, config_cls(**{**COMMON, **overrides}), path, noise=0.3,
                          scaled=("q_proj", "k_proj"))
        out[name] = (model, path, load(path))
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_match_transformers(hf_models, name):
    model, _, (model_cfg, params) = hf_models[name]
    assert model_cfg["name"] == name and model_cfg["layer_types"] == LAYER_TYPES
    assert model_cfg["sliding_window"] == WINDOW
    assert model_cfg["rope_local_theta"] == (1e4 if name == "gemma3" else 0.0)
    assert model_cfg["attn_softcap"] == (0.5 if name == "gemma2" else 0.0)
    assert "lm_head" not in params and model_cfg["tie_embeddings"]
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    ref = hf_logits(model, tokens)
    got = jax_logits(model_cfg, params, tokens)
    err = np.max(np.abs(got - ref))
    assert got.shape == ref.shape and err < 1e-4
    # The pattern (40 tokens > the window) and the soft-caps are read and matter.
    variants = [dict(layer_types=["full_attention"] * 4)]
    if name == "gemma2":
        variants += [dict(attn_softcap=0.0), dict(final_softcap=0.0)]
    for change in variants:
        off = jax_logits(dict(model_cfg, **change), params, tokens)
        assert np.max(np.abs(off - ref)) > 100 * max(err, 1e-6), change


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_generation_equals_transformers(hf_models, name):
    """32 greedy tokens through the KV cache (past the window) equal transformers' `generate`."""
    model, path, _ = hf_models[name]
    assert_greedy_equals_transformers(model, path, name, VOCAB)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_import_export_import_is_exact(hf_models, name, tmp_path):
    """HF -> launch.convert's workdir -> HF -> HF again, bit for bit (`hf_common`), 20 tokens
    (past the window) for the reloaded model's logits."""
    model, path, converted = hf_models[name]
    model_cfg = assert_import_export_import_exact(model, path, tmp_path, 20)
    assert model_cfg == converted.config
    # A run's config holds the pattern as a tuple (config.json as a list): the same model.
    check_model_config(str(tmp_path / "converted"),
                       dict(model_cfg, layer_types=tuple(model_cfg["layer_types"])))


def test_load_and_save_dispatch_on_the_architecture(hf_models, tmp_path):
    """`hf.load` / `hf.save` serve a Gemma 3 directory as `open_gemma3` / `save_gemma` do."""
    assert_load_and_save_dispatch(hf_models["gemma3"][1], hf_gemma.open_gemma3, tmp_path)


@pytest.mark.parametrize("name, change, culprit", [
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("gemma2", dict(attention_bias=True), "attention_bias=True"),
    ("gemma3", dict(hidden_activation="silu"), "hidden_activation='silu'"),
    ("gemma3", dict(layer_types=["sliding_attention"]), r"must give each of the 4 layers"),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "scales the local layers' rotary"),
    ("gemma3", dict(model_type="gemma"), "model_type='gemma'; jaxscale converts"),
])
def test_unsupported_configs_are_refused(hf_models, tmp_path, name, change, culprit):
    with pytest.raises(hf.ConversionError, match=culprit):
        open_huggingface(edited_copy(hf_models[name][1], str(tmp_path / "edited"), change))


def test_switches_carry_axes_and_patterns_refuse_static_kernels():
    """Gemma's new parameters carry logical axes, the count matches the module's, and a mixed
    pattern is refused with a kernel that needs a static window (splash chooses between two
    static kernels per layer: test_splash)."""
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
    with pytest.raises(ConfigError, match="model.attention='dot_product_attention' cannot "
                                          "follow a mixed"):
        check_model(dict(base, attention="dot_product_attention"), 16)
    check_model(dict(base, attention="splash"), 16)
    # A stack holding a slice of the layers must be given its slice of the pattern.
    model = model_def.module(model_def.init_params(jax.random.key(0)))
    graphdef, state = nnx.split(model.layers)
    stage = nnx.merge(graphdef, jax.tree.map(lambda x: x[:2], state))
    h, positions = jnp.zeros((1, 6, 32)), jnp.arange(6)[None]
    with pytest.raises(ConfigError, match="covers 4 layers, but this stack holds \\[2\\]"):
        scan_layers(stage, h, positions)
    capped = dict(base, name="gemma2", layer_types=(), attn_softcap=50.0)
    with pytest.raises(ConfigError, match="model.attention='dot_product_attention' does not"
                                          " soft-cap"):
        check_model(dict(capped, attention="dot_product_attention"), 16)
    check_model(dict(capped, attention="splash"), 16)  # the kernel's own soft-cap (test_splash)


def gemma_style(mesh: dict, preset: str = "", **pipeline):
    """test_parallel_equivalence's model as a Gemma-style one: Gemma 3's switches (post-norms,
    qk-norm, GeGLU, the scales), Gemma 2's soft-caps of the scores and logits, and a mixed
    local/global pattern (a window shorter than the sequence, its own local rotary) whose
    halves differ, so a pipeline stage scanning another stage's slice of it would show."""
    c = make_config(mesh, preset, batch=8, **pipeline)
    c.model.update(name="gemma3", num_layers=4, sliding_window=5, rope_local_theta=100.0,
                   layer_types=("sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention"),
                   query_pre_attn_scalar=24.0, attn_softcap=1.0, final_softcap=3.0)
    return c


@pytest.fixture(scope="module")
def gemma_reference():
    return train_steps(gemma_style({}), jax.devices()[:1])


@pytest.mark.parametrize("mesh, preset, pipeline, remat", [
    # 1F1B: the pattern's stage slices ride behind the layer leaves (parallel/onef1b.py).
    ({"pipeline": 2, "data": 4}, "pp", dict(microbatches=2, schedule="1f1b"), "none"),
    # Full remat, so the per-layer flag is scanned through the rematerialised layers.
    pytest.param({"fsdp": 4, "tensor": 2}, "fsdp_tp", {}, "full", marks=pytest.mark.exhaustive),
    pytest.param({"pipeline": 2, "fsdp": 2, "tensor": 2}, "pp", dict(microbatches=2), "none",
                 marks=pytest.mark.exhaustive),  # GPipe (parallel/gpipe.py)
    pytest.param({"pipeline": 2, "data": 4}, "pp", dict(microbatches=2, repeats=2,
                                                        schedule="circular"), "none",
                 marks=pytest.mark.exhaustive),  # stage s holds layers s and s + 2
])
def test_gemma_style_trains_on_meshes_as_on_one_device(gemma_reference, mesh, preset, pipeline,
                                                       remat):
    """Three steps on the mesh: the 1-device losses and parameters after the steps."""
    config = gemma_style(mesh, preset, **pipeline)
    config.model.remat = remat
    assert_same_training(train_steps(config, jax.devices()), gemma_reference,
                         new_leaves={"layers/attn_post_norm/scale",
                                     "layers/mlp_post_norm/scale"})
