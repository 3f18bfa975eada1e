"""Hugging Face Llama import/export: logits parity with transformers, exact round trip, sharded
placement by the rules, and clear rejection of what the model cannot reproduce."""

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale.interop import hf
from jaxscale.mesh import make_mesh
from jaxscale.models import ModelDef
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.precision import get_policy
from jaxscale.weights.place import param_specs
from jaxscale.weights.tree import flatten

CONFIGS = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa_theta": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                      rope_theta=500000.0, rms_norm_eps=1e-5, head_dim=8),
    # Llama 3.1 / 3.2 scaling; with head_dim 8 and theta 1e4 the wavelengths (6.3, 63, 628,
    # 6283) fall in all three bands (kept < 32/4 <= blended <= 32/0.5 < stretched).
    "llama3": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.5,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32}),
    "linear": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "linear", "factor": 4.0}),
    # YaRN untruncated (as GPT-OSS): the ramp runs from 0.10 to 1.61 dimensions, so with
    # head_dim 8 one frequency is kept, one blended and two interpolated; q, k scaled by 1.139.
    "yarn": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                 rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": False,
                               "original_max_position_embeddings": 256}),
}
SCALED = ("linear", "llama3", "yarn")


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
    tokens = np.random.default_rng(0).integers(0, 96, (2, 32)).astype(np.int32)
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jax_logits(model_cfg, params, tokens)
    assert got.shape == ref.shape
    err = np.max(np.abs(got - ref))
    assert err < 1e-4
    if name in SCALED:  # the scaling is read and matters: unscaled rotary misses the reference
        assert model_cfg["rope_scaling"] == name
        plain = jax_logits(dict(model_cfg, rope_scaling="none"), params, tokens)
        assert np.max(np.abs(plain - ref)) > max(100 * err, 1e-5)


@pytest.mark.parametrize("name", SCALED)
def test_rope_frequencies_match_transformers(tmp_path, name):
    """The scaled frequencies equal transformers' own (its rotary module's inv_freq)."""
    from jaxscale.models.nn.rope import Rope
    model, path = make_hf(tmp_path, name)
    model_cfg, _ = hf.load_llama(path)
    rope = LlamaConfig.from_config(model_cfg).rope
    got = np.asarray(rope.inv_frequencies(model_cfg["head_dim"]))
    ref = model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    plain = np.asarray(Rope(rope.theta).inv_frequencies(model_cfg["head_dim"]))
    if name in ("llama3", "yarn"):  # kept, blended and stretched bands are all present
        ratio, factor = plain / got, model_cfg["rope_factor"]
        assert np.isclose(ratio, 1.0).any() and np.isclose(ratio, factor).any()
        assert ((ratio > 1.01) & (ratio < factor - 0.01)).any()
    else:
        np.testing.assert_allclose(plain / got, 4.0, rtol=1e-6)


