"""Qwen2/2.5 and Qwen3 (dense) through the Llama decoder's switches: logits and greedy
generation equal transformers', import -> export -> import is bit for bit, what the decoder
cannot reproduce is refused, the new parameters are sharded by the rules, and a Qwen3-style
model trains on an fsdp x tensor mesh exactly as on one device."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale.interop import hf, hf_qwen
from jaxscale.mesh import make_mesh
from jaxscale.models import ModelDef
from jaxscale.models.adapters import lora
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.decoder.qwen import Qwen2Config, Qwen3Config
from jaxscale.precision import get_policy
from jaxscale.train.loop import Trainer
from jaxscale.weights.place import param_specs
from jaxscale.weights.sources import open_huggingface
from jaxscale.weights.tree import flatten, unflatten
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
from tests.test_parallel_equivalence import RTOL, STEPS, make_config

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-6, rope_theta=1e6, bos_token_id=None, eos_token_id=None,
              pad_token_id=0)
# name -> (family, HF config overrides). Qwen3's head_dim 16 is not hidden / heads (8).
MODELS = {
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True, head_dim=16)),
}
HF_CLASSES = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
              "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}
SWITCH_LEAVES = {"qwen2": ["layers/attn/bqkv"],
                 "qwen3": ["layers/attn/q_norm/scale", "layers/attn/k_norm/scale"]}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{name: (transformers model, its save_pretrained directory)}, built once, with
    non-trivial biases and norm scales, so a dropped one shows."""
    out = {}
    for name, (family, overrides) in MODELS.items():
        config_cls, model_cls = HF_CLASSES[family]
        path = str(tmp_path_factory.mktemp("hf") / name)
        model = make_tiny(model_cls, config_cls(**{**COMMON, **overrides}), path,
                          noisy=("norm", "bias"))
        out[name] = (model, path)
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_transformers(hf_models, name):
    model, path = hf_models[name]
    family = MODELS[name][0]
    model_cfg, params = load(path)
    assert model_cfg["name"] == family and hf_qwen.switches(model_cfg) == hf_qwen.SWITCHES[family]
    assert set(SWITCH_LEAVES[family]) <= set(flatten(params))
    assert ("lm_head" in params) != model_cfg["tie_embeddings"]
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    ref = hf_logits(model, tokens)
    got = jax_logits(model_cfg, params, tokens)
    err = np.max(np.abs(got - ref))
    assert got.shape == ref.shape and err < 1e-4
    # The switch is read and matters: the plain Llama on the other weights misses the reference.
    plain = {k: v for k, v in flatten(params).items() if k not in SWITCH_LEAVES[family]}
    off = jax_logits(dict(model_cfg, name="llama"), unflatten(plain), tokens)
    assert np.max(np.abs(off - ref)) > 100 * max(err, 1e-6)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_greedy_generation_equals_transformers(hf_models, name):
    """32 greedy tokens through the KV cache equal transformers' `generate`."""
    model, path = hf_models[name]
    assert_greedy_equals_transformers(model, path, MODELS[name][0], VOCAB)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_import_export_import_is_exact(hf_models, name, tmp_path):
    """HF -> launch.convert's workdir -> HF -> HF again, bit for bit (`hf_common`)."""
    model, path = hf_models[name]
    assert_import_export_import_exact(model, path, tmp_path)


def test_load_and_save_dispatch_on_the_architecture(hf_models, tmp_path):
    """`hf.load` / `hf.save` serve a Qwen3 directory as its family's opener and saver do, and
    an unknown model_type is one paragraph naming the supported ones."""
    assert_load_and_save_dispatch(hf_models["qwen3"][1], hf_qwen.open_qwen3, tmp_path)
    path = edited_copy(hf_models["qwen3"][1], str(tmp_path / "gpt9"), dict(model_type="gpt9"))
    with pytest.raises(hf.ConversionError, match=r"model_type='gpt9'; jaxscale converts \[.*"
                                                 r"'gemma3_text'.*'qwen3'.*\]") as err:
        hf.load(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, change, culprit", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window=True"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]),
     r"layer_types marks layers \[1\] as 'sliding_attention'"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True .* qwen3"),
    ("qwen3", dict(num_experts=8), "num_experts=8 .*mixture-of-experts"),
    ("qwen3", dict(model_type="qwen3_next"), "model_type='qwen3_next'; jaxscale converts"),
    ("qwen2", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen2", dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}),
     "type 'longrope'"),
])
def test_unsupported_configs_are_refused(hf_models, tmp_path, name, change, culprit):
    path = edited_copy(hf_models[name][1], str(tmp_path / "edited"), change)
    with pytest.raises(hf.ConversionError, match=culprit):
        open_huggingface(path)


