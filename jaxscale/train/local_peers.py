"""A replaced host's shards from its peers' local tiers (issue 44: "a replaced host (empty local
dir) gets its shards from peers that hold them, where the layout allows").

Why it works: a local tier holds what its process's devices held. Where the run's state is
replicated along a mesh axis (the replica axis: `data` in a data-parallel run) and one whole
replica (the devices at one index of that axis) sits on processes that still hold the step,
those processes read that replica from their tiers and orbax's multi-slice broadcast
(`broadcast_one_replica_to_all`, what orbax's emergency `CheckpointManager` restores a lost
slice with: the source replica's devices hold the data, every other device zeros, and a jitted
sum over the replica axis gives every device its shards over the run's own collectives) puts
it onto every device. The data position, a small JSON that is the same on every process at one
step (the persistent tier restores process 0's onto all), is broadcast from the first source.

Where the layout does not allow it (a leaf sharded over every axis that spans processes, e.g.
fsdp across hosts: the replaced host's shards were on no other host), `replica_plan` says why
and the run takes an older step or the persistent tier.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.train.state import TrainState


def _axes_used(spec: PartitionSpec) -> set[str]:
    """The mesh axes a partition spec shards over (entries may be tuples of axes)."""
    used: set[str] = set()
    for entry in spec:
        if entry is None:
            continue
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return used


def replica_plan(shardings: list[Any], holders: set[int]) -> tuple[tuple[int, int] | None, str]:
    """((replica axis index, replica id), "") of a replica that lies wholly on `holders` along a
    mesh axis that no leaf is sharded over; else (None, why not)."""
    if not all(isinstance(s, NamedSharding) for s in shardings):
        return None, "the state is not laid out by named shardings"
    mesh: Mesh = shardings[0].mesh
    if any(s.mesh != mesh for s in shardings):
        return None, "the state spans several meshes"
    used = set().union(*(_axes_used(s.spec) for s in shardings))
    for axis, name in enumerate(mesh.axis_names):
        if name in used or mesh.devices.shape[axis] < 2:
            continue
        for rid in range(mesh.devices.shape[axis]):
            devices = np.take(mesh.devices, rid, axis=axis).flatten()
            if {d.process_index for d in devices} <= holders:
                return (axis, rid), ""
    return None, ("no other host holds a replaced host's shards (the state is replicated "
                  "along no mesh axis with a whole replica on the hosts that kept the step)")


def _single_replica(sharding: NamedSharding, axis: int, rid: int) -> NamedSharding:
    """`sharding` on the devices of replica `rid` only (the replica axis dropped)."""
    mesh = sharding.mesh
    names = tuple(n for i, n in enumerate(mesh.axis_names) if i != axis)
    sub = Mesh(np.take(mesh.devices, rid, axis=axis), names)
    return NamedSharding(sub, sharding.spec)


def source_processes(mesh: Mesh, axis: int, rid: int) -> set[int]:
    """The processes whose devices form replica `rid`: they read the step from their tiers."""
    return {d.process_index for d in np.take(mesh.devices, rid, axis=axis).flatten()}


def read_source(tier: Any, step: int, state: TrainState, shardings: TrainState,
                axis: int, rid: int) -> tuple[TrainState, dict | None]:
    """On a source process: `step` from its own tier onto the single replica's shardings (the
    layout check is the whole mesh's, as saved)."""
    onto = jax.tree.map(lambda s: _single_replica(s, axis, rid), shardings)
    return tier.restore(step, state, shardings, onto=onto)


def broadcast_state(restored: TrainState | None, state: TrainState, shardings: TrainState,
                    axis: int, rid: int, is_source: bool) -> TrainState:
    """Every process: the source replica's `restored` state (None elsewhere) on every device,
    with the run's shardings."""
    from orbax.checkpoint._src.multihost import multislice

    from jaxscale.train.checkpoint import _target

    target = _target(state, shardings, adapters_only=False)
    single = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=_single_replica(a.sharding, axis, rid)), target)
    if is_source:
        from jaxscale.train.checkpoint import _to_saveable
        single = _to_saveable(restored)
    leaves, treedef = jax.tree.flatten(single)
    mesh = jax.tree.leaves(shardings)[0].mesh
    out, _ = multislice.broadcast_one_replica_to_all(tuple(leaves), mesh, axis, is_source)
    s = jax.tree.unflatten(treedef, list(out))
    return state.replace(step=s["step"], params=s["params"], frozen=s["frozen"],
                         opt_state=s["opt_state"], rng=jax.random.wrap_key_data(s["rng"]),
                         extra=s["extra"])
