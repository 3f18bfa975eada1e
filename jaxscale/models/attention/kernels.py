"""Attention kernels: `attend`, the one function every attention module computes attention with.

`attend(q, k, v, mask, impl=...)` computes attention from queries, keys, values and a `Mask`;
the decoder's attention components (`grouped_query.py`, ...) and the ViT's bidirectional
attention all call it. Kernels are an explicit table (`ATTENTION_IMPLS`, chosen by
`model.attention`). A `Mask` (`mask.py`) is described, not materialised: query and key *slots*
(index in the sequence or the KV cache, not the rotary positions), optional segment ids (packed
documents attend only within their own document), whether it is causal and an optional sliding
window (`model.sliding_window`), so a kernel can use its own structured masking (the fused
kernel's built-in causal mask, the splash kernel's causal mask and segment ids; `splash.py`)
and others build the dense boolean mask with `Mask.dense`. A whole sequence that the rules
split over sequence shards runs across them (`sequence/context.py`).
Shape suffixes: B batch, T query length, S key length (cache length), H heads, K kv heads,
G heads per kv head, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from einops import rearrange

from jaxscale.models.attention import blockwise, splash
from jaxscale.models.attention.mask import Mask
from jaxscale.models.attention.sequence import context


def einsum_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                     mask: Mask | None, softmax_dtype: Any, softcap: float = 0.0,
                     sinks_H: jax.Array | None = None, kv_axes: str = "bskd") -> jax.Array:
    """Grouped-query attention written out: the reference every other kernel must match.
    `softcap` > 0 (Gemma 2): the scaled scores become softcap * tanh(scores / softcap).
    `sinks_H` (GPT-OSS): one learned logit per head joins each query's softmax as a key
    without a value, so a head can put weight on nothing. `kv_axes` "bksd": keys and values
    are (B, K, S, D), the KV cache's layout, which both dots then read as they are."""
    kv = k_BSKD.shape[kv_axes.index("k")]
    q_BTKGD = rearrange(q_BTHD, "b t (k g) d -> b t k g d", k=kv)
    scores_BKGTS = blockwise.scores(q_BTKGD, k_BSKD, softmax_dtype, softcap, kv_axes)
    visible_BTS = None if mask is None else mask.dense()
    if visible_BTS is not None:
        scores_BKGTS = jnp.where(visible_BTS[:, None, None], scores_BKGTS,
                                 jnp.finfo(scores_BKGTS.dtype).min)
    if sinks_H is not None:
        sink_BKGT1 = jnp.broadcast_to(
            rearrange(sinks_H.astype(scores_BKGTS.dtype), "(k g) -> 1 k g 1 1", k=kv),
            (*scores_BKGTS.shape[:-1], 1))
        with_sink = jax.nn.softmax(jnp.concatenate([scores_BKGTS, sink_BKGT1], -1), axis=-1)
        probs_BKGTS = with_sink[..., :-1].astype(v_BSKD.dtype)
    else:
        probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKD.dtype)
    # Out (B, K, G, T, D), then transposed: asked for (B, T, K, G, D) directly, XLA:CPU makes
    # the cache the dot's transposed left operand, ~9x slower (a decoding step's largest cost).
    out_BKGTD = jnp.einsum(f"bkgts,{kv_axes}->bkgtd", probs_BKGTS, v_BSKD)
    return rearrange(out_BKGTD, "b k g t d -> b t (k g) d")


def fused_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                    mask: Mask | None, softmax_dtype: Any) -> jax.Array:
    """`jax.nn.dot_product_attention` (cuDNN flash attention on GPUs where it applies)."""
    if mask is not None and mask.aligned and mask.q_segments_BT is None:
        window = (mask.window - 1, 0) if mask.window else None  # (left, right) keys, inclusive
        return jax.nn.dot_product_attention(q_BTHD, k_BSKD, v_BSKD, is_causal=mask.causal,
                                            local_window_size=window)
    visible_BTS = None if mask is None else mask.dense()
    return jax.nn.dot_product_attention(
        q_BTHD, k_BSKD, v_BSKD, mask=None if visible_BTS is None else visible_BTS[:, None])


