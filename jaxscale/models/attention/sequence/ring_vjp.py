"""Ring attention with a custom VJP: the backward pass is a ring too (`model.context_attention=
ring_vjp`, `context.py`).

Why: autodiff through the ring (`context.ring_attention`) keeps every step's K/V block as a
residual, so the backward pass holds the whole sequence's K/V per shard, as the all-gather
does. Here the forward pass keeps only the shard's own q, k, v, output and log-sum-exp; the
backward pass rotates the K/V blocks around the ring again, each shard adding its queries'
gradient contributions to the block's dK/dV, which travel with the block and arrive home after
n hops, while dQ stays local (the flash-attention backward: P = exp(S - lse),
dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ = dS K, dK = dS^T Q, with the soft-cap's
1 - tanh^2 on dS; attention sinks start the forward's online softmax, `blockwise.start`, and
get d sink = -sum over rows of exp(sink - lse) rowsum(dO O)). Blocks are attended in tiles with hidden tiles skipped, as the forward pass
does (`attention/blockwise.py`).
Shape suffixes as in `attention/blockwise.py`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from einops import rearrange

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.attention import blockwise


def _scores(q_BTKGD: jax.Array, k_BSKD: jax.Array, softcap: float
            ) -> tuple[jax.Array, jax.Array | None]:
    """Scaled (and soft-capped) float32 scores (`blockwise.scores`), and tanh of the cap
    (None without): the cap's derivative is 1 - tanh^2."""
    s = blockwise.scores(q_BTKGD, k_BSKD, jnp.float32, softcap)
    return s, (s / softcap if softcap else None)


