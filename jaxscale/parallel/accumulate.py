"""Gradient accumulation whose cross-replica reduction happens once per step, not per microbatch.

The same holds for the pipeline's microbatch loop (`grad_accum` = 1 with a pipeline runner).

A plain `lax.scan` over microbatches accumulates into a carry that the SPMD partitioner keeps
replicated over `data`, so every microbatch's gradient is all-reduced inside the loop
(`grad_accum` all-reduces per step). Here each `data` replica's rows are a separate vmapped
"shard" (`spmd_axis_name='data'`): its gradient lives in slot d of a carry (data, ...) sharded
over `data`, so accumulation is local, and one sum over that dimension after the loop is the
step's single all-reduce. Within a replica `fsdp` still reduce-scatters each microbatch's
gradient, as ZeRO-3 does: an unreduced accumulator would cost a full copy of the gradients.
(The vocabulary matrices' bf16 reduce-scatters reach the float32 carry through a barrier that
keeps libtpu from trying to move them out of the loop, where it fails: `shard_sums.settle`.)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale.rules import AxisRules, active_rules, as_tuple, use_rules

# microbatch -> ((mean loss, extra metrics {name: scalar}), grads), as
# `jax.value_and_grad(..., has_aux=True)` returns them.
GradFn = Callable[[dict[str, jax.Array]], tuple[tuple[jax.Array, dict[str, jax.Array]], Any]]


# Logical names of batch rows: `batch`, and `expert_batch`, the rows of the MoE capacity
# buffers while their experts compute (models/moe/layer.py). A rule putting these on `data` keeps it
# a pure replica axis.
BATCH_NAMES = ("batch", "expert_batch")


def _replica_rules(rules: AxisRules) -> AxisRules:
    """The rules inside one replica: `data` is the vmapped dimension, not a batch axis."""
    return rules.without("data")


def _fallback_reason(batch: dict[str, jax.Array], grad_accum: int, row_multiple: int
                     ) -> str | None:
    """Why the per-replica scheme cannot run here (None: it can).

    It needs `data` > 1 sharding nothing but the batch, and whole rows for every replica.
    "" means there is nothing to warn about (no rules, or no `data` axis to reduce over).
    """
    active = active_rules()
    if active is None:
        return ""
    rules, mesh = active
    replicas = mesh.shape.get("data", 1)
    if replicas == 1:
        return ""
    used = [name for name, axes in rules.rules
            if name not in BATCH_NAMES and "data" in as_tuple(axes)]
    if used:
        return f"the rules shard {used} over `data`, so it is not a pure replica axis"
    rows = {x.shape[0] for x in jax.tree.leaves(batch)}
    need = replicas * grad_accum * row_multiple
    if len(rows) != 1 or rows.pop() % need:
        return (f"the batch rows are not a multiple of data({replicas}) x grad_accum"
                f"({grad_accum}) x pipeline microbatches({row_multiple}) = {need}")
    return None


def accumulate_per_replica(grad_fn: GradFn, params: Any, batch: dict[str, jax.Array],
                           grad_accum: int, row_multiple: int = 1
                           ) -> tuple[jax.Array, Any, dict[str, jax.Array]] | None:
    """Mean (loss, grads, metrics) over `grad_accum` microbatches with one all-reduce over
    `data` (the metrics: the mean over microbatches and replicas).

    `grad_fn(microbatch) -> ((mean loss, metrics), grads)`. Returns None where the scheme does not apply
    (no `data` axis, `data` used by a parameter rule, or a replica's microbatch would not hold a
    multiple of `row_multiple` rows, e.g. the pipeline's microbatches), so the caller keeps its
    plain scan. Replica d's microbatch a holds rows d*n*A + i*A + a (i < n), so each device
    keeps its own rows.
    """
    reason = _fallback_reason(batch, grad_accum, row_multiple)
    if reason is not None:
        if reason:  # traced once per compile, so this warns once per step function
            warnings.warn(
                f"Gradient accumulation falls back to a plain microbatch scan because {reason};"
                " its gradients are reduced across `data` once per microbatch instead of once "
                "per step (same result, more communication).", stacklevel=2)
        return None
    rules, mesh = active_rules()
    replicas = mesh.shape["data"]
    inner = _replica_rules(rules)

    def split(x: jax.Array) -> jax.Array:  # (B, ...) -> (A, data, n, ...)
        n = x.shape[0] // (replicas * grad_accum)
        return jnp.moveaxis(x.reshape(replicas, n, grad_accum, *x.shape[1:]), 2, 0)

    def replica_grads(mb: dict[str, jax.Array]) -> tuple[tuple[jax.Array, Any], Any]:
        with use_rules(inner, mesh):
            return grad_fn(mb)

    per_replica = jax.vmap(replica_grads, spmd_axis_name="data")
    on_data = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(
        "data", *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))))

    def body(carry, mb):
        (loss_D, metrics_D), grads_D = per_replica(mb)
        return jax.tree.map(lambda c, g: on_data(c + g), carry, (loss_D, grads_D)), metrics_D

    zeros = (jnp.zeros((replicas,), jnp.float32),
             jax.tree.map(lambda p: jnp.zeros((replicas,) + p.shape, p.dtype), params))
    (loss_D, grads_D), metrics_AD = jax.lax.scan(body, jax.tree.map(on_data, zeros),
                                                 jax.tree.map(split, batch))
    total = replicas * grad_accum
    return (jnp.sum(loss_D) / total, jax.tree.map(lambda g: jnp.sum(g, axis=0) / total, grads_D),
            jax.tree.map(jnp.mean, metrics_AD))
