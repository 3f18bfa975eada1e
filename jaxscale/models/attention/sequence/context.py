"""Attention across sequence shards (context parallelism), chosen by `model.context_attention`.

Why: with `mesh.context` > 1 the rules put the `length` of activations on the `context` axis
(`rules.py`'s presets), so embeddings, norms, MLPs and projections each hold 1/context of every
sequence and need no change. Attention alone needs every key for its queries; left to XLA, the
sharded einsum would gather queries, keys, values and scores alike. Here each shard keeps its
queries and sees the keys in one of two ways (`CONTEXT_ATTENTION`):

- `allgather`: keys and values (with their slots and segment ids) are all-gathered over the
  sequence axes once per layer, then attended block by block as the ring attends (tiles,
  hidden ones skipped). Cheap for grouped-query models, whose K/V are small next to Q;
  memory holds the whole sequence's K/V per shard.
- `ring`: K/V blocks rotate around the sequence axes with `ppermute`; each of the `n` steps
  attends the local queries to the block in hand, merged with the online-softmax rule (running
  max, sum and unnormalised output, `attention/blockwise.py`), while the next block travels.
  A shard holds two K/V blocks at a time. Each step attends in tiles (`attention/blockwise.py`:
  at least halves of the local queries and of the block in hand) and skips (`lax.cond`) every
  tile the mask hides entirely (causal, window or segments): exact, since a hidden tile adds
  nothing to the online softmax. The backward pass is jax's autodiff through the ring loop (a scan
  whose transposed `ppermute` rotates the other way), which keeps every step's block as a
  residual (not its scores: each step is rematerialised): K/V memory in the backward is the
  all-gather's.
- `ring_vjp`: the ring with a custom VJP (`ring_vjp.py`): the forward pass keeps only
  the shard's own q, k, v, output and log-sum-exp, and the backward pass rotates the blocks
  again, their dK/dV travelling with them; one sliding window for every layer only.

Load balance (`model.context_order`): with a causal mask and the sequence in its natural order,
shard i's queries see i + 1 of the n blocks, so the last shard does ~2x the average work and
sets the step time. In the zigzag order (`zigzag_order`) shard i holds chunks i and 2n - 1 - i
of 2n, so every shard does the same work once hidden halves are skipped (`causal_work`,
bench/context_balance.py). The LM task lays inputs, targets, positions and segment ids in that
order (the loss is a sum over tokens, so it is unchanged) and declares it with
`sequence_order`, which tells the attention here the slots of its keys; anything else (a
model called without it: evaluation, generation) runs in the natural order.

With `model.attention=splash` every variant attends a block by the Pallas splash kernel
instead of einsum tiles (`context_splash.py`): the declared order cut into chunks of
consecutive slots, each (query chunk, key chunk) pair one kernel call whose static mask (full,
causal, or a window's `LocalMask` at the pair's offset) follows from the chunks' distance, hidden
pairs skipped, merged by log-sum-exp; its custom VJP (splash's backward kernels) makes `ring`
and `ring_vjp` the same ring. A layout off the kernel's 128-lane grid runs the einsum tiles.

All soft-cap the scores when asked (Gemma 2's `attn_softcap`), take the causal mask from
global slots (which travel with their keys, so any order of the
sequence over the shards masks correctly), keep packed documents apart by segment ids (which
travel likewise), and run grouped-query attention natively (K kv heads serve H/K query heads).
The specs of the `shard_map` come from the active rules, as in `attention/splash.py`: batch over
its axes, length over the sequence axes, query and kv heads over theirs.
Shape suffixes: B batch, T local queries, S keys in hand, K kv heads, G heads per kv head,
D head dim, n sequence shards.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.attention import blockwise, splash
from jaxscale.models.attention.mask import Mask
from jaxscale.models.attention.sequence import context_splash
from jaxscale.models.attention.sequence.ring_vjp import ring_vjp_attention
from jaxscale.rules import AxisRules, active_rules, as_tuple, logical_to_mesh_axes

# `model.attention` kernels that run across sequence shards: einsum blocks, or splash kernels
# per block (`context_splash.py`).
SHARDED_IMPLS = ("einsum", "splash")
Q_AXES = ("batch", "length", "heads", "head_dim")
KV_AXES = ("batch", "length", "kv", "head_dim")


class Shards(NamedTuple):
    """The active rules and mesh, and the mesh axes that split the sequence (product > 1)."""

    rules: AxisRules
    mesh: Mesh
    axes: tuple[str, ...]
    impl: str = "einsum"  # `model.attention`: splash runs the blocks by its kernel

    @property
    def count(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)


def _active_shards() -> Shards | None:
    """The active rules' sequence shards, or None when nothing splits the sequence."""
    active = active_rules()
    if active is None:
        return None
    rules, mesh = active
    wanted = as_tuple(logical_to_mesh_axes(Q_AXES, rules.rules)[1])
    axes = tuple(a for a in wanted if mesh.shape.get(a, 1) > 1)
    return Shards(rules, mesh, axes) if axes else None


