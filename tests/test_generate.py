"""KV-cache generation: cached greedy decoding equals uncached argmax decoding step by step,
cached logits equal full-sequence logits, sampling is reproducible, and sharding works."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from configs import tiny_lm
from jaxscale.inference import generate as gen
from jaxscale.mesh import make_mesh
from jaxscale.models import ModelDef
from jaxscale.models.attention.grouped_query import CACHE_AXES
from jaxscale.precision import get_policy
from jaxscale.rules import AxisRules, use_rules
from jaxscale.train.state import init_state


def tiny(**model):
    c = tiny_lm.get_config("test")
    c.model.update(model)
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    return model_def, model_def.init_params(jax.random.key(1))


def uncached_greedy(model_def, params, prompt, steps):
    """Argmax decoding re-running the full causal forward pass for every new token (on a
    fixed-length buffer, so one compilation: later positions cannot affect earlier logits)."""
    fwd = jax.jit(lambda p, t: model_def.module(p)(t))
    b, t = prompt.shape
    seq = np.zeros((b, t + steps), np.int32)
    seq[:, :t] = prompt
    for i in range(t, t + steps):
        seq[:, i] = np.argmax(np.asarray(fwd(params, seq))[:, i - 1], axis=-1)
    return seq


@pytest.mark.parametrize("model", [dict(), dict(num_kv_heads=1, tie_embeddings=True)])
def test_cached_greedy_equals_uncached(model):
    model_def, params = tiny(**model)
    prompt = np.random.default_rng(0).integers(0, 256, (3, 5)).astype(np.int32)
    out = gen.make_generate(model_def, steps=6)(params, prompt, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out), uncached_greedy(model_def, params, prompt, 6))


def test_cached_logits_match_full_forward():
    model_def, params = tiny()
    tokens = np.random.default_rng(1).integers(0, 256, (2, 9)).astype(np.int32)

    def cached(p, toks):
        model = model_def.module(p)
        cache = model.init_cache(2, 9, jnp.float32)
        first, cache = gen.forward_cached(model, toks[:, :4], jnp.int32(0), cache)
        rest = []
        for i in range(4, 9):  # one token at a time
            logits, cache = gen.forward_cached(model, toks[:, i:i + 1], jnp.int32(i), cache)
            rest.append(logits)
        return jnp.concatenate([first] + rest, axis=1)

    full = jax.jit(lambda p, t: model_def.module(p)(t))(params, tokens)
    np.testing.assert_allclose(np.asarray(jax.jit(cached)(params, tokens)), np.asarray(full),
                               atol=1e-5, rtol=1e-5)


def test_sampling_is_reproducible_and_seed_dependent():
    model_def, params = tiny()
    prompt = np.zeros((4, 3), np.int32)
    fn = gen.make_generate(model_def, steps=12, temperature=1.0)
    a = np.asarray(fn(params, prompt, jax.random.key(7)))
    b = np.asarray(fn(params, prompt, jax.random.key(7)))
    c = np.asarray(fn(params, prompt, jax.random.key(8)))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.shape == (4, 15) and a.min() >= 0 and a.max() < 256


def test_sharded_generation_matches_single_device():
    c = tiny_lm.get_config("test")
    c.mesh.update(data=2, fsdp=2, tensor=2)
    mesh, rules = make_mesh(c.mesh), AxisRules.from_config(c)
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    import optax
    state, _ = init_state(model_def, optax.sgd(0.1), rules, mesh, seed=3)
    prompt = np.random.default_rng(2).integers(0, 256, (4, 4)).astype(np.int32)
    sharded = gen.make_generate(model_def, 5, rules=rules, mesh=mesh)(
        state.params, prompt, jax.random.key(0))
    host = jax.device_get(state.params)
    single = gen.make_generate(model_def, 5)(host, prompt, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(single))


def test_kv_cache_is_sharded_by_the_rules():
    """The cache (layers, batch, kv, length, head_dim) gets the spec the rules give its names:
    batch over data x fsdp, length over context, kv heads over tensor."""
    c = tiny_lm.get_config("test")
    c.mesh.update(data=2, fsdp=2, tensor=2)
    mesh, rules = make_mesh(c.mesh), AxisRules.from_config(c)
    model_def, params = tiny()

    @jax.jit
    def prefill(p, tokens):
        with use_rules(rules, mesh):
            model = model_def.module(p)
            cache = model.init_cache(4, 8, jnp.float32)
            return gen.forward_cached(model, tokens, jnp.int32(0), cache)[1]

    cache = prefill(params, np.zeros((4, 3), np.int32))
    expected = rules.spec(CACHE_AXES, cache["k"].shape, mesh)
    # length over `context`: sequence shards (mesh.context, 1 here) split the cache like the keys;
    # rows over data x fsdp x expert (an expert axis also splits the batch)
    assert expected == PartitionSpec("pipeline", ("data", "fsdp", "expert"), "tensor", "context",
                                     None)
    for name in ("k", "v"):
        assert cache[name].sharding.is_equivalent_to(NamedSharding(mesh, expected), 5), name
        assert cache[name].addressable_shards[0].data.shape == (2, 1, 1, 8, 16)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.5,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_ROPE], ids=["plain", "llama3"])
def test_greedy_equals_transformers_generate(tmp_path, rope_scaling):
    """Greedy decoding of a converted HF Llama equals `transformers` greedy `generate`, also
    with Llama 3 rope scaling (the KV-cache path rotates with the same scaled frequencies)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxscale.interop import hf

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=20000.0, rope_scaling=rope_scaling, bos_token_id=None, eos_token_id=None,
        pad_token_id=0)).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    prompt = np.random.default_rng(0).integers(0, 96, (2, 6)).astype(np.int32)
    with torch.no_grad():
        ref = model.generate(torch.from_numpy(prompt).long(), max_new_tokens=10, do_sample=False,
                             attention_mask=torch.ones(2, 6, dtype=torch.long)).numpy()
    config, params = gen.load_model(hf_dir=str(tmp_path / "hf"))
    got = gen.generate_from_config(config, params, prompt, steps=10)
    np.testing.assert_array_equal(got, ref)
    model_cfg, host = hf.load_llama(str(tmp_path / "hf"))
    assert model_cfg["rope_scaling"] == ("llama3" if rope_scaling else "none")
    model_def = ModelDef.build(model_cfg, get_policy("32-true"))
    np.testing.assert_array_equal(
        np.asarray(gen.make_generate(model_def, 10)(host, prompt, jax.random.key(0))), ref)
    # Equal tokens could hide small rotary differences: compare the cached logits themselves.
    with torch.no_grad():
        ref_logits = model(torch.from_numpy(ref).long()).logits.numpy()
    err = np.max(np.abs(cached_logits(model_def, host, ref, 6) - ref_logits))
    assert err < 1e-4
    if rope_scaling:  # decoding with unscaled frequencies would be measurably off
        plain_def = ModelDef.build(dict(model_cfg, rope_scaling="none"), get_policy("32-true"))
        assert np.max(np.abs(cached_logits(plain_def, host, ref, 6) - ref_logits)) > 100 * err


