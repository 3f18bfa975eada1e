"""`model.attention=splash`: the Pallas TPU kernel (here in interpret mode on CPU) computes what
`einsum` computes, forward and backward, under every mask it takes, sharded or not; what it does
not take (a KV cache, a length off the 128 grid) falls back to einsum."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_lm
from jaxscale.models import ModelDef
from jaxscale.models.attention.grouped_query import KVCache
from jaxscale.models.attention.kernels import attend
from jaxscale.models.attention.mask import Mask
from jaxscale.models.attention.splash import block_size
from jaxscale.precision import get_policy
from jaxscale.train.loop import Trainer
from tests.helpers import run_steps

pytestmark = pytest.mark.filterwarnings("ignore:model.attention=splash")


def _qkv(b=2, t=256, h=4, k=2, d=64, seed=0):
    q, kk, v = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(q, (b, t, h, d)), jax.random.normal(kk, (b, t, k, d)),
            jax.random.normal(v, (b, t, k, d)))


def _both(mask, q, k, v, softcap=0.0):
    """(out, grads) of a weighted sum of the attention output, for splash and for einsum."""
    def run(impl):
        w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
        out_of = lambda q, k, v: attend(q, k, v, mask, impl=impl, softcap=softcap)
        loss = lambda q, k, v: (out_of(q, k, v) * w).sum()
        grads = jax.grad(loss, argnums=(0, 1, 2))
        return jax.jit(lambda q, k, v: (out_of(q, k, v), grads(q, k, v)))(q, k, v)  # one compile
    return run("splash"), run("einsum")


# Row 0: four documents; row 1: two documents then padding (segment 0, as the packer writes it).
SEGMENTS = jnp.asarray(np.stack([np.repeat([1, 2, 3, 4], [100, 28, 64, 64]),
                                 np.repeat([1, 2, 0], [128, 60, 68])]), jnp.int32)


@pytest.mark.parametrize("name, mask, heads, softcap", [
    ("causal", Mask.sequence(256), (4, 2), 0.0),
    ("causal+segments", Mask.sequence(256, SEGMENTS), (4, 2), 0.0),
    ("bidirectional+segments", Mask.sequence(256, SEGMENTS, causal=False), (4, 4), 0.0),
    ("multi-query", Mask.sequence(256), (4, 1), 0.0),
    # Gemma 2's soft-cap, small enough to bite (the scores here are ~N(0, 1)).
    ("causal+segments+softcap", Mask.sequence(256, SEGMENTS), (4, 2), 0.7),
])
def test_kernel_and_gradients_equal_einsum(name, mask, heads, softcap):
    q, k, v = _qkv(h=heads[0], k=heads[1])
    (out, grads), (ref, ref_grads) = _both(mask, q, k, v, softcap)
    if softcap:  # the cap is applied, not ignored by both
        uncapped = attend(q, k, v, mask, impl="einsum")
        assert float(jnp.max(jnp.abs(uncapped - ref))) > 100 * float(
            jnp.max(jnp.abs(out - ref)))
    chex.assert_trees_all_close(out, ref, atol=2e-5, rtol=2e-5)
    for got, want, what in zip(grads, ref_grads, "qkv"):
        chex.assert_trees_all_close(got, want, atol=5e-5, rtol=5e-5,
                                    custom_message=f"{name}: d{what}")


def test_the_kernel_really_runs_where_it_applies_and_einsum_elsewhere():
    q, k, v = _qkv()
    kernels = lambda mask, *a: str(jax.make_jaxpr(
        lambda *x: attend(*x, mask, impl="splash"))(*a)).count("pallas_call")
    assert kernels(Mask.sequence(256, SEGMENTS), q, k, v) >= 1
    assert kernels(None, q, k, v) >= 1  # no mask: every key visible (the ViT's case)
    # Decoding: 1 new query over a 256-slot cache -> einsum (a 1 x S score row is small).
    cached = Mask.cached(1, jnp.int32(9), 256)
    assert kernels(cached, q[:, :1], k, v) == 0
    chex.assert_trees_all_close(attend(q[:, :1], k, v, cached, impl="splash"),
                                attend(q[:, :1], k, v, cached, impl="einsum"))
    # A length off the 128 grid: einsum, and a warning saying why.
    q, k, v = _qkv(t=200)
    with pytest.warns(UserWarning, match="200 is not a multiple of 128"):
        assert kernels(Mask.sequence(200), q, k, v) == 0


def test_block_size_is_the_largest_tile_dividing_the_length():
    assert [block_size(t) for t in (128, 384, 768, 2048, 200)] == [128, 128, 256, 512, None]


def _tiny(impl, precision="32-true", **model):
    c = tiny_lm.get_config("test")
    c.model.update(attention=impl, **model)
    model_def = ModelDef.build(c.model, get_policy(precision))
    return model_def, model_def.init_params(jax.random.key(2))


@pytest.mark.parametrize("precision, tol", [("32-true", 1e-4), ("bf16-mixed", 5e-2)])
def test_llama_logits_with_packed_documents_equal_einsum(precision, tol):
    tokens = np.random.default_rng(3).integers(0, 256, (2, 256)).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in (100, 28, 64, 64, 128, 60, 68)])
    positions = positions.reshape(2, 256).astype(np.int32)
    logits = {}
    for impl in ("splash", "einsum"):
        model_def, params = _tiny(impl, precision)
        fwd = jax.jit(lambda p, t, pos, seg, m=model_def: m.module(p)(t, pos, segments_BT=seg))
        logits[impl] = fwd(params, tokens, positions, SEGMENTS).astype(jnp.float32)
    # bf16: q is scaled before the kernel's dot, after einsum's; both keep float32 softmax.
    chex.assert_trees_all_close(logits["splash"], logits["einsum"], atol=tol, rtol=tol)


def test_decoding_with_a_cache_falls_back_and_equals_the_full_forward():
    model_def, params = _tiny("splash")
    tokens = np.random.default_rng(4).integers(0, 256, (2, 130)).astype(np.int32)

    @jax.jit
    def cached(p, toks):
        model = model_def.module(p)
        cache = model.init_cache(2, 130)
        first, cache = model(toks[:, :128], cache=cache, cache_index=jnp.int32(0))
        rest = [model(toks[:, i:i + 1], cache=cache, cache_index=jnp.int32(i))[0]
                for i in (128, 129)]
        return jnp.concatenate([first] + rest, axis=1), cache

    logits, cache = cached(params, tokens)
    assert isinstance(cache, KVCache)
    full = jax.jit(lambda p, t: model_def.module(p)(t[:, :128]))(params, tokens)
    chex.assert_trees_all_close(logits[:, :128], full, atol=1e-5, rtol=1e-5)


def test_gemma_local_and_global_layers_equal_einsum():
    """A scanned local/global pattern (Gemma 3's): each layer's traced flag picks the local
    (window 32 of 128) or the global kernel by `lax.cond`; logits and gradients as einsum's."""
    tokens = np.random.default_rng(5).integers(0, 256, (2, 128)).astype(np.int32)
    gemma = dict(name="gemma3", num_layers=2, sliding_window=32,
                 layer_types=("sliding_attention", "full_attention"))
    out = {}
    for impl in ("splash", "einsum"):
        model_def, params = _tiny(impl, **gemma)
        logits = lambda p, m=model_def: m.module(p)(tokens).astype(jnp.float32)
        grad = jax.grad(lambda p, f=logits: (f(p) * jnp.cos(f(p))).sum())
        if impl == "splash":  # two kernels (and their backward) under one cond per layer
            jaxpr = str(jax.make_jaxpr(grad)(params))
            assert "cond" in jaxpr and "pallas_call" in jaxpr
        out[impl] = jax.jit(lambda p, f=logits, g=grad: (f(p), g(p)))(params)  # one compile
    chex.assert_trees_all_close(out["splash"], out["einsum"], atol=1e-4, rtol=1e-4)
    # The window bites: with both layers global the logits differ.
    model_def, params = _tiny("einsum", **{**gemma, "layer_types": ("full_attention",) * 2})
    everywhere = jax.jit(lambda p: model_def.module(p)(tokens))(params)
    assert float(jnp.max(jnp.abs(everywhere - out["einsum"][0]))) > 1e-2


def _losses(impl: str, mesh: dict, preset: str, steps: int = 2, model: dict | None = None,
            **train) -> np.ndarray:
    c = tiny_lm.get_config("test")
    c.model.update(attention=impl, num_heads=4, num_kv_heads=2, **(model or {}))
    c.data.update(seq_len=128, batch_size=8)
    c.mesh.update({**dict(data=1, pipeline=1, fsdp=1, tensor=1), **mesh})
    c.rules_preset = preset
    for key, value in train.items():
        (c.pipeline if key in ("microbatches", "schedule") else c.train)[key] = value
    trainer = Trainer.build(c, workdir=None)
    if impl == "splash":  # the kernel runs inside a shard_map over the mesh
        batch = trainer.to_global(next(trainer.batches.iterator()))
        jaxpr = str(jax.make_jaxpr(trainer.train_fn)(trainer.state, batch))
        assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    return run_steps(trainer, steps)[0]


def test_sharded_training_over_fsdp_and_tensor_equals_einsum():
    mesh = dict(fsdp=4, tensor=2)
    np.testing.assert_allclose(_losses("splash", mesh, "fsdp_tp"),
                               _losses("einsum", mesh, "fsdp_tp"), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, train", [
    pytest.param(dict(pipeline=2, fsdp=2, tensor=2), dict(microbatches=2),  # vmap: `pipeline`
                 marks=pytest.mark.exhaustive),
    (dict(pipeline=2, data=2, tensor=2), dict(microbatches=4, schedule="1f1b")),
    (dict(data=4, tensor=2), dict(grad_accum=2)),                # vmap over `data`
])
def test_sharded_training_under_vmapped_stages_and_replicas_equals_einsum(mesh, train):
    np.testing.assert_allclose(_losses("splash", mesh, "pp", **train),
                               _losses("einsum", mesh, "pp", **train), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("mesh, preset, train", [
    (dict(fsdp=4, tensor=2), "fsdp_tp", {}),  # the cond chooses between two shard_maps
    # 1F1B vmaps the stages, so each layer's cond is a select: both kernels run.
    (dict(pipeline=2, data=2, tensor=2), "pp", dict(microbatches=4, schedule="1f1b")),
])
def test_gemma_pattern_trains_sharded_and_pipelined_as_einsum(mesh, preset, train):
    gemma = dict(name="gemma3", num_layers=4, sliding_window=32, layer_types=(
        "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"))
    np.testing.assert_allclose(_losses("splash", mesh, preset, model=gemma, **train),
                               _losses("einsum", mesh, preset, model=gemma, **train), rtol=1e-5)