def sequence_shards(length: int, impl: str) -> Shards | None:
    """The sequence shards of whole-sequence attention under the active rules, or None when
    nothing splits the sequence (no rules active, or `length`'s mesh axes all of size 1).
    Raises a ConfigError paragraph when the sequence is split but attention cannot follow."""
    shards = _active_shards()
    if shards is None:
        return None
    axes, mesh = shards.axes, shards.mesh
    sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in axes)
    if impl not in SHARDED_IMPLS:
        raise ConfigError(paragraph(
            f"model.attention={impl!r} does not run across sequence shards yet, and the rules",
            f"split the sequence over the mesh axes {sizes} (context parallelism). Use",
            "model.attention=einsum or splash (attention then runs by",
            "model.context_attention=allgather or ring, context.py), or set",
            "mesh.context=1.",
        ))
    if length % shards.count:
        raise ConfigError(paragraph(
            f"The sequence length {length} is not divisible by the {shards.count} sequence",
            f"shards of the mesh axes {sizes}: each shard must hold an equal slice of every",
            f"sequence. Use a data.seq_len that is a multiple of {shards.count}, or a smaller",
            "mesh.context.",
        ))
    return shards._replace(impl=impl)


def attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, mask: Mask,
              softmax_dtype: Any, *, variant: str, shards: Shards,
              softcap: float = 0.0, sinks_H: jax.Array | None = None) -> jax.Array:
    """Whole-sequence attention (`mask.aligned`) with the sequence split over `shards.axes`,
    by the `variant` in `CONTEXT_ATTENTION`; out (B, T, H, D) sharded like the queries. The
    slots are the declared `sequence_order`'s when one is active (the sequence lies permuted),
    else the mask's. Attention sinks (`sinks_H`, split like the query heads) start each
    shard's online softmax (`blockwise.start`, `context_splash`'s merge) in every variant."""
    spec = lambda logical, x: shards.rules.activation_spec(logical, x.shape, shards.mesh,
                                                           "<context>")
    batch, length, heads, _ = spec(Q_AXES, q_BTHD)
    kv_batch, _, kv, _ = spec(KV_AXES, k_BTKD)
    if heads != kv:  # e.g. kv heads replicated over tensor while query heads are split
        heads = kv = None
    if batch != kv_batch:
        batch = None
    q_spec, kv_spec = P(batch, length, heads, None), P(batch, length, kv, None)
    arrays = {"q": q_BTHD, "k": k_BTKD, "v": v_BTKD, "slots": _slots(mask, q_BTHD.shape[1])}
    specs = {"q": q_spec, "k": kv_spec, "v": kv_spec, "slots": P(None, length)}
    if mask.q_segments_BT is not None:  # packed documents: their ids travel with the keys
        arrays["segments"], specs["segments"] = mask.q_segments_BT, P(batch, length)
    if sinks_H is not None:
        arrays["sinks"], specs["sinks"] = sinks_H, P(heads)
    placed = lambda run: jax.shard_map(run, mesh=shards.mesh, in_specs=(specs,),
                                       out_specs=q_spec, check_vma=False)
    plan = _splash_plan(shards, variant, mask, q_BTHD.shape[1], softcap)
    if plan is not None:
        run = lambda window: placed(lambda a: context_splash.attention(
            a["q"], a["k"], a["v"], a["slots"], a.get("segments"), plan=plan(window),
            sinks_H=a.get("sinks")))
        if isinstance(mask.window, jax.Array):  # a local/global pattern: the layer's flag picks
            return jax.lax.cond(mask.window > 0, run(mask.local_window), run(0), arrays)
        return run(mask.window)(arrays)
    body = CONTEXT_ATTENTION[variant]
    run = lambda a: body(a["q"], a["k"], a["v"], a["slots"], a.get("segments"),
                         axes=shards.axes, n=shards.count, causal=mask.causal,
                         window=mask.window, softmax_dtype=softmax_dtype, softcap=softcap,
                         **({"sinks_H": a["sinks"]} if "sinks" in a else {}))
    return placed(run)(arrays)