def cached_logits(model_def, params, tokens_BT, prefill):
    """Logits of every position of `tokens_BT`, the first `prefill` at once, then one token at
    a time through the KV cache (the decoding path of `make_generate`)."""
    b, t = tokens_BT.shape

    @jax.jit
    def step(cache, tokens, start):
        return gen.forward_cached(model_def.module(params), tokens, start, cache)[::-1]

    cache = model_def.module(params).init_cache(b, t, jnp.float32)
    cache, first = step(cache, tokens_BT[:, :prefill], jnp.int32(0))
    logits = [first]
    for i in range(prefill, t):
        cache, out = step(cache, tokens_BT[:, i:i + 1], jnp.int32(i))
        logits.append(out)
    return np.concatenate([np.asarray(x) for x in logits], axis=1)


@pytest.mark.parametrize("call, culprit", [
    (lambda: gen.parse_prompt("", ["1", "x"], 96), "not a comma-separated list"),
    (lambda: gen.parse_prompt("", ["1", "96"], 96), r"\[96\], outside .* \[0, 96\)"),
    (lambda: gen.parse_prompt("", ["-1"], 96), "outside"),
    (lambda: gen.parse_prompt("hello", [], 96), "byte-level"),
    (lambda: gen.parse_prompt("", [], 256), "empty"),
    (lambda: gen.check_request(4, 0, 0.0, 64), "at least one"),
    (lambda: gen.check_request(4, -3, 0.0, 64), "at least one"),
    (lambda: gen.check_request(4, 8, -1.0, 64), "temperature"),
    (lambda: gen.check_request(60, 8, 0.0, 64), "max_len=64.*at most 4 tokens"),
    (lambda: gen.check_request(64, 8, 0.0, 64), "no position .* at most 63 tokens"),
])
def test_bad_requests_are_clear_errors(call, culprit):
    with pytest.raises(gen.GenerateError, match=culprit):
        call()
    assert gen.parse_prompt("hi", [], 256) == [104, 105]
    assert gen.parse_prompt("", [" 3", "5"], 96) == [3, 5]


def test_prompt_text_uses_the_tokenizer_and_both_prompt_flags_are_an_error(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    from jaxscale.config import base_config
    from jaxscale.data.tokenizer import model_tokenizer
    loaded = model_tokenizer(base_config(), str(tmp_path))
    ids = gen.parse_prompt("hello world", [], 300, loaded)
    assert ids[0] == loaded.bos_id == 0 and loaded.decode(ids) == "hello world"
    with pytest.raises(gen.GenerateError, match="Both --prompt and --prompt_ids"):
        gen.parse_prompt("hello", ["1"], 300, loaded)


def test_a_directory_without_a_model_config_names_generates_own_flag(tmp_path):
    from jaxscale.errors import JaxscaleError
    with pytest.raises(JaxscaleError, match=r"^--workdir=.* \(written by `jaxscale train`\).*"
                       r"Point --workdir at") as error:
        gen.load_model(str(tmp_path))
    assert "--from_workdir" not in str(error.value) and "launch." not in str(error.value)