@pytest.mark.parametrize("name", ["gqa_untied", "gqa_theta", *SCALED])
def test_round_trip_is_exact_and_loads_in_transformers(tmp_path, name):
    model, path = make_hf(tmp_path, name)
    model_cfg, params = hf.load_llama(path)
    out = hf.save_llama((model_cfg, params), str(tmp_path / "export"))
    original = {k: v.numpy() for k, v in model.state_dict().items()}
    exported = hf.SafetensorsReader(out)
    assert set(exported.keys()) == set(original) - {"model.rotary_emb.inv_freq"}
    for k in exported.keys():
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
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}),
     "type 'longrope' .* supports rope_type 'default', 'linear', 'llama3', 'yarn'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
     "scaling 'yarn' lacks original_max_position_embeddings"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "type 'dynamic'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(hidden_act="gelu"), "gelu"),
    (dict(sliding_window=16), "sliding_window"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "'llama3' lacks low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    (dict(rope_scaling={"rope_type": "linear"}), "'linear' lacks factor"),
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


def test_missing_config_keys_are_all_named(tmp_path):
    _, path = make_hf(tmp_path, "gqa_untied")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    del cfg["hidden_size"], cfg["num_hidden_layers"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(hf.ConversionError, match="hidden_size, num_hidden_layers"):
        hf.load_llama(path)


def test_dtype_is_parsed_and_unsupported_rejected(tmp_path):
    _, path = make_hf(tmp_path, "gqa_untied")
    model = hf.load_llama(path, dtype="bf16")
    assert all(v.dtype.name == "bfloat16" for v in flatten(model.params).values())
    with pytest.raises(hf.ConversionError, match="'int3' is not supported.*bf16"):
        hf.load_llama(path, dtype="int3")
    with pytest.raises(hf.ConversionError, match="float64"):
        hf.save_llama(model, str(tmp_path / "out"), dtype="float64")
    out = hf.save_llama(hf.load_llama(path), str(tmp_path / "bf16"), dtype="bf16")
    reader = hf.SafetensorsReader(out)
    assert {reader.dtype(k) for k in reader.keys()} == {"BF16"}
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"


def test_sharded_export_writes_index_and_loads(tmp_path):
    """save_llama past max_shard_size: shard files + index that transformers and we read back."""
    model, path = make_hf(tmp_path, "gqa_untied")
    loaded = hf.load_llama(path)
    out = str(tmp_path / "export")
    hf.save_llama(loaded, out, max_shard_size="30KB")
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not os.path.exists(os.path.join(out, "model.safetensors"))
    assert all(os.path.getsize(os.path.join(out, f)) < 40_000 for f in files)
    again = hf.load_llama(out)
    for k, v in flatten(loaded.params).items():
        np.testing.assert_array_equal(flatten(again.params)[k], v)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(),
                                      model(tokens).logits.numpy())


def test_mesh_load_reads_only_each_devices_shard(tmp_path, monkeypatch):
    """With a mesh, no parameter is read whole when its rules shard it: each read is one
    device's block, so the model never exists as a full host copy."""
    _, path = make_hf(tmp_path, "gqa_untied")
    reads = []
    original = hf.Source.read

    def spy(self, leaf, shape, dtype, index=None):
        out = original(self, leaf, shape, dtype, index)
        reads.append((leaf, shape, out.shape))
        return out

    monkeypatch.setattr(hf.Source, "read", spy)
    mesh = make_mesh(dict(data=1, pipeline=1, fsdp=8, tensor=1))
    model_cfg, params = hf.load_llama(path, mesh=mesh)
    specs = param_specs(ModelDef.build(model_cfg, get_policy("32-true")), hf.default_rules(), mesh)
    blocks = {}
    for leaf, shape, got in reads:
        assert got == NamedSharding(mesh, specs[leaf]).shard_shape(shape), leaf
        blocks[leaf] = blocks.get(leaf, 0) + 1
    for leaf, shape, got in reads:  # one read per distinct block; replicas share it
        assert blocks[leaf] == np.prod(shape) // np.prod(got), leaf
    # embedding, lm_head and every projection (q/k/v and gate/up are fused: one leaf each)
    assert {k for k, n in blocks.items() if n == 8} >= {
        "embedding", "lm_head", "layers/attn/wqkv", "layers/attn/wo", "layers/mlp/w_gate_up",
        "layers/mlp/w_down"}


def test_convert_streams_one_leaf_at_a_time(tmp_path, monkeypatch):
    """launch.convert's export reads each leaf lazily; when a leaf is read, every leaf before
    the previous one has already been freed (the writer may still hold the previous one)."""
    import gc
    import weakref

    from jaxscale.interop import convert
    from jaxscale.weights.leaf import Leaf

    _, path = make_hf(tmp_path, "gqa_untied")
    alive: list = []
    original = Leaf.__array__

    def spy(self, dtype=None, copy=None):
        gc.collect()
        assert sum(ref() is not None for ref in alive) <= 1, "more than one leaf on the host"
        out = original(self, dtype, copy)
        alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(Leaf, "__array__", spy)
    convert.hf_to_workdir(path, str(tmp_path / "converted"))
    assert len(alive) == len(hf.llama_leaves(hf.open_llama(path).model_cfg))
    monkeypatch.undo()  # store leaves are Leafs too: read them all freely below
    flat = flatten(hf.load_llama(path).params)  # and the export holds exactly the HF weights
    from jaxscale.weights.sources import open_weights
    for k, v in open_weights(str(tmp_path / "converted")).arrays().items():
        np.testing.assert_array_equal(v, flat[k])


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


def test_init_from_refuses_a_model_config_that_differs(tmp_path):
    """Equal shapes but another norm_eps / rope_theta would silently compute a different model:
    a converted workdir names the flags to add."""
    from jaxscale.interop import convert
    from jaxscale.weights.init_from import InitFromError, check_model_config

    _, path = make_hf(tmp_path, "gqa_theta")
    converted = str(tmp_path / "converted")
    model_cfg = convert.hf_to_workdir(path, converted)
    check_model_config(converted, dict(model_cfg, max_len=4096))  # a longer context is fine
    with pytest.raises(InitFromError, match=r"--config.model.rope_theta=500000.0 "
                                            r"--config.model.norm_eps=1e-05"):
        check_model_config(converted, dict(model_cfg, rope_theta=1e4, norm_eps=1e-6))


def test_init_from_reads_and_places_one_leaf_at_a_time(tmp_path, monkeypatch):
    """config.init_from never loads the whole params export: each leaf is read from the store,
    placed into its sharding and dropped before the next is read."""
    from jaxscale.interop import convert
    from jaxscale.weights import snapshot as store_lib
    from jaxscale.weights.place import place
    from jaxscale.weights.sources import open_weights

    _, path = make_hf(tmp_path, "gqa_untied")
    converted = str(tmp_path / "converted")
    model_cfg = convert.hf_to_workdir(path, converted)
    monkeypatch.setattr(store_lib, "read_params", lambda *a: pytest.fail("whole-model read"))
    events, read, make = [], store_lib.read_leaf, jax.make_array_from_callback
    monkeypatch.setattr(store_lib, "read_leaf", lambda s, c, leaf: (
        events.append("read"), read(s, c, leaf))[1])
    monkeypatch.setattr(jax, "make_array_from_callback", lambda *a: (
        events.append("place"), make(*a))[1])
    mesh = make_mesh(dict(data=1, pipeline=1, fsdp=4, tensor=2))
    specs = param_specs(ModelDef.build(model_cfg, get_policy("32-true")), hf.default_rules(), mesh)
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    like = {k: np.zeros((), np.float32) for k in specs}
    placed = place(open_weights(converted).leaves, shardings, like)
    assert events == ["read", "place"] * len(specs)
    expected = flatten(hf.load_llama(path).params)
    for k, arr in placed.items():
        assert arr.sharding == shardings[k]
        np.testing.assert_array_equal(np.asarray(arr), expected[k])