def test_exports_refuse_switches_their_family_lacks(hf_models, tmp_path):
    """A model is written only as the family whose tensors it has: nothing dropped or invented."""
    model_cfg, params = load(hf_models["qwen3"][1])
    with pytest.raises(hf.ConversionError, match="model.qk_norm=True has no place in a Hugging"):
        hf.save_llama((dict(model_cfg, name="llama", qk_norm=True), params), str(tmp_path / "a"))
    with pytest.raises(hf.ConversionError, match="model.qk_norm=True does not fit a Hugging Face"
                                                 " qwen2"):
        hf_qwen.save_qwen((dict(model_cfg, name="qwen2", qkv_bias=True, qk_norm=True), params),
                          str(tmp_path / "b"))
    with pytest.raises(hf.ConversionError, match="model.qk_norm=False does not fit"):
        hf_qwen.save_qwen((dict(model_cfg, qk_norm=False), params), str(tmp_path / "c"))


def test_family_names_pick_switches_and_rules_shard_them():
    """`model.name` alone picks the switches; their parameters carry logical axes (the bias
    the kernel's output axes, the norm scales `head_dim`) that the rules shard, and the
    parameter count, the FLOP count's shapes and LoRA's merge know them."""
    base = dict(vocab_size=64, embed=32, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, mlp=64)
    policy = get_policy("32-true")
    axes = {n: ModelDef.build(dict(base, name=n), policy).logical_axes()
            for n in ("llama", "qwen2", "qwen3")}
    assert set(axes["qwen2"]) - set(axes["llama"]) == {"layers/attn/bqkv"}
    assert set(axes["qwen3"]) - set(axes["llama"]) == {"layers/attn/q_norm/scale",
                                                       "layers/attn/k_norm/scale"}
    assert axes["qwen2"]["layers/attn/bqkv"] == ("layers", "kv", "fused", "head_dim")
    assert axes["qwen3"]["layers/attn/q_norm/scale"] == ("layers", "head_dim")
    for cls, name in ((LlamaConfig, "llama"), (Qwen2Config, "qwen2"), (Qwen3Config, "qwen3")):
        model_def = ModelDef.build(dict(base, name=name), policy)
        assert model_def.num_params() == cls.from_config(base).num_params()
    both = dict(base, name="qwen3", qkv_bias=True)
    model_def = ModelDef.build(both, policy)
    mesh = make_mesh(dict(data=1, pipeline=1, fsdp=4, tensor=2))
    specs = param_specs(model_def, hf.default_rules(), mesh)
    kernel, bias = tuple(specs["layers/attn/wqkv"]), tuple(specs["layers/attn/bqkv"])
    assert kernel[1] == "fsdp" and bias[1] == kernel[2] == "tensor"
    assert bias == kernel[:1] + kernel[2:]  # the kernel's spec without its `embed` input
    assert all(a is None for a in specs["layers/attn/q_norm/scale"][1:])
    # LoRA on the q/k/v/o parts: the merged model (bias and norms untouched) equals the adapted.
    lora_cfg = SimpleNamespace(rank=2, alpha=4.0, targets=("attn/w[qkvo]$",), dropout=0.0)
    adapted = lora.with_adapters(model_def, lora_cfg)
    rng = np.random.default_rng(0)  # random values everywhere (adapters, bias, norm scales)
    params = unflatten({k: rng.normal(0.0, 0.3, s.shape).astype(np.float32)
                        for k, s in adapted.shapes().items()})
    tokens = np.arange(20, dtype=np.int32).reshape(2, 10) % 64
    want = np.asarray(jax.jit(lambda p: adapted.module(p)(tokens))(params))
    merged = lora.merge(params, lora_cfg)
    assert set(flatten(merged)) == set(model_def.shapes())
    got = jax.jit(lambda p: model_def.module(p)(tokens))(merged)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def host_params(state) -> dict:
    return {k: np.asarray(v) for k, v in flatten(jax.device_get(state.params)).items()}