def _splash_plan(shards: Shards, variant: str, mask: Mask, length: int, softcap: float
                 ) -> Callable[[int], context_splash.Plan] | None:
    """window -> the splash blocks' plan, when `shards.impl` is splash and the declared order
    cuts into chunks on the kernel's grid; else None (the einsum blocks run; warned once)."""
    if shards.impl != "splash":
        return None
    order = _ORDER.get()
    order = np.arange(length) if order is None else order
    layout = context_splash.layout(order, shards.count)
    if layout is None:
        splash.warn_once(f"context{length}/{shards.count}", paragraph(
            f"model.attention=splash across {shards.count} sequence shards: the sequence of",
            f"{length} does not cut into chunks of a multiple of {splash.LANES} slots per shard",
            "(the kernel's grid), so attention runs by the einsum blocks. Use a data.seq_len",
            f"that is a multiple of {2 * shards.count * splash.LANES}.",
        ))
        return None
    interpret = shards.mesh.devices.flat[0].platform != "tpu"
    if interpret:
        splash.warn_once(f"interpret:{shards.mesh.devices.flat[0].platform}", paragraph(
            "model.attention=splash off TPU: the splash kernels of the sequence shards run in",
            "Pallas interpret mode, exact but slow (meant for tests)."))
    return lambda window: context_splash.Plan(
        tuple(shards.axes), shards.count, variant == "allgather", layout, mask.causal,
        int(window), float(softcap), interpret)


def _slots(mask: Mask, length: int) -> jax.Array:
    """The (1, T) global slots of the whole sequence as it lies: the active `sequence_order`,
    else the mask's own (aligned: the queries' slots are the keys')."""
    order = _ORDER.get()
    if order is None:
        return jnp.broadcast_to(mask.q_slots_BT, (1, length))
    if len(order) != length:
        raise ValueError(f"The declared sequence order has {len(order)} slots, but attention "
                         f"runs over {length}: declare the order of the sequence it sees.")
    return jnp.asarray(order, jnp.int32)[None]


def _local(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, slots_1T: jax.Array,
           segments_BT: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array | None]]:
    """The shard's queries grouped by kv head, and its own key block."""
    q_BTKGD = rearrange(q_BTHD, "b t (k g) d -> b t k g d", k=k_BSKD.shape[2])
    return q_BTKGD, {"k": k_BSKD, "v": v_BSKD, "slots": slots_1T, "segments": segments_BT}


