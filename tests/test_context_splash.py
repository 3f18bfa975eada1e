"""`model.attention=splash` across sequence shards (`models/attention/sequence/context_splash.py`): the splash
kernel (Pallas interpret mode on CPU) per (query chunk, key chunk) pair, merged by log-sum-exp,
equals plain attention in the loss and in the gradients of q, k and v (the custom VJP by
splash's backward kernels), for the ring and the all-gather, with grouped-query heads, packed
documents with padding, a sliding window and the zigzag order. The pair masks follow from the
chunk distance alone (checked against dense masks); a per-layer (traced) window picks its
kernels; a layout off the kernel's grid falls back to the einsum blocks."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.mesh import make_mesh
from jaxscale.models.attention.kernels import attend
from jaxscale.models.attention.mask import Mask
from jaxscale.models.attention.sequence import context, context_splash
from jaxscale.rules import PRESETS, AxisRules, constrain, normalize_rules, use_rules

pytestmark = pytest.mark.filterwarnings("ignore:model.attention=splash")

B, H, K, D = 2, 4, 2, 8  # grouped-query: 2 query heads per kv head
RULES = AxisRules(normalize_rules(PRESETS["fsdp_tp"]))


def _inputs(length):
    keys = jax.random.split(jax.random.key(0), 3)
    qkv = (jax.random.normal(keys[0], (B, length, H, D)),
           jax.random.normal(keys[1], (B, length, K, D)),
           jax.random.normal(keys[2], (B, length, K, D)))
    # Row 0 packs two documents and ends in padding (segment 0); row 1 is one document.
    cut, pad = length * 2 // 5, length // 8
    segments = np.array([[1] * cut + [2] * (length - cut - pad) + [0] * pad, [1] * length])
    return qkv, segments.astype(np.int32)


def _loss(length, shards, impl, variant, order, window, softcap):
    """(q, k, v) -> sum(sin(attention)) over the sequence laid in `order` (None: plain, one
    device, natural order; the loss is a sum, so the order does not change it)."""
    _, segments = _inputs(length)
    order_ = np.arange(length) if order is None else order

    def loss(q_BTHD, k_BTKD, v_BTKD):
        q_BTHD, k_BTKD, v_BTKD = (x[:, order_] for x in (q_BTHD, k_BTKD, v_BTKD))
        slots_1T, seg_BT = jnp.asarray(order_)[None], jnp.asarray(segments[:, order_])
        mask = Mask(slots_1T, slots_1T, seg_BT, seg_BT, True, aligned=True, window=window)
        if shards is None:
            return jnp.sum(jnp.sin(attend(q_BTHD, k_BTKD, v_BTKD, mask, softcap=softcap)))
        with use_rules(RULES, make_mesh(shards)), context.sequence_order(order):
            q_BTHD = constrain(q_BTHD, "batch", "length", "heads", "head_dim")
            k_BTKD = constrain(k_BTKD, "batch", "length", "kv", "head_dim")
            v_BTKD = constrain(v_BTKD, "batch", "length", "kv", "head_dim")
            out = attend(q_BTHD, k_BTKD, v_BTKD, mask, impl=impl, context_impl=variant,
                         softcap=softcap)
        return jnp.sum(jnp.sin(out))
    return loss


def _check(length, shards, variant, zigzag, window=0, softcap=0.0):
    n = shards["context"]
    order = context.zigzag_order(length, n) if zigzag else None
    (q, k, v), _ = _inputs(length)
    grad = lambda *a: jax.jit(jax.value_and_grad(_loss(length, *a, window, softcap),
                                                 argnums=(0, 1, 2)))
    traced = grad(shards, "splash", variant, order).trace(q, k, v)
    jaxpr = str(traced.jaxpr)
    assert "pallas_call" in jaxpr  # the splash kernels run, not the einsum blocks
    assert ("all_gather" if variant == "allgather" else "ppermute") in jaxpr
    loss, grads = traced.lower().compile()(q, k, v)
    ref_loss, ref_grads = grad(None, None, None, None)(q, k, v)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=2e-5, err_msg=f"d loss / d {name}")


@pytest.mark.parametrize("variant, zigzag, window", [
    # Zigzag (two 128-slot chunks per shard) with a window shorter than a chunk: diagonal
    # pairs are local masks, the neighbour's pairs local with an offset, the rest hidden.
    ("ring", True, 100),
    ("allgather", False, 0),  # one 256-slot chunk per shard: causal, full or hidden
])
def test_splash_blocks_equal_plain_attention(variant, zigzag, window):
    _check(512, {"context": 2, "data": 2, "tensor": 2}, variant, zigzag, window)


@pytest.mark.exhaustive
@pytest.mark.parametrize("variant, zigzag, window, softcap", [
    ("ring_vjp", True, 0, 0.0),
    ("allgather", True, 300, 0.0),  # a window over two chunks: full, local and hidden pairs
    ("ring", False, 200, 0.5),      # natural order, a window, Gemma 2's soft-cap
    ("allgather", True, 0, 0.5),
])
def test_splash_blocks_variants_equal_plain_attention(variant, zigzag, window, softcap):
    _check(512, {"context": 2, "data": 2, "tensor": 2}, variant, zigzag, window, softcap)


@pytest.mark.exhaustive
@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_splash_blocks_on_four_shards_equal_plain_attention(variant):
    _check(1024, {"context": 4, "data": 2}, variant, zigzag=True, window=200)


def test_layouts_and_pair_masks_follow_the_dense_mask():
    """The natural order is one chunk per shard, the zigzag order two; each pair's kind,
    from the chunk distance alone, is what the dense causal (and windowed) mask says."""
    assert context_splash.layout(np.arange(1024), 4) == (256, ((0,), (1,), (2,), (3,)))
    assert context_splash.layout(context.zigzag_order(1024, 4), 4) == (
        128, ((0, 7), (1, 6), (2, 5), (3, 4)))
    assert context_splash.layout(context.zigzag_order(512, 4), 4) is None  # 64-slot chunks
    c = 4
    q = np.arange(c)[:, None]
    for window in (0, 1, 3, 4, 5, 8, 9):
        for d in range(-3, 4):
            i, j = d * c + q, np.arange(c)[None]  # slots of query chunk d, key chunk 0
            dense = (j <= i) & ((j > i - window) if window else True)
            name, offset = context_splash.pair_kind(d, c, True, window)
            want = {"hidden": ~dense.any(), "full": dense.all()}.get(name)
            if name == "causal":
                want = (dense == (j <= q)).all()
            if name == "local":
                want = (dense == ((j <= q + offset) & (j >= q + offset - window + 1))).all()
            assert want, (window, d, name, offset)
    assert context_splash.pair_kind(-1, c, False, 0) == ("full", 0)


def test_a_layout_off_the_kernel_grid_falls_back_to_einsum_blocks():
    """Shards of 16 slots cannot hold a 128-lane chunk: the einsum blocks run (warned once)
    and still equal plain attention."""
    length = 64
    (q, k, v), _ = _inputs(length)
    run = lambda shards, impl: jax.jit(_loss(length, shards, impl, "ring", None, 0, 0.0))(
        q, k, v)
    with pytest.warns(UserWarning, match="does not cut into chunks"):
        got = run({"context": 4, "data": 2}, "splash")
    np.testing.assert_allclose(got, run(None, "einsum"), rtol=1e-5)


@pytest.mark.exhaustive
def test_a_per_layer_window_picks_the_local_or_the_global_blocks():
    """Gemma's local/global pattern: the window is traced (scanned with the layers), and the
    layer's flag picks the local (window 100) or the global splash blocks."""
    (q, k, v), _ = _inputs(512)
    mesh = make_mesh({"context": 2, "data": 2, "tensor": 2})

    def loss(impl, q, k, v, window):
        mask = Mask.sequence(512, window=window, local_window=100)
        with use_rules(RULES, mesh) if impl == "splash" else contextlib.nullcontext():
            return jnp.sum(jnp.sin(attend(q, k, v, mask, impl=impl, context_impl="ring")))

    for window in (100, 0):
        grad = lambda impl, w: jax.jit(jax.value_and_grad(
            functools.partial(loss, impl), argnums=(0, 1, 2)))(q, k, v, jnp.int32(w))
        (got, grads), (want, ref_grads) = grad("splash", window), grad("einsum", window)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=2e-5)


def test_flop_accounting_knows_when_the_splash_blocks_run():
    """The compile report adds the kernels' attention FLOPs analytically (the HLO has no dot
    for them) only where the splash blocks run; einsum tiles are in the HLO's own count."""
    from jaxscale.aot import flops
    from jaxscale.configs import llama

    c = llama.get_config("8b-128k,v5p-32")  # context=4, zigzag: chunks of 16,384 slots
    c.model.attention = "splash"
    assert context.splash_blocks_run(131072, 4, "auto", "ring")
    assert flops.kernel_flops(c, 16) > 0
    c.data.seq_len = 4 * 384  # shards of 384 slots: zigzag chunks of 192, off the 128 grid
    assert not context.splash_blocks_run(c.data.seq_len, 4, "auto", "ring")
    assert context.splash_blocks_run(c.data.seq_len, 4, "natural", "ring")
    assert flops.kernel_flops(c, 16) == 0.0