def splash_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                     mask: Mask | None, softmax_dtype: Any, softcap: float = 0.0,
                     sinks_H: jax.Array | None = None) -> jax.Array:
    """The Pallas TPU splash kernel (`splash.py`): scores never reach HBM. Decoding
    against a cache, and lengths off its 128 grid, run `einsum_attention` instead. `softcap`:
    the kernel's own logit soft-capping (Gemma 2); `sinks_H`: its own attention sinks."""
    return splash.attention(q_BTHD, k_BSKD, v_BSKD, mask, softmax_dtype,
                            fallback=einsum_attention, softcap=softcap, sinks_H=sinks_H)


# Attention kernels by `model.attention`: (q, k, v, mask, softmax dtype) -> out (B, T, H, D).
ATTENTION_IMPLS: dict[str, Callable[..., jax.Array]] = {
    "einsum": einsum_attention,
    "dot_product_attention": fused_attention,
    "splash": splash_attention,
}
# The kernels that soft-cap the scores (a `softcap` argument > 0, Gemma 2's `attn_softcap`);
# `model.attention=dot_product_attention` with a soft-cap is refused by the config check.
# The same kernels take attention sinks (`sinks_H`, GPT-OSS's `model.attn_sinks`).
SOFTCAP_IMPLS: dict[str, Callable[..., jax.Array]] = {
    "einsum": einsum_attention,
    "splash": splash_attention,
}
SINK_IMPLS = SOFTCAP_IMPLS


def attend(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, mask: Mask | None, *,
           impl: str = "einsum", softmax_dtype: Any = jnp.float32,
           context_impl: str = "allgather", softcap: float = 0.0,
           sinks_H: jax.Array | None = None) -> jax.Array:
    """softmax(q.k / sqrt(D), masked) . v with the kernel `impl`; K kv heads serve H/K heads.
    A whole sequence that the active rules split over sequence shards runs by `context_impl`
    (`sequence/context.py`), soft-capped and with sinks too. Soft-capped scores (`softcap` > 0,
    Gemma 2) or attention sinks (`sinks_H` (H,), GPT-OSS) otherwise run a kernel of
    `SOFTCAP_IMPLS` / `SINK_IMPLS` (the config check refuses the others)."""
    shards = (context.sequence_shards(q_BTHD.shape[1], impl)
              if mask is not None and mask.aligned else None)
    if shards is not None:
        return context.attention(q_BTHD, k_BSKD, v_BSKD, mask, softmax_dtype,
                                 variant=context_impl, shards=shards, softcap=softcap,
                                 sinks_H=sinks_H)
    if sinks_H is not None:
        return SINK_IMPLS[impl](q_BTHD, k_BSKD, v_BSKD, mask, softmax_dtype, softcap, sinks_H)
    if softcap:
        return SOFTCAP_IMPLS[impl](q_BTHD, k_BSKD, v_BSKD, mask, softmax_dtype, softcap)
    return ATTENTION_IMPLS[impl](q_BTHD, k_BSKD, v_BSKD, mask, softmax_dtype)


def attend_cached(q_BTHD: jax.Array, k_BKSD: jax.Array, v_BKSD: jax.Array, mask: Mask, *,
                  impl: str = "einsum", softmax_dtype: Any = jnp.float32, softcap: float = 0.0,
                  sinks_H: jax.Array | None = None) -> jax.Array:
    """`attend` of new queries over a KV cache held (B, K, S, D), the layout both of the
    einsum kernel's dots read without a transpose: a decoding step then reads the cache once
    instead of copying it into (B, K, S, D) and (B, K, D, S) first. Splash, which decodes by
    the einsum kernel anyway (a cached mask is never aligned), reads it so too; the fused
    kernel (`jax.nn.dot_product_attention`) takes its own (B, S, K, D)."""
    if impl == "dot_product_attention":
        swap = lambda x: jnp.swapaxes(x, 1, 2)
        return attend(q_BTHD, swap(k_BKSD), swap(v_BKSD), mask, impl=impl,
                      softmax_dtype=softmax_dtype)
    return einsum_attention(q_BTHD, k_BKSD, v_BKSD, mask, softmax_dtype, softcap, sinks_H,
                            kv_axes="bksd")


def check_impl(impl: str) -> None:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"Unknown model.attention={impl!r}; use one of "
                         f"{list(ATTENTION_IMPLS)}.")