def allgather_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                        slots_1T: jax.Array, segments_BT: jax.Array | None, *,
                        axes: tuple[str, ...], n: int, causal: bool, window: int,
                        softmax_dtype: Any, softcap: float = 0.0,
                        sinks_H: jax.Array | None = None) -> jax.Array:
    """One shard's attention: the whole sequence's keys gathered once, then attended block by
    block (the `n` shards' blocks, in a scan, each step as the ring's: hidden halves skipped,
    recomputed in the backward pass), so no (T/n, T) score matrix is ever whole."""
    q_BTKGD, block = _local(q_BTHD, k_BSKD, v_BSKD, slots_1T, segments_BT)
    gather = lambda x: None if x is None else jax.lax.all_gather(x, axes, axis=1, tiled=False)
    blocks = {name: gather(x) for name, x in block.items()}  # (B or 1, n, S, ...)
    blocks = {name: None if x is None else jnp.moveaxis(x, 1, 0) for name, x in blocks.items()}
    attend = blockwise.step_fn(q_BTKGD, slots_1T, segments_BT, causal, window, softcap)

    def step(acc: blockwise.Acc, held: dict) -> tuple[blockwise.Acc, None]:
        return attend(acc, held)[0], None

    acc, _ = jax.lax.scan(step, blockwise.start(q_BTKGD, softmax_dtype, sinks_H),
                          {name: x for name, x in blocks.items() if x is not None})
    return blockwise.finish(acc, v_BSKD)


