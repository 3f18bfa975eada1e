"""Attention across sequence shards (context parallelism), chosen by `model.context_attention`.

Why: with `mesh.context` > 1 the rules put the `length` of activations on the `context` axis
(`presets.py`), so embeddings, norms, MLPs and projections each hold 1/context of every
sequence and need no change. Attention alone needs every key for its queries; left to XLA, the
sharded einsum would gather queries, keys, values and scores alike. Here each shard keeps its
queries and sees the keys in one of two ways (`CONTEXT_ATTENTION`):

- `allgather`: keys and values (with their slots and segment ids) are all-gathered over the
  sequence axes once per layer; one softmax over the whole sequence. Cheap for grouped-query
  models, whose K/V are small next to Q; memory holds the whole sequence's K/V per shard.
- `ring`: K/V blocks rotate around the sequence axes with `ppermute`; each of the `n` steps
  attends the local queries to the block in hand, merged with the online-softmax rule (running
  max, sum and unnormalised output, `_accumulate`), while the next block travels. A shard holds
  two K/V blocks at a time. The backward pass is jax's autodiff through the ring loop (a scan
  whose transposed `ppermute` rotates the other way), which keeps every step's block as a
  residual: K/V memory in the backward is the all-gather's. A custom VJP that re-rotates the
  blocks is a later increment, and so are skipping fully hidden causal blocks and the
  load-balanced (zigzag) order.

Both take the causal mask from global slots (which travel with their keys, so any order of the
sequence over the shards masks correctly), keep packed documents apart by segment ids (which
travel likewise), and run grouped-query attention natively (K kv heads serve H/K query heads).
The specs of the `shard_map` come from the active rules, as in `models/splash.py`: batch over
its axes, length over the sequence axes, query and kv heads over theirs.
Shape suffixes: B batch, T local queries, S keys in hand, K kv heads, G heads per kv head,
D head dim, n sequence shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.mask import Mask
from jaxscale.rules import AxisRules, active_rules, logical_to_mesh_axes

Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv", "head_dim")


class Shards(NamedTuple):
    """The active rules and mesh, and the mesh axes that split the sequence (product > 1)."""

    rules: AxisRules
    mesh: Mesh
    axes: tuple[str, ...]

    @property
    def count(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)


class Acc(NamedTuple):
    """Online-softmax state of the local queries: running max and sum (B, K, G, T) and the
    unnormalised output (B, T, K, G, D), all in the softmax dtype."""

    max_BKGT: jax.Array
    sum_BKGT: jax.Array
    out_BTKGD: jax.Array


def _as_tuple(axes: Any) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def sequence_shards(length: int, impl: str) -> Shards | None:
    """The sequence shards of whole-sequence attention under the active rules, or None when
    nothing splits the sequence (no rules active, or `length`'s mesh axes all of size 1).
    Raises a ConfigError paragraph when the sequence is split but attention cannot follow."""
    active = active_rules()
    if active is None:
        return None
    rules, mesh = active
    wanted = _as_tuple(logical_to_mesh_axes(Q_AXES, rules.rules)[1])
    axes = tuple(a for a in wanted if mesh.shape.get(a, 1) > 1)
    if not axes:
        return None
    shards = Shards(rules, mesh, axes)
    sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in axes)
    if impl != "einsum":
        raise ConfigError(paragraph(
            f"model.attention={impl!r} does not run across sequence shards yet, and the rules",
            f"split the sequence over the mesh axes {sizes} (context parallelism). Use",
            "model.attention=einsum (attention then runs by model.context_attention=allgather",
            "or ring, models/context.py), or set mesh.context=1.",
        ))
    if length % shards.count:
        raise ConfigError(paragraph(
            f"The sequence length {length} is not divisible by the {shards.count} sequence",
            f"shards of the mesh axes {sizes}: each shard must hold an equal slice of every",
            f"sequence. Use a data.seq_len that is a multiple of {shards.count}, or a smaller",
            "mesh.context.",
        ))
    return shards


def attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, mask: Mask,
              softmax_dtype: Any, *, variant: str, shards: Shards) -> jax.Array:
    """Whole-sequence attention (`mask.aligned`) with the sequence split over `shards.axes`,
    by the `variant` in `CONTEXT_ATTENTION`; out (B, T, H, D) sharded like the queries."""
    lenient = AxisRules(shards.rules.rules, strict=False, indivisible="replicate")
    spec = lambda logical, x: lenient.spec(logical, x.shape, shards.mesh, "<context>", warn=False)
    batch, length, heads, _ = spec(Q_AXES, q_BTHD)
    kv_batch, _, kv, _ = spec(KV_AXES, k_BTKD)
    if heads != kv:  # e.g. kv heads replicated over tensor while query heads are split
        heads = kv = None
    if batch != kv_batch:
        batch = None
    q_spec, kv_spec = P(batch, length, heads, None), P(batch, length, kv, None)
    arrays = {"q": q_BTHD, "k": k_BTKD, "v": v_BTKD,
              "slots": jnp.broadcast_to(mask.q_slots_BT, (1, q_BTHD.shape[1]))}
    specs = {"q": q_spec, "k": kv_spec, "v": kv_spec, "slots": P(None, length)}
    if mask.q_segments_BT is not None:  # packed documents: their ids travel with the keys
        arrays["segments"], specs["segments"] = mask.q_segments_BT, P(batch, length)
    body = CONTEXT_ATTENTION[variant]
    run = lambda a: body(a["q"], a["k"], a["v"], a["slots"], a.get("segments"),
                         axes=shards.axes, n=shards.count, causal=mask.causal,
                         window=mask.window, softmax_dtype=softmax_dtype)
    return jax.shard_map(run, mesh=shards.mesh, in_specs=(specs,), out_specs=q_spec,
                         check_vma=False)(arrays)


def _start(q_BTKGD: jax.Array, dtype: Any) -> Acc:
    b, t, k, g, d = q_BTKGD.shape
    return Acc(jnp.full((b, k, g, t), jnp.finfo(dtype).min, dtype),
               jnp.zeros((b, k, g, t), dtype), jnp.zeros((b, t, k, g, d), dtype))


def _accumulate(acc: Acc, q_BTKGD: jax.Array, block: Mapping[str, jax.Array | None],
                mask: Mask) -> Acc:
    """`acc` with the key block `block` (k, v (B, S, K, D)) attended under `mask`: the
    online-softmax (log-sum-exp) merge. The running max is held constant for autodiff (the
    result does not depend on it), so hidden scores never meet inf - inf."""
    dtype = acc.sum_BKGT.dtype
    scores_BKGTS = jnp.einsum("btkgd,bskd->bkgts", q_BTKGD, block["k"]).astype(dtype)
    scores_BKGTS = scores_BKGTS / math.sqrt(q_BTKGD.shape[-1])
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


def _finish(acc: Acc, like: jax.Array) -> jax.Array:
    """The normalised output (B, T, H, D) in `like`'s dtype. Every query sees at least its own
    key (padding is segment 0 and sees itself), so no sum is 0."""
    out_BTKGD = acc.out_BTKGD / rearrange(acc.sum_BKGT, "b k g t -> b t k g 1")
    return rearrange(out_BTKGD, "b t k g d -> b t (k g) d").astype(like.dtype)


def _local(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, slots_1T: jax.Array,
           segments_BT: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array | None]]:
    """The shard's queries grouped by kv head, and its own key block."""
    q_BTKGD = rearrange(q_BTHD, "b t (k g) d -> b t k g d", k=k_BSKD.shape[2])
    return q_BTKGD, {"k": k_BSKD, "v": v_BSKD, "slots": slots_1T, "segments": segments_BT}


def _block_mask(slots_1T: jax.Array, segments_BT: jax.Array | None,
                block: Mapping[str, jax.Array | None], causal: bool, window: int) -> Mask:
    return Mask(slots_1T, block["slots"], segments_BT,
                None if segments_BT is None else block["segments"], causal, window=window)


def allgather_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                        slots_1T: jax.Array, segments_BT: jax.Array | None, *,
                        axes: tuple[str, ...], n: int, causal: bool, window: int,
                        softmax_dtype: Any) -> jax.Array:
    """One shard's attention: the whole sequence's keys gathered once, one softmax."""
    q_BTKGD, block = _local(q_BTHD, k_BSKD, v_BSKD, slots_1T, segments_BT)
    gather = lambda x: None if x is None else jax.lax.all_gather(x, axes, axis=1, tiled=True)
    whole = {name: gather(x) for name, x in block.items()}
    mask = _block_mask(slots_1T, segments_BT, whole, causal, window)
    return _finish(_accumulate(_start(q_BTKGD, softmax_dtype), q_BTKGD, whole, mask), v_BSKD)


