"""The vocabulary-sized weights' gradients summed across batch shards in the compute dtype.

A layer's projection runs in the compute dtype (bfloat16 under `bf16-mixed`), so its weight
gradient leaves the matmul in bfloat16 and crosses the batch axes (`data`, `fsdp`) at 2 bytes a
value: reduce-scattered over `fsdp`, then only the shard all-reduced over `data`. The embedding
lookup and the LM head run on the float32 weights (the head in the `logits` dtype), so their
gradients would cross in float32: twice the minimum bytes, for the two largest matrices of a
small model (bench/RESULTS.md, "Gradient reduction over `data`"). Here each batch shard sums its
own part of the gradient locally in float32, and only the shards' sum across devices runs in the
compute dtype, which is the precision the layers' gradients already cross in.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.rules import active_rules, as_tuple, constrain, shard_counts


def batch_shards(batch: int) -> int:
    """How many shards the active rules split a batch of `batch` rows into (1: no rules)."""
    return shard_counts((batch,), "batch")[0]


Axes = tuple[str | None, ...]


def sum_shards(g_SX: jax.Array, dtype: Any, copy: Axes, weight: Axes) -> jax.Array:
    """The sum over the leading (batch-sharded) axis of per-shard gradients laid out as `copy`,
    carried across devices in `dtype`, returned in `g_SX`'s dtype laid out as `weight`.

    Where it can (`_scatter_plan`) the sum is written out per mesh axis, as the layers' matmuls
    get it from the partitioner: reduce-scattered over the batch axes that also shard the
    weight (`fsdp`), then only the shard all-reduced over the others (`data`). Left to itself
    the partitioner all-reduces the whole matrix over every batch device, then slices it."""
    out = g_SX.dtype
    g_SX = constrain(g_SX, "batch", *copy).astype(dtype)
    plan = _scatter_plan(g_SX.shape, copy, weight)
    if plan is None:
        total = jax.lax.reduce(g_SX, np.array(0, dtype), jax.lax.add, (0,))  # no f32 upcast
        return constrain(total.astype(out), *weight)
    mesh, in_spec, out_spec, scatters, rest = plan

    def local(g: jax.Array) -> jax.Array:
        g = g[0]
        for dim, axes in scatters:
            g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
        if scatters and dtype != out:  # see `settle`
            g = settle(g)
        return jax.lax.psum(g, rest) if rest else g

    total = jax.shard_map(local, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                          check_vma=False)(g_SX)
    return constrain(total.astype(out), *weight)


def settle(g: jax.Array) -> jax.Array:
    """`g` unchanged, behind an optimization barrier: a reduce-scatter's result that a loop adds
    to a carry of a wider dtype must not reach the add through a bare `convert`.

    Gradient accumulation sums these gradients into a float32 carry. libtpu's (0.0.52)
    `while-loop-all-reduce-code-motion` pass, which moves such reductions out of a loop, accepts
    the `convert` when it checks a reduce-scatter and then fails on it when it rewrites the loop
    (`RET_CHECK ... user->opcode() == HloOpcode::kAdd`, issue 40). Here that motion is not
    wanted anyway: it would replace the fsdp-sharded accumulator by an unsharded one. The
    values and the arithmetic are unchanged; the barrier only marks where the sum is final."""
    return jax.lax.optimization_barrier(g)


def _scatter_plan(shape: tuple[int, ...], copy: Axes, weight: Axes) -> tuple | None:
    """(mesh, the shards' spec, the weight's spec, [(dim, mesh axes to reduce-scatter it
    over)], the batch mesh axes left to all-reduce), or None where the per-axis form does not
    apply: no active rules, inside a shard_map, or a weight dimension sharded over mesh axes
    other than its copy's plus batch axes appended after them."""
    active = active_rules()
    if active is None or jax.sharding.get_abstract_mesh().manual_axes:
        return None
    rules, mesh = active
    spec = lambda logical, dims: rules.activation_spec(logical, dims, mesh, "<gradient>")
    in_spec = spec(("batch", *copy), shape)
    out_spec = spec(weight, shape[1:])
    batch = as_tuple(in_spec[0])
    scatters, used = [], set()
    for dim, (have, want) in enumerate(zip(in_spec[1:], out_spec)):
        have, want = as_tuple(have), as_tuple(want)
        extra = want[len(have):]
        if want[:len(have)] != have or not set(extra) <= set(batch) - used:
            return None
        if extra:
            scatters.append((dim, extra))
            used.update(extra)
    rest = tuple(a for a in batch if a not in used)
    return mesh, in_spec, out_spec, scatters, rest


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def shard_copies(w: jax.Array, shards: int, dtype: Any, copy: Axes, weight: Axes) -> jax.Array:
    """`w` broadcast to one copy per batch shard, (shards, *w.shape), each copy laid out as
    `copy`; the copies' gradients are summed across shards in `dtype` into the `weight` layout
    (`sum_shards`)."""
    return constrain(jnp.broadcast_to(w, (shards, *w.shape)), "batch", *copy)


def _copies_fwd(w: jax.Array, shards: int, dtype: Any, copy: Axes, weight: Axes
                ) -> tuple[jax.Array, None]:
    return shard_copies(w, shards, dtype, copy, weight), None


def _copies_bwd(shards: int, dtype: Any, copy: Axes, weight: Axes, _: None,
                g: jax.Array) -> tuple[jax.Array]:
    return (sum_shards(g, dtype, copy, weight),)


shard_copies.defvjp(_copies_fwd, _copies_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def take_rows_sum_shards(table_VE: jax.Array, tokens_BT: jax.Array, shards: int, dtype: Any
                         ) -> jax.Array:
    """`jnp.take(table_VE, tokens_BT, axis=0)`, whose table gradient is scatter-added on each
    of the `shards` batch shards locally in the table's dtype and summed across them in
    `dtype`. `shards` must divide the batch."""
    return jnp.take(table_VE, tokens_BT, axis=0)


def _take_fwd(table_VE: jax.Array, tokens_BT: jax.Array, shards: int, dtype: Any
              ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    shape = jax.ShapeDtypeStruct(table_VE.shape, table_VE.dtype)
    return jnp.take(table_VE, tokens_BT, axis=0), (tokens_BT, shape)


def _take_bwd(shards: int, dtype: Any, res: tuple[jax.Array, Any], g_BTE: jax.Array
              ) -> tuple[jax.Array, np.ndarray]:
    tokens_BT, table = res
    B = tokens_BT.shape[0]
    per_shard = lambda x: constrain(x.reshape(shards, B // shards, *x.shape[1:]), "batch",
                                    *(None,) * x.ndim)
    scatter = lambda t_bT, g_bTE: jnp.zeros(table.shape, table.dtype).at[t_bT].add(g_bTE)
    g_SVE = jax.vmap(scatter)(per_shard(tokens_BT), per_shard(g_BTE.astype(table.dtype)))
    g_VE = sum_shards(g_SVE, dtype, ("vocab", None), ("vocab", "embed"))
    return g_VE, np.zeros(tokens_BT.shape, jax.dtypes.float0)


take_rows_sum_shards.defvjp(_take_fwd, _take_bwd)