def ring_work(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, slots_1T: jax.Array,
              segments_BT: jax.Array | None, *, axes: tuple[str, ...], n: int, causal: bool,
              window: Any, softmax_dtype: Any, softcap: float = 0.0,
              sinks_H: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """One shard's ring attention and the score entries it computed (hidden halves skipped):
    `n` steps, each attending to the key block in hand while it moves on to the next shard
    (the last step sends nothing)."""
    q_BTKGD, block = _local(q_BTHD, k_BSKD, v_BSKD, slots_1T, segments_BT)
    ring = [(i, (i + 1) % n) for i in range(n)]
    send = lambda x: None if x is None else jax.lax.ppermute(x, axes, ring)
    attend = blockwise.step_fn(q_BTKGD, slots_1T, segments_BT, causal, window, softcap)

    def step(carry: tuple[blockwise.Acc, dict, jax.Array], _: None) -> tuple[tuple, None]:
        acc, held, work = carry
        acc, done = attend(acc, held)
        return (acc, {name: send(x) for name, x in held.items()}, work + done), None

    start = (blockwise.start(q_BTKGD, softmax_dtype, sinks_H), block, jnp.int32(0))
    (acc, held, work), _ = jax.lax.scan(step, start, length=n - 1)
    acc, done = attend(acc, held)
    return blockwise.finish(acc, v_BSKD), work + done


def ring_attention(*args: Any, **kwargs: Any) -> jax.Array:
    """One shard's ring attention (`ring_work` without the count)."""
    return ring_work(*args, **kwargs)[0]


# Attention across sequence shards by `model.context_attention`: one shard's body in shard_map.
CONTEXT_ATTENTION: dict[str, Callable[..., jax.Array]] = {
    "allgather": allgather_attention,
    "ring": ring_attention,
    "ring_vjp": ring_vjp_attention,  # the backward pass a ring too (ring_vjp.py)
}


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """The load-balanced causal order: the sequence cut into 2 x `shards` chunks, shard i holding
    chunk i and chunk 2 x shards - 1 - i, so each holds as many early (cheap) queries as late
    (dear) ones. `order[j]` is the original slot of position j; tokens, positions, segment ids
    and targets permuted by it (and the attention given these slots) leave the loss unchanged.
    The LM task permutes its batch by it (`training_order`, `sequence_order`)."""
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


# The order the sequence lies in while a model runs (`sequence_order`): None is the natural one.
_ORDER: contextvars.ContextVar[np.ndarray | None] = contextvars.ContextVar(
    "jaxscale_sequence_order", default=None)

# `model.context_order`: auto is zigzag for the rings under a causal mask when 2 x shards divide
# the length (the ring skips what the mask hides, so the balance pays), natural otherwise.
CONTEXT_ORDERS = ("auto", "zigzag", "natural")


@contextlib.contextmanager
def sequence_order(order: np.ndarray | None) -> Iterator[None]:
    """Declare, while tracing a model, that its whole sequences lie permuted by `order`
    (`order[j]` the original slot at position j; None: natural): attention across sequence
    shards then masks by these slots. The caller permutes inputs, positions and segment ids."""
    token = _ORDER.set(None if order is None else np.asarray(order))
    try:
        yield
    finally:
        _ORDER.reset(token)


def training_order(length: int, choice: str, variant: str) -> np.ndarray | None:
    """The order a causal LM lays a training sequence of `length` in under the active rules
    (`model.context_order`, see `CONTEXT_ORDERS`): the zigzag order, or None (natural, also
    whenever nothing splits the sequence)."""
    shards = _active_shards()
    return None if shards is None else _order(length, shards.count, choice, variant)


def _order(length: int, shards: int, choice: str, variant: str) -> np.ndarray | None:
    if choice == "natural":
        return None
    if choice == "auto" and (variant == "allgather" or length % (2 * shards)):
        return None
    return zigzag_order(length, shards)


def splash_blocks_run(length: int, shards: int, choice: str, variant: str) -> bool:
    """Whether `model.attention=splash` over `shards` sequence shards runs the splash kernels
    (the training order cuts into chunks on the kernel's grid) rather than the einsum tiles:
    what the FLOP accounting must know (`aot/flops.py`)."""
    order = _order(length, shards, choice, variant)
    order = np.arange(length) if order is None else order
    return context_splash.layout(order, shards) is not None


def check_config(mesh_cfg: Mapping[str, Any], model_cfg: Mapping[str, Any],
                 seq_len: int) -> None:
    """`config.validate`'s context checks: a known variant, and, with a known `mesh.context`
    > 1, an attention of `SHARDED_IMPLS` and a sequence length the shards divide."""
    variant = model_cfg.get("context_attention", "allgather")
    if variant not in CONTEXT_ATTENTION:
        raise ConfigError(paragraph(
            f"model.context_attention={variant!r} is not an attention across sequence shards;",
            f"use one of {', '.join(CONTEXT_ATTENTION)} (context.py).",
        ))
    order = model_cfg.get("context_order", "auto")
    if order not in CONTEXT_ORDERS:
        raise ConfigError(paragraph(
            f"model.context_order={order!r} is not an order of the sequence over its shards;",
            f"use one of {', '.join(CONTEXT_ORDERS)} (context.py).",
        ))
    size = mesh_cfg.get("context", 1) * mesh_cfg.get("dcn_context", 1)
    if size <= 1:  # 1, or -1 (filled from the device count: checked when attention runs)
        return
    impl = model_cfg.get("attention", "einsum")
    if impl not in SHARDED_IMPLS:
        raise ConfigError(paragraph(
            f"model.attention={impl!r} does not run across sequence shards yet, and",
            f"mesh.context x mesh.dcn_context = {size} splits the sequence. Use",
            "--config.model.attention=einsum or splash (attention then runs by",
            "model.context_attention, allgather or ring), or set --config.mesh.context=1.",
        ))
    if seq_len % size:
        raise ConfigError(paragraph(
            f"data.seq_len={seq_len} is not divisible by the {size} sequence shards",
            "(mesh.context x mesh.dcn_context): each shard holds an equal slice of every",
            f"sequence. Use a data.seq_len that is a multiple of {size}, or a smaller",
            "mesh.context.",
        ))
    if order == "zigzag" and seq_len % (2 * size):
        zigzag_order(seq_len, size)  # its paragraph names the length and the fix
