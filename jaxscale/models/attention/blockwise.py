"""Blockwise attention of a shard's queries to one key block: the online softmax in tiles.

Why: attention across sequence shards (`sequence/context.py`) attends a shard's T/n queries to
key blocks of T/n keys, one at a time. At 131,072 tokens over 4 shards one such block's float32
scores are 32,768^2 x heads x 4 bytes (128 GiB for 32 heads): no chip holds them. So a block is
cut into tiles of at most `TILE` queries by `TILE` keys (and at least in halves, so that the
zigzag order's hidden halves can be skipped), attended tile by tile with the online-softmax
(log-sum-exp) merge, each tile skipped (`lax.cond`) where the mask hides all of it (exact: a
hidden tile adds nothing). Autodiff through the tiles is rematerialised at every level (a
tile, a query tile's row of key tiles, the whole block), so the backward pass keeps the running
state per tile, never the scores. This is the einsum path (`model.attention=einsum`); with
`model.attention=splash` the splash kernel does the same per block with the block's offsets in
its mask, in VMEM (`sequence/context_splash.py`).
Shape suffixes: B batch, T local queries, S keys in hand, K kv heads, G heads per kv head,
D head dim, P query tiles, Q key tiles, C tile length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange

from jaxscale.models.attention.mask import Mask

TILE = 2048  # queries (and keys) per score tile: TILE^2 x heads float32 scores at once
Block = Mapping[str, jax.Array | None]  # k, v (B, S, K, D), slots (1, S), segments (B, S)


class Acc(NamedTuple):
    """Online-softmax state of the local queries: running max and sum (B, K, G, T) and the
    unnormalised output (B, T, K, G, D), all in the softmax dtype."""

    max_BKGT: jax.Array
    sum_BKGT: jax.Array
    out_BTKGD: jax.Array


def start(q_BTKGD: jax.Array, dtype: Any, sinks_H: jax.Array | None = None) -> Acc:
    """The state before any key: empty, or with attention sinks (`sinks_H`, GPT-OSS) the sink
    already attended as a key whose value is zero: max = sink, sum = exp(sink - max) = 1
    (written so that the gradient reaches the sink), output 0. Every later block merges as
    usual, so each path that starts here (the context shards' blocks) gets the sinks exactly."""
    b, t, k, g, d = q_BTKGD.shape
    out = jnp.zeros((b, t, k, g, d), dtype)
    if sinks_H is None:
        return Acc(jnp.full((b, k, g, t), jnp.finfo(dtype).min, dtype),
                   jnp.zeros((b, k, g, t), dtype), out)
    sink_KG1 = rearrange(sinks_H.astype(dtype), "(k g) -> k g 1", k=k)
    max_KG1 = jax.lax.stop_gradient(sink_KG1)
    return Acc(jnp.broadcast_to(max_KG1, (b, k, g, t)),
               jnp.broadcast_to(jnp.exp(sink_KG1 - max_KG1), (b, k, g, t)), out)


def scores(q_BTKGD: jax.Array, k_BSKD: jax.Array, dtype: Any, softcap: float = 0.0,
           kv_axes: str = "bskd") -> jax.Array:
    """q.k / sqrt(D) in `dtype`, (B, K, G, T, S); `softcap` > 0 (Gemma 2): softcap *
    tanh(scores / softcap). The one score formula of every attention path (`einsum_attention`,
    the online-softmax blocks here, the ring's custom backward). `kv_axes` "bksd": the keys
    are (B, K, S, D), the KV cache's layout (`grouped_query.KVCache`)."""
    s_BKGTS = jnp.einsum(f"btkgd,{kv_axes}->bkgts", q_BTKGD, k_BSKD).astype(dtype)
    s_BKGTS = s_BKGTS / math.sqrt(q_BTKGD.shape[-1])
    return softcap * jnp.tanh(s_BKGTS / softcap) if softcap else s_BKGTS


def accumulate(acc: Acc, q_BTKGD: jax.Array, block: Block, mask: Mask,
               softcap: float = 0.0) -> Acc:
    """`acc` with the key block `block` attended under `mask`: the online-softmax merge. The
    running max is held constant for autodiff (the result does not depend on it), so hidden
    scores never meet inf - inf. `softcap` > 0: the scaled scores become
    softcap * tanh(scores / softcap) first, as `einsum_attention` does."""
    dtype = acc.sum_BKGT.dtype
    scores_BKGTS = scores(q_BTKGD, block["k"], dtype, softcap)
    visible_BTS = mask.dense()
    if visible_BTS is not None:
        scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS, jnp.finfo(dtype).min)
    max_BKGT = jax.lax.stop_gradient(jnp.maximum(acc.max_BKGT, scores_BKGTS.max(-1)))
    probs_BKGTS = jnp.exp(scores_BKGTS - max_BKGT[..., None])
    if visible_BTS is not None:  # a block hidden from a query adds nothing to its sums
        probs_BKGTS = jnp.where(visible_BTS[:, None, None], probs_BKGTS, 0.0)
    scale_BKGT = jnp.exp(acc.max_BKGT - max_BKGT)
    v_BSKD = block["v"]
    new_BTKGD = jnp.einsum("bkgts,bskd->btkgd", probs_BKGTS.astype(v_BSKD.dtype), v_BSKD)
    out_BTKGD = (acc.out_BTKGD * rearrange(scale_BKGT, "b k g t -> b t k g 1")
                 + new_BTKGD.astype(dtype))
    return Acc(max_BKGT, acc.sum_BKGT * scale_BKGT + probs_BKGTS.sum(-1), out_BTKGD)


