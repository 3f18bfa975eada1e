"""A new attention kind is one module plus one config value.

The toy `shared_kv` (tests/toy_attention.py: one key/value latent per position, its own cache
layout) is added to the attention table for each test only. With `model.attention_kind` set,
the decoder builds its parameters and cache, the model table's FLOP counts and the AOT memory
and traffic models take its facts, it trains, a 2 x 2 fsdp x tensor mesh computes the one-device
run, and decoding through its cache gives the full forward pass's greedy tokens.
"""

from pathlib import Path

import jax
import numpy as np
import pytest

from configs import tiny_lm
from helpers import assert_cached_decoding_is_the_full_forward
from jaxscale.aot.memory import Dims
from jaxscale.aot.traffic import attention_traffic
from jaxscale.config import validate
from jaxscale.errors import ConfigError
from jaxscale.inference import generate as gen
from jaxscale.models import ModelDef, entry_of
from jaxscale.models.attention import kinds
from jaxscale.precision import get_policy
from test_generate import uncached_greedy
from test_parallel_equivalence import assert_equal_runs, make_config, run_steps
from toy_attention import LatentCache, SharedKV


@pytest.fixture
def shared_kv(monkeypatch):
    """`shared_kv` in the table for this test: the one line a shipped kind would add."""
    monkeypatch.setitem(kinds.ATTENTIONS, "shared_kv", SharedKV)


def _config(**model):
    c = tiny_lm.get_config("test")
    c.model.update(attention_kind="shared_kv", **model)
    return c


def test_an_unknown_kind_is_refused_with_the_table():
    c = _config()
    with pytest.raises(ConfigError, match="attention_kind='shared_kv' is not an attention "
                                          "component; use one of grouped_query"):
        validate(c)


@pytest.mark.parametrize("rel", ["models/decoder/flops.py", "models/decoder/block.py",
                                 "models/decoder/llama.py", "aot/memory.py", "aot/traffic.py",
                                 "aot/flops.py", "aot/guess.py", "inference/generate.py",
                                 "inference/sampling.py"])
def test_grouped_query_arithmetic_lives_in_its_component(rel):
    """What asks the attention never spells grouped-query out (kv heads): its component does."""
    text = (Path(kinds.__file__).parents[2] / rel).read_text()
    assert "num_kv_heads" not in text, f"jaxscale/{rel}: ask the attention component"


def test_the_kind_owns_its_parameters_cache_flops_and_bytes(shared_kv):
    c = _config()
    validate(c)
    m = c.model
    L, E, H, D, F, V = m.num_layers, m.embed, m.num_heads, m.head_dim, m.mlp, m.vocab_size
    model_def = ModelDef.build(m, get_policy("32-true"))
    shapes = model_def.shapes()
    assert shapes["layers/attn/wkv"].shape == (L, E, D) and "layers/attn/wqkv" not in shapes
    entry = entry_of(m)
    assert model_def.num_params() == entry.config_cls.from_config(m).num_params()
    cache = model_def.module(model_def.init_params(jax.random.key(0))).init_cache(2, 8)
    assert isinstance(cache, LatentCache) and cache.kv.shape == (L, 2, 8, D)
    # PaLM's count by hand: q, the latent and the out projection (E x D x (2H + 1)), SwiGLU,
    # the head, and 12 L H D T of attention.
    T = c.data.seq_len
    assert entry.flops_per_token(m, T) == 6 * (L * (E * D * (2 * H + 1) + 3 * E * F) + E * V) \
        + 12 * L * H * D * T
    assert Dims.from_model(m, 1).attention_widths == {"attn_out": H * D, "out_proj": E}
    # Across 2 sequence shards each chip moves its tokens' latents (D values each), not k and v.
    c.mesh.update(data=1, fsdp=1, context=2)
    tokens = c.data.batch_size * T / 2
    assert attention_traffic(c)["kv_block_bytes"] == tokens * D * 4


def test_the_kind_trains_and_matches_one_device_on_fsdp_x_tensor(shared_kv):
    configs = [make_config(mesh) for mesh in (dict(data=1), dict(fsdp=2, tensor=2))]
    for c in configs:
        c.model.attention_kind = "shared_kv"
    one = run_steps(configs[0], jax.devices()[:1])
    sharded = run_steps(configs[1], jax.devices()[:4])
    assert_equal_runs(sharded, one)  # the same losses and gradients; the loss went down


def test_the_kind_decodes_through_its_cache_as_the_full_forward(shared_kv):
    c = _config()
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    params = model_def.init_params(jax.random.key(1))
    prompt = np.random.default_rng(0).integers(0, 256, (3, 5)).astype(np.int32)
    out = gen.make_generate(model_def, steps=6)(params, prompt, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out), uncached_greedy(model_def, params, prompt, 6))
    # The cached logits are the full forward's, one token at a time after a prefill.
    tokens = np.random.default_rng(1).integers(0, 256, (2, 7)).astype(np.int32)

    assert_cached_decoding_is_the_full_forward(model_def, params, tokens)
