"""Hugging Face Llama import/export: logits parity with transformers, exact round trip, sharded
placement by the rules, and clear rejection of what the model cannot reproduce."""

import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale.interop import hf  # noqa: E402
from jaxscale.mesh import make_mesh  # noqa: E402
from jaxscale.precision import get_policy  # noqa: E402
from jaxscale.train.state import ModelDef, flatten, param_specs  # noqa: E402

CONFIGS = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa_theta": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                      rope_theta=500000.0, rms_norm_eps=1e-5, head_dim=8),
}


def make_hf(tmp_path, name="gqa_untied", **overrides):
    torch.manual_seed(0)
    kw = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              max_position_embeddings=64, rms_norm_eps=1e-6)
    kw.update(CONFIGS[name])
    kw.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():  # non-trivial norm scales, so a swapped norm would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path / name)
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def jax_logits(model_cfg, params, tokens):
    model_def = ModelDef.build(model_cfg, get_policy("32-true"))
    return np.asarray(jax.jit(lambda p, t: model_def.module(p)(t))(params, tokens))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    model, path = make_hf(tmp_path, name)
    model_cfg, params = hf.load_llama(path)
    assert model_cfg["tie_embeddings"] == CONFIGS[name]["tie_word_embeddings"]
    assert ("lm_head" in params) != model_cfg["tie_embeddings"]
    tokens = np.random.default_rng(0).integers(0, 96, (2, 16)).astype(np.int32)
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jax_logits(model_cfg, params, tokens)
    assert got.shape == ref.shape
    assert np.max(np.abs(got - ref)) < 1e-4


@pytest.mark.parametrize("name", ["gqa_untied", "gqa_theta"])
def test_round_trip_is_exact_and_loads_in_transformers(tmp_path, name):
    model, path = make_hf(tmp_path, name)
    model_cfg, params = hf.load_llama(path)
    out = hf.save_llama(params, model_cfg, str(tmp_path / "export"))
    original = {k: v.numpy() for k, v in model.state_dict().items()}
    exported = hf.SafetensorsReader(out)
    assert set(exported.entries) == set(original) - {"model.rotary_emb.inv_freq"}
    for k in exported.entries:
        np.testing.assert_array_equal(exported.get(k), original[k])
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(),
                                      model(tokens).logits.numpy())


def test_sharded_load_follows_rules(tmp_path):
    _, path = make_hf(tmp_path, "gqa_untied")
    mesh = make_mesh(dict(data=1, pipeline=1, fsdp=4, tensor=2))
    rules = hf.default_rules()
    model_cfg, sharded = hf.load_llama(path, mesh=mesh, rules=rules)
    _, host = hf.load_llama(path)
    specs = param_specs(ModelDef.build(model_cfg, get_policy("32-true")), rules, mesh)
    flat_host = flatten(host)
    assert any(len(s) and any(a is not None for a in s) for s in specs.values())
    for path_, arr in flatten(sharded).items():
        assert arr.sharding.spec == specs[path_], path_
        assert len(arr.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(arr), flat_host[path_])


def test_sharded_index_checkpoint(tmp_path):
    model, _ = make_hf(tmp_path, "mha_tied")
    path = str(tmp_path / "sharded")
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    model_cfg, params = hf.load_llama(path)
    tokens = np.arange(10, dtype=np.int32)[None]
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens).long()).logits.numpy()
    assert np.max(np.abs(jax_logits(model_cfg, params, tokens) - ref)) < 1e-4


@pytest.mark.parametrize("change, culprit", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "linear"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "gelu"),
])
def test_unsupported_configs_are_rejected(tmp_path, change, culprit):
    _, path = make_hf(tmp_path, "gqa_untied")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("rope_parameters", None)
    cfg.update(change)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(hf.ConversionError, match=culprit):
        hf.load_llama(path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(hf.ConversionError):
        hf.SafetensorsReader(str(tmp_path))


@pytest.mark.slow
def test_convert_finetune_export(tmp_path):
    """HF -> launch.convert output -> launch.train with init_from -> HF again, all consistent."""
    from configs import tiny_lm
    from jaxscale.interop import convert
    from jaxscale.train import loop

    model, path = make_hf(tmp_path, "gqa_untied", vocab_size=256)  # byte-level corpus
    converted = str(tmp_path / "converted")
    model_cfg = convert.hf_to_workdir(path, converted)
    _, expected = hf.load_llama(path)
    config = tiny_lm.get_config("test")
    config.model.update(model_cfg)
    config.init_from = converted
    config.train.update(steps=2, eval_every=0)
    config.checkpoint.every = 2
    trainer = loop.Trainer.build(config, str(tmp_path / "run"))
    for k, v in flatten(expected).items():  # training starts from exactly the HF weights
        np.testing.assert_array_equal(np.asarray(flatten(trainer.state.params)[k]), v)
    state = loop.train(config, str(tmp_path / "run"))
    out = convert.workdir_to_hf(str(tmp_path / "run"), str(tmp_path / "export"))
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = np.arange(20, dtype=np.int32)[None]
    with torch.no_grad():
        ref = reloaded(torch.from_numpy(tokens).long()).logits.numpy()
    trained = jax.device_get(state.params)
    assert np.max(np.abs(jax_logits(model_cfg, trained, tokens) - ref)) < 1e-4
    assert not np.array_equal(flatten(trained)["lm_head"], flatten(expected)["lm_head"])