def finish(acc: Acc, like: jax.Array) -> jax.Array:
    """The normalised output (B, T, H, D) in `like`'s dtype. Every query sees at least its own
    key (padding is segment 0 and sees itself), so no sum is 0."""
    out_BTKGD = acc.out_BTKGD / rearrange(acc.sum_BKGT, "b k g t -> b t k g 1")
    return rearrange(out_BTKGD, "b t k g d -> b t (k g) d").astype(like.dtype)


def block_mask(slots_1T: jax.Array, segments_BT: jax.Array | None, block: Block,
               causal: bool, window: Any) -> Mask:
    return Mask(slots_1T, block["slots"], segments_BT,
                None if segments_BT is None else block["segments"], causal, window=window)


def tiles(length: int) -> int:
    """How many tiles a shard's `length` is cut into: halves at least (1 if odd), doubled
    while a tile is longer than `TILE` and the length divides."""
    if length % 2:
        return 1
    parts = 2
    while length // parts > TILE and length % (2 * parts) == 0:
        parts *= 2
    return parts


def tiled(x: jax.Array | None, axis: int, parts: int) -> jax.Array | None:
    """`x` with `axis` cut into `parts` tiles, the tile index moved first."""
    if x is None:
        return None
    shape = x.shape[:axis] + (parts, x.shape[axis] // parts) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def untiled(x: jax.Array, axis: int) -> jax.Array:
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _skipping(acc: Acc, q_BTKGD: jax.Array, block: Block, mask: Mask,
              softcap: float) -> tuple[Acc, jax.Array]:
    """`accumulate`, skipped where `mask` hides every (query, key) pair; and the number of
    score entries (query x key, per row and head) computed, 0 when skipped."""
    visible = mask.dense()
    size = jnp.int32(q_BTKGD.shape[1] * block["k"].shape[1])
    if visible is None:
        return accumulate(acc, q_BTKGD, block, mask, softcap), size
    seen = jnp.any(visible)
    acc = jax.lax.cond(seen, lambda a: accumulate(a, q_BTKGD, block, mask, softcap),
                       lambda a: a, acc)
    return acc, jnp.where(seen, size, 0)


_remat = lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)


def step(acc: Acc, q_BTKGD: jax.Array, slots_1T: jax.Array, segments_BT: jax.Array | None,
         held: Block, causal: bool, window: Any, softcap: float) -> tuple[Acc, jax.Array]:
    """`acc` with the block in hand attended tile by tile (`tiles` of the queries and of the
    keys), each hidden tile skipped; and the score entries computed."""
    p, q = tiles(q_BTKGD.shape[1]), tiles(held["k"].shape[1])
    keys = {name: tiled(x, 1, q) for name, x in held.items()}
    keys = {"segments": None, **keys}

    @_remat
    def query_tile(acc_i: Acc, q_i: jax.Array, slots_i: jax.Array, seg_i: jax.Array | None
                   ) -> tuple[Acc, jax.Array]:
        @_remat
        def key_tile(carry: tuple[Acc, jax.Array], keys_j: dict) -> tuple[tuple, None]:
            acc, work = carry
            mask = block_mask(slots_i, seg_i, keys_j, causal, window)
            acc, done = _skipping(acc, q_i, keys_j, mask, softcap)
            return (acc, work + done), None

        (acc_i, work), _ = jax.lax.scan(key_tile, (acc_i, jnp.int32(0)), keys)
        return acc_i, work

    accs = Acc(tiled(acc.max_BKGT, 3, p), tiled(acc.sum_BKGT, 3, p), tiled(acc.out_BTKGD, 1, p))
    xs = (accs, tiled(q_BTKGD, 1, p), tiled(slots_1T, 1, p), tiled(segments_BT, 1, p))
    accs, works = jax.lax.map(lambda x: query_tile(*x), xs)
    acc = Acc(untiled(accs.max_BKGT, 3), untiled(accs.sum_BKGT, 3), untiled(accs.out_BTKGD, 1))
    return acc, works.sum()


def step_fn(q_BTKGD: jax.Array, slots_1T: jax.Array, segments_BT: jax.Array | None,
            causal: bool, window: Any, softcap: float) -> Callable[[Acc, Block], tuple]:
    """(acc, block) -> `step`, rematerialised: the backward pass keeps a step's inputs only
    (the running state and the block) and recomputes the rest."""
    def one(acc: Acc, held: Block) -> tuple[Acc, jax.Array]:
        held = {"segments": None, **held}
        return step(acc, q_BTKGD, slots_1T, segments_BT, held, causal, window, softcap)
    return _remat(one)