def _tile_grads(q: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array, keys: dict,
                mask: Any, softcap: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One tile's dQ (B, T, K, G, D) and the block tile's dK, dV (B, S, K, D), float32."""
    s, t = _scores(q, keys["k"], softcap)
    p = jnp.exp(s - lse[..., None])
    visible = mask.dense()
    if visible is not None:
        p = jnp.where(visible[:, None, None], p, 0.0)
    v = keys["v"]
    dv = jnp.einsum("bkgts,btkgd->bskd", p, do.astype(jnp.float32))
    dp = jnp.einsum("btkgd,bskd->bkgts", do.astype(jnp.float32), v.astype(jnp.float32))
    ds = p * (dp - delta[..., None])
    if t is not None:
        ds = ds * (1.0 - t * t)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, keys["k"].astype(jnp.float32)) * scale
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, q.astype(jnp.float32)) * scale
    return dq, dk, dv


def _block_grads(q: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array,
                 slots: jax.Array, segments: jax.Array | None, held: dict, causal: bool,
                 window: Any, softcap: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dQ of the local queries and dK, dV of the block in hand, tile by tile, hidden tiles
    skipped (`blockwise.tiles`)."""
    p, r = blockwise.tiles(q.shape[1]), blockwise.tiles(held["k"].shape[1])
    tiled = blockwise.tiled
    keys = {"segments": None, **{name: tiled(x, 1, r) for name, x in held.items()}}
    b, s, k, d = held["k"].shape

    def query_tile(dkv: tuple, xs: tuple) -> tuple[tuple, jax.Array]:
        q_i, do_i, lse_i, delta_i, slots_i, seg_i = xs

        def key_tile(dq: jax.Array, keys_j: dict) -> tuple[jax.Array, tuple]:
            mask = blockwise.block_mask(slots_i, seg_i, keys_j, causal, window)
            zeros = (jnp.zeros_like(dq), jnp.zeros(keys_j["k"].shape, jnp.float32),
                     jnp.zeros(keys_j["k"].shape, jnp.float32))
            grads = lambda: _tile_grads(q_i, do_i, lse_i, delta_i, keys_j, mask, softcap)
            visible = mask.dense()
            tile = grads() if visible is None else jax.lax.cond(
                jnp.any(visible), grads, lambda: zeros)
            return dq + tile[0], (tile[1], tile[2])

        dq_i, (dk_j, dv_j) = jax.lax.scan(key_tile, jnp.zeros(q_i.shape, jnp.float32), keys)
        untile = lambda x: blockwise.untiled(x, 1)  # (Q, B, C, K, D) -> (B, S, K, D)
        return (dkv[0] + untile(dk_j), dkv[1] + untile(dv_j)), dq_i

    xs = (tiled(q, 1, p), tiled(do, 1, p), tiled(lse, 3, p), tiled(delta, 3, p),
          tiled(slots, 1, p), tiled(segments, 1, p))
    zero = jnp.zeros((b, s, k, d), jnp.float32)
    (dk, dv), dq = jax.lax.scan(query_tile, (zero, zero), xs)
    return blockwise.untiled(dq, 1), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _ring(q_BTKGD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, slots_1T: jax.Array,
          segments_BT: jax.Array | None, sinks_H: jax.Array | None, axes: tuple, n: int,
          causal: bool, window: int, softmax_dtype: Any, softcap: float) -> jax.Array:
    return _forward(q_BTKGD, k_BSKD, v_BSKD, slots_1T, segments_BT, sinks_H, axes, n, causal,
                    window, softmax_dtype, softcap)[0]


def _send(axes: tuple, n: int) -> Any:
    ring = [(i, (i + 1) % n) for i in range(n)]
    return lambda x: None if x is None else jax.lax.ppermute(x, axes, ring)


def _forward(q, k, v, slots, segments, sinks, axes, n, causal, window, softmax_dtype,
             softcap):
    """The ring's forward pass (as `context.ring_work`), and the log-sum-exp (B, K, G, T)."""
    send = _send(axes, n)
    attend = blockwise.step_fn(q, slots, segments, causal, window, softcap)
    block = {"k": k, "v": v, "slots": slots, "segments": segments}

    def step(carry: tuple, _: None) -> tuple[tuple, None]:
        acc, held = carry
        acc = attend(acc, held)[0]
        return (acc, {name: send(x) for name, x in held.items()}), None

    start = blockwise.start(q, softmax_dtype, sinks)
    (acc, held), _ = jax.lax.scan(step, (start, block), length=n - 1)
    acc = attend(acc, held)[0]
    out = acc.out_BTKGD / rearrange(acc.sum_BKGT, "b k g t -> b t k g 1")
    lse = acc.max_BKGT + jnp.log(acc.sum_BKGT)
    return out.astype(q.dtype), lse


def _ring_fwd(q, k, v, slots, segments, sinks, axes, n, causal, window, softmax_dtype,
              softcap):
    out, lse = _forward(q, k, v, slots, segments, sinks, axes, n, causal, window,
                        softmax_dtype, softcap)
    return out, (q, k, v, slots, segments, sinks, out, lse)


def _ring_bwd(axes, n, causal, window, softmax_dtype, softcap, res, d_out):
    """dQ locally; dK, dV ride with their blocks around the ring and are home after n hops."""
    q, k, v, slots, segments, sinks, out, lse = res
    delta = jnp.einsum("btkgd,btkgd->bkgt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    send = _send(axes, n)
    zero = jnp.zeros(k.shape, jnp.float32)

    def step(carry: tuple, _: None) -> tuple[tuple, None]:
        dq, held = carry
        dq_b, dk_b, dv_b = _block_grads(q, d_out, lse, delta, slots, segments, held, causal,
                                        window, softcap)
        held = dict(held, dk=held["dk"] + dk_b, dv=held["dv"] + dv_b)
        return (dq + dq_b, {name: send(x) for name, x in held.items()}), None

    block = {"k": k, "v": v, "slots": slots, "segments": segments, "dk": zero, "dv": zero}
    (dq, held), _ = jax.lax.scan(step, (jnp.zeros(q.shape, jnp.float32), block), length=n)
    d_sinks = None
    if sinks is not None:  # the sink's share of each row's softmax, times -rowsum(dO O)
        p_sink = jnp.exp(rearrange(sinks.astype(jnp.float32), "(k g) -> 1 k g 1",
                                   k=k.shape[2]) - lse)
        d_sinks = rearrange(-jnp.sum(p_sink * delta, axis=(0, 3)), "k g -> (k g)"
                            ).astype(sinks.dtype)
    return (dq.astype(q.dtype), held["dk"].astype(k.dtype), held["dv"].astype(v.dtype),
            None, None, d_sinks)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_vjp_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                       slots_1T: jax.Array, segments_BT: jax.Array | None, *,
                       axes: tuple[str, ...], n: int, causal: bool, window: Any,
                       softmax_dtype: Any, softcap: float = 0.0,
                       sinks_H: jax.Array | None = None) -> jax.Array:
    """One shard's ring attention whose backward pass is a ring (see the module docstring).
    A traced window (a per-layer local/global pattern) is not supported: use `ring`."""
    if isinstance(window, jax.Array):
        raise ConfigError(paragraph(
            "model.context_attention=ring_vjp takes one sliding window for every layer, but",
            "this model's window changes per layer (a local/global pattern). Use",
            "model.context_attention=ring or allgather."))
    q_BTKGD = rearrange(q_BTHD, "b t (k g) d -> b t k g d", k=k_BSKD.shape[2])
    out = _ring(q_BTKGD, k_BSKD, v_BSKD, slots_1T, segments_BT, sinks_H, tuple(axes), n,
                causal, int(window), softmax_dtype, float(softcap))
    return rearrange(out, "b t k g d -> b t (k g) d").astype(v_BSKD.dtype)