def train_steps(config, devices) -> tuple[np.ndarray, dict, dict]:
    """Losses of `STEPS` train steps and the parameters before and after them (every step's
    gradients shape them), without test_parallel_equivalence's separate gradient compile."""
    trainer = Trainer.build(config, workdir=None, devices=devices)
    it, state, losses = trainer.batches.iterator(), trainer.state, []
    init = host_params(state)
    for _ in range(STEPS):
        state, metrics = trainer.train_fn(state, trainer.to_global(next(it)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), init, host_params(state)


def qwen3_style(mesh: dict, preset: str = "", **pipeline):
    """test_parallel_equivalence's model as a Qwen3-style one: qk-norm, head_dim 24 != embed /
    heads, and the q/k/v bias too (both switches' parameters train and are sharded)."""
    c = make_config(mesh, preset, batch=8, **pipeline)
    c.model.update(name="qwen3", head_dim=24, qkv_bias=True, num_layers=2)
    return c


@pytest.fixture(scope="module")
def reference():
    return train_steps(qwen3_style({}), jax.devices()[:1])


def assert_same_training(got, want,
                         new_leaves=("layers/attn/bqkv", "layers/attn/q_norm/scale")):
    (losses, init, params), (ref_losses, ref_init, ref_params) = got, want
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert ref_losses[-1] < ref_losses[0]  # training really moved
    for path, ref in ref_init.items():  # the same start
        np.testing.assert_array_equal(init[path], ref)
    assert set(params) == set(ref_params) >= set(new_leaves)
    for path, ref in ref_params.items():
        assert not np.array_equal(ref, ref_init[path]), f"{path} did not train"
        rel = np.linalg.norm(params[path] - ref) / np.linalg.norm(ref - ref_init[path])
        assert rel < 1e-4, f"{path}: relative difference of the updates {rel:.2e}"


def test_qwen3_style_trains_on_fsdp_tensor_mesh_as_on_one_device(reference):
    """Three steps on fsdp=4 x tensor=2: the 1-device losses, and its parameters after the
    steps (the new leaves included)."""
    assert_same_training(
        train_steps(qwen3_style({"fsdp": 4, "tensor": 2}, "fsdp_tp"), jax.devices()), reference)


@pytest.mark.exhaustive
@pytest.mark.parametrize("mesh, preset, pipeline, remat", [
    ({"pipeline": 2, "fsdp": 2, "tensor": 2}, "pp", dict(microbatches=2), "none"),
    ({"pipeline": 2, "data": 4}, "pp", dict(microbatches=2, schedule="1f1b"), "none"),
    ({}, "", {}, "full"),
    ({"fsdp": 8}, "fsdp", {}, "minimal"),
])
def test_qwen3_style_pipelines_and_remat_as_on_one_device(reference, mesh, preset, pipeline,
                                                         remat):
    config = qwen3_style(mesh, preset, **pipeline)
    config.model.remat = remat
    devices = jax.devices() if mesh else jax.devices()[:1]
    assert_same_training(train_steps(config, devices), reference)


def test_packed_rows_equal_each_document_alone():
    """The switches act per token: a packed row of two documents gives each its own logits."""
    model_cfg = dict(vocab_size=64, embed=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp=64, name="qwen3", qkv_bias=True)
    model_def = ModelDef.build(model_cfg, get_policy("32-true"))
    rng = np.random.default_rng(0)
    params = unflatten({k: rng.normal(0.0, 0.3, s.shape).astype(np.float32)
                        for k, s in model_def.shapes().items()})
    docs = [rng.integers(1, 64, n).astype(np.int32) for n in (7, 9)]
    tokens = np.concatenate(docs)[None]
    positions = np.concatenate([np.arange(len(d)) for d in docs])[None].astype(np.int32)
    segments = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)])[None]
    forward = jax.jit(lambda p, t, pos, seg: model_def.module(p)(t, pos, segments_BT=seg))
    packed = np.asarray(forward(params, tokens, positions, segments.astype(np.int32)))
    alone = jax.jit(lambda p, t: model_def.module(p)(t))
    np.testing.assert_allclose(packed[0, :7], np.asarray(alone(params, docs[0][None]))[0],
                               atol=1e-5)
    np.testing.assert_allclose(packed[0, 7:], np.asarray(alone(params, docs[1][None]))[0],
                               atol=1e-5)
