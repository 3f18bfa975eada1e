"""Splash attention: the Pallas TPU flash kernel that ships with JAX, behind `model.attention`.

Why: `einsum` attention keeps float32 scores of every head, (B, H, T, T), and on TPU nothing
fuses them away (`jax.nn.dot_product_attention` has a fused kernel only on GPU), so a long
sequence runs out of HBM in temporaries (1B at 64 x 2,048 tokens needs 74 GB per v5p chip).
The splash kernel (`jax.experimental.pallas.ops.tpu.splash_attention`) walks (block_q, block_kv)
tiles with an online softmax and skips tiles its mask hides, so scores never reach HBM.

What runs where:
- A whole sequence per row (`Mask.aligned`: training, evaluation, a prefill without cache),
  causal or not, with or without segment ids (packed documents; padding is segment 0 and, as
  in `einsum`, attends to itself, so no row is fully masked), length a multiple of 128 (the
  kernel's lane width; blocks of 512, 256 or 128, whichever divides it): the kernel.
- Decoding against a KV cache (`Mask.cached`, not aligned), or a length not a multiple of 128:
  the `fallback` kernel (`kernels.py` passes `einsum_attention`). Decoding is memory-bound
  and its score matrix is (T_new, S), small; a training length off the 128 grid warns once,
  since it is the case the kernel is for.
- A sliding window (`Mask.window`, Mistral): the kernel's `LocalMask` (`kernel_mask`), which
  also skips the tiles outside the window, combined with segment ids like the causal mask.
- A local/global pattern (Gemma's `model.layer_types`): the layers are scanned, so a layer's
  window is a traced value (`Mask.window`, `Mask.local_window` its static local value) and the
  kernel's masks are static; `jax.lax.cond` on `window > 0` runs the local (`LocalMask`) or
  the global (causal) kernel, one of the two per layer. Under `jax.vmap` with the flag batched
  (pipeline stages hold different layers) the cond becomes a select: both kernels run and
  one output is kept, so such a layer costs a local plus a global kernel.
- Soft-capped scores (`softcap` > 0, Gemma 2's `attn_softcap`): the kernel's own
  `attn_logits_soft_cap`, cap * tanh(scores / cap) on the scaled scores as `einsum` does,
  forward and backward (the fallback gets the same cap).
- Attention sinks (`sinks_H`, GPT-OSS's `model.attn_sinks`): the kernel's own `sinks`, one
  logit per query head in every row's softmax denominator, with its gradient (the fallback
  gets the same sinks).
- Not on TPU: the kernel in Pallas interpret mode: exact but slow (tests), warned once.

Grouped-query attention runs natively: the kernel's MHA form takes K kv heads for H query heads
and reads kv head h // (H/K) for query head h, which is our grouping (`q` heads are `(k g)`), so
keys and values are never repeated per query head (that would cost G x their HBM).

Sharding: under active rules the kernel runs in a `shard_map` whose specs come from the same
rules as the activations (batch over data/fsdp, heads and kv heads over tensor); each shard sees
whole sequences of its own heads. Under `jax.vmap(..., spmd_axis_name=...)` (pipeline stages,
per-replica gradient accumulation) shard_map's batching rule adds that axis.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import PartitionSpec as P

from jaxscale.errors import paragraph
from jaxscale.models.attention.mask import Mask
from jaxscale.rules import AxisRules, active_rules

Kernel = Callable[..., jax.Array]  # (q_BTHD, k_BSKD, v_BSKD, mask, softmax_dtype, softcap) -> out
Run = Callable[..., jax.Array]     # (q_BTHD, k_BSKD, v_BSKD, segments_BT, sinks_H) -> out_BTHD

LANES = 128                    # the kernel's kv block must be a multiple of this
BLOCKS = (512, 256, 128)       # tile sizes tried, largest first (MaxText's default is 512)
_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


warn_once = _warn_once  # for the splash blocks across sequence shards (sequence/context_splash.py)


def block_size(length: int) -> int | None:
    """The largest tile that divides `length`, or None (the kernel cannot run)."""
    return next((b for b in BLOCKS if length % b == 0), None)


def attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, mask: Mask | None,
              softmax_dtype: Any, *, fallback: Kernel, softcap: float = 0.0,
              sinks_H: jax.Array | None = None) -> jax.Array:
    """Attention by the splash kernel where it applies, `fallback` (einsum) elsewhere; scores
    soft-capped at `softcap` when > 0 (both ways).

    `softmax_dtype` is not consulted by the kernel: it always keeps its running max, sum and
    output accumulator in float32, as precise as any precision policy asks."""
    t, s = q_BTHD.shape[1], k_BSKD.shape[1]
    if mask is None:  # every key visible (ViT): a full mask over one sequence
        mask = Mask(jnp.zeros((1, t), jnp.int32), jnp.zeros((1, s), jnp.int32),
                    causal=False, aligned=t == s)
    if not mask.aligned:
        return fallback(q_BTHD, k_BSKD, v_BSKD, mask, softmax_dtype, softcap, sinks_H)
    block = block_size(t)
    if block is None:
        _warn_once(f"length{t}", paragraph(
            f"model.attention=splash: sequence length {t} is not a multiple of {LANES} (the",
            "splash kernel's lane width), so attention falls back to einsum and materialises",
            f"the scores. Use a data.seq_len that is a multiple of {LANES} to get the kernel.",
        ))
        return fallback(q_BTHD, k_BSKD, v_BSKD, mask, softmax_dtype, softcap, sinks_H)
    active = active_rules()
    platform = (active[1].devices.flat[0].platform if active is not None
                else jax.default_backend())
    interpret = platform != "tpu"
    if interpret:
        _warn_once(f"interpret:{platform}", paragraph(
            f"model.attention=splash on {platform}: the splash kernel is a TPU (Mosaic) kernel,",
            "so here it runs in Pallas interpret mode, exact but slow (meant for tests). Use",
            "model.attention=einsum, or dot_product_attention on GPU, outside TPUs.",
        ))
    args = (q_BTHD, k_BSKD, v_BSKD, mask.q_segments_BT, sinks_H)
    call = lambda window: lambda *a: _placed(
        _kernel_call(block, mask.causal, interpret, window, softcap), active, *a)
    if isinstance(mask.window, jax.Array):  # a local/global pattern: this layer's flag picks
        return jax.lax.cond(mask.window > 0, call(mask.local_window), call(0), *args)
    return call(mask.window)(*args)


def _placed(run: Run, active: tuple[AxisRules, jax.sharding.Mesh] | None, q_BTHD: jax.Array,
            k_BSKD: jax.Array, v_BSKD: jax.Array, segments_BT: jax.Array | None,
            sinks_H: jax.Array | None) -> jax.Array:
    """`run` on one device, or sharded over the active mesh (`_sharded`)."""
    if active is None:
        return run(q_BTHD, k_BSKD, v_BSKD, segments_BT, sinks_H)
    return _sharded(run, active[0], active[1], q_BTHD, k_BSKD, v_BSKD, segments_BT, sinks_H)


def kernel_mask(shape: tuple[int, int], causal: bool, window: int = 0) -> mask_lib.Mask:
    """One head's structured splash mask: causal, full, or (sliding window, `Mask.window`) the
    local mask of the `window` latest keys, a query's own included (i - window < j <= i),
    whose tiles wholly outside the band the kernel skips."""
    if causal and window:
        return mask_lib.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    return mask_lib.CausalMask(shape) if causal else mask_lib.FullMask(shape)


def _kernel_call(block: int, causal: bool, interpret: bool, window: int = 0,
                 softcap: float = 0.0) -> Run:
    """(q_BTHD, k_BSKD, v_BSKD, segments_BT | None, sinks_H | None) -> out_BTHD on one
    device's shard; the kernel soft-caps the (already scaled) scores at `softcap` when > 0 and
    adds the sinks (compared with the scaled scores) to each softmax denominator."""

    def run(q_BTHD, k_BSKD, v_BSKD, segments_BT, sinks_H):
        (_, t, h, d), s = q_BTHD.shape, k_BSKD.shape[1]
        one = kernel_mask((t, s), causal, window)
        blocks = kernel_lib.BlockSizes(
            block_q=block, block_kv=block, block_kv_compute=block,
            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
            block_q_dq=block, block_kv_dq=block)
        kernel = kernel_lib.make_splash_mha(
            mask_lib.MultiHeadMask([one] * h), block_sizes=blocks, head_shards=1,
            q_seq_shards=1, interpret=interpret, attn_logits_soft_cap=softcap or None)
        # The kernel takes one example, heads first, and queries already scaled.
        q_BHTD = (q_BTHD * (1.0 / math.sqrt(d))).astype(q_BTHD.dtype).swapaxes(1, 2)
        k_BKSD, v_BKSD = k_BSKD.swapaxes(1, 2), v_BSKD.swapaxes(1, 2)
        sinks = None if sinks_H is None else sinks_H.astype(jnp.float32)
        if segments_BT is None:
            one_row = lambda q, k, v: kernel(q, k, v, None, sinks)
            out_BHTD = jax.vmap(one_row)(q_BHTD, k_BKSD, v_BKSD)
        else:
            one_row = lambda q, k, v, seg: kernel(q, k, v, kernel_lib.SegmentIds(seg, seg),
                                                  sinks)
            out_BHTD = jax.vmap(one_row)(q_BHTD, k_BKSD, v_BKSD, segments_BT)
        return out_BHTD.swapaxes(1, 2)

    return run


def _sharded(run: Run, rules: AxisRules, mesh: jax.sharding.Mesh, q_BTHD: jax.Array,
             k_BSKD: jax.Array, v_BSKD: jax.Array, segments_BT: jax.Array | None,
             sinks_H: jax.Array | None = None) -> jax.Array:
    """`run` in a shard_map over the active mesh, specs from the rules: every shard holds whole
    sequences (length and head_dim are never split here) of its own query and kv heads."""
    spec = lambda logical, x: rules.activation_spec(logical, x.shape, mesh, "<splash>")
    batch, _, heads, _ = spec(("batch", "length", "heads", "head_dim"), q_BTHD)
    kv_batch, _, kv, _ = spec(("batch", "length", "kv", "head_dim"), k_BSKD)
    if heads != kv:  # e.g. 8 kv heads replicated over tensor=16: keep groups whole
        heads = kv = None
    if batch != kv_batch:
        batch = None
    q_spec, kv_spec, seg_spec = P(batch, None, heads, None), P(batch, None, kv, None), P(batch)
    # Absent inputs (no segments, no sinks) stay out of the shard_map: None has no spec.
    given = {name: (x, spec) for name, x, spec in (
        ("q", q_BTHD, q_spec), ("k", k_BSKD, kv_spec), ("v", v_BSKD, kv_spec),
        ("segments", segments_BT, seg_spec), ("sinks", sinks_H, P(heads))) if x is not None}
    body = lambda a: run(a["q"], a["k"], a["v"], a.get("segments"), a.get("sinks"))
    return jax.shard_map(body, mesh=mesh, in_specs=({n: sp for n, (_, sp) in given.items()},),
                         out_specs=q_spec, check_vma=False)({n: x for n, (x, _) in given.items()})