def ring_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                   slots_1T: jax.Array, segments_BT: jax.Array | None, *,
                   axes: tuple[str, ...], n: int, causal: bool, window: int,
                   softmax_dtype: Any) -> jax.Array:
    """One shard's attention: `n` steps, each attending to the key block in hand while it
    moves on to the next shard (the last step sends nothing)."""
    q_BTKGD, block = _local(q_BTHD, k_BSKD, v_BSKD, slots_1T, segments_BT)
    ring = [(i, (i + 1) % n) for i in range(n)]
    send = lambda x: None if x is None else jax.lax.ppermute(x, axes, ring)

    def step(carry: tuple[Acc, dict], _: None) -> tuple[tuple[Acc, dict], None]:
        acc, held = carry
        acc = _accumulate(acc, q_BTKGD, held, _block_mask(slots_1T, segments_BT, held, causal, window))
        return (acc, {name: send(x) for name, x in held.items()}), None

    (acc, held), _ = jax.lax.scan(step, (_start(q_BTKGD, softmax_dtype), block), length=n - 1)
    acc = _accumulate(acc, q_BTKGD, held, _block_mask(slots_1T, segments_BT, held, causal, window))
    return _finish(acc, v_BSKD)


# Attention across sequence shards by `model.context_attention`: one shard's body in shard_map.
CONTEXT_ATTENTION: dict[str, Callable[..., jax.Array]] = {
    "allgather": allgather_attention,
    "ring": ring_attention,
}


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """The load-balanced causal order: the sequence cut into 2 x `shards` chunks, shard i holding
    chunk i and chunk 2 x shards - 1 - i, so each holds as many early (cheap) queries as late
    (dear) ones. `order[j]` is the original slot of position j; tokens, positions, segment ids
    and targets permuted by it (and the attention given these slots) leave the loss unchanged.
    The attention here already masks by the slots it is given, in any order; the step that
    permutes the batch (and skips the hidden blocks, the point of the balance) is to come."""
    if length % (2 * shards):
        raise ConfigError(paragraph(
            f"The load-balanced (zigzag) order cuts a sequence into 2 x {shards} chunks, but the",
            f"length {length} is not divisible by {2 * shards}. Use a data.seq_len that is a",
            f"multiple of {2 * shards}, or a smaller mesh.context.",
        ))
    chunks = np.arange(length).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]])
                           for i in range(shards)])


def causal_work(order: np.ndarray, shards: int) -> np.ndarray:
    """Visible (query, key) pairs of a causal mask per shard, the sequence lying in `order`
    over `shards` equal slices: each shard's share of the attention FLOPs once hidden blocks
    are skipped (a query at slot s sees s + 1 keys)."""
    return (np.asarray(order).reshape(shards, -1) + 1).sum(axis=1)


def check_config(mesh_cfg: Mapping[str, Any], model_cfg: Mapping[str, Any],
                 seq_len: int) -> None:
    """`config.validate`'s context checks: a known variant, and, with a known `mesh.context`
    > 1, einsum attention and a sequence length the shards divide."""
    variant = model_cfg.get("context_attention", "allgather")
    if variant not in CONTEXT_ATTENTION:
        raise ConfigError(paragraph(
            f"model.context_attention={variant!r} is not an attention across sequence shards;",
            f"use one of {', '.join(CONTEXT_ATTENTION)} (models/context.py).",
        ))
    size = mesh_cfg.get("context", 1) * mesh_cfg.get("dcn_context", 1)
    if size <= 1:  # 1, or -1 (filled from the device count: checked when attention runs)
        return
    impl = model_cfg.get("attention", "einsum")
    if impl != "einsum":
        raise ConfigError(paragraph(
            f"model.attention={impl!r} does not run across sequence shards yet, and",
            f"mesh.context x mesh.dcn_context = {size} splits the sequence. Use",
            "--config.model.attention=einsum (attention then runs by model.context_attention,",
            "allgather or ring), or set --config.mesh.context=1.",
        ))
    if seq_len % size:
        raise ConfigError(paragraph(
            f"data.seq_len={seq_len} is not divisible by the {size} sequence shards",
            "(mesh.context x mesh.dcn_context): each shard holds an equal slice of every",
            f"sequence. Use a data.seq_len that is a multiple of {size}, or a smaller",
            "mesh.context.",
        ))
