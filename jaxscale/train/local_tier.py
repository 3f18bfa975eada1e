"""The local checkpoint tier: frequent saves to a fast per-host disk, beside the persistent ones.

Why: a save to a bucket every few steps costs throughput, and saving rarely costs hours of
steps when a pre-emptible host vanishes. `checkpoint.local_dir` (a local SSD or RAM disk; may
contain `{process}`, replaced by the process index, so that processes sharing a machine keep
apart) receives a save every `checkpoint.local_every` steps (or `local_every_minutes`); the
workdir keeps the persistent saves of `checkpoint.every`.

Why not orbax's emergency `CheckpointManager`: with one slice (every CPU run, one TPU slice, one
GPU cluster without DCN slices) it discards the local directory and keeps only the persistent
manager, and it saves one state tree, without the data iterator's position. So each process
runs its own orbax `CheckpointManager`, configured as the emergency manager's local one is
(no primary host: the process writes every shard it holds and its own metadata, with barriers
among itself only), and the processes agree at start on the newest step complete on every one
of them (`agreed_steps`: an all-gather of each process's step list). Orbax writes a step into a
temporary directory and renames it when complete, so a step cut short by a kill is never
listed, hence never chosen; `local_keep` old steps are kept, older ones deleted by orbax.

A host whose tier is empty (replaced), or lacks the newest step, gets that step from the peers
that hold it where the layout allows (`local_peers`: the state replicated along a mesh axis
with a whole replica on those peers); otherwise the run takes an older step or the persistent
tier, as it does when a local restore fails on any process (another mesh: the shards a process
holds are not the ones it needs), agreed by all processes so that they restore the same step.

Its directory is checked before anything there is read or deleted (`train.local_dir`): apart
from the workdir, writable, used by no other process of this run, and owned by this run's
workdir, so that a run never restores another run's local steps as its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers

from jaxscale.storage import orbax_paths
from jaxscale.train.local_dir import local_directory, prepare_directory
from jaxscale.train.local_faults import (
    LocalTierFailed,
    QuietTier,
    SaveOutcomes,
    all_agree,
    all_gather,
    broadcast_json,
)
from jaxscale.train.state import TrainState

MAX_AGREED = 64  # the newest steps each process offers to the agreement (a fixed-size gather)


class LayoutChanged(Exception):
    """The local step holds other shards than this process needs (see `layout_key`)."""


def layout_key(leaves: list[Any]) -> str:
    """Which pieces of which arrays this process holds: per array, the set of index ranges of
    its addressable shards, and the process count, hashed. A local tier holds only what its
    process wrote, and tensorstore reads a chunk nobody wrote as the fill value (zeros), not
    an error, so a restore onto another mesh or process count would silently load zeros where
    another host's shards were; comparing this key refuses it instead."""
    parts: list[Any] = [jax.process_count()]
    for x in leaves:
        index = x.sharding.addressable_devices_indices_map(x.shape)
        parts.append(sorted({json.dumps([list(sl.indices(n)[:2]) for sl, n in zip(i, x.shape)])
                             for i in index.values()}))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


class LocalTier:
    """This process's orbax manager of the local tier (see the module docstring)."""

    def __init__(self, template: str, every: int, keep: int, workdir: str = ""):
        self.every = every
        self.directory = local_directory(template)
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(QuietTier(self.directory))
        pid = jax.process_index()
        multiprocessing = ocp.options.MultiprocessingOptions(
            primary_host=None, active_processes={pid}, barrier_sync_key_prefix=f"local-{pid}")
        registry = type_handlers.create_type_handler_registry(
            (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None,
                                                   use_replica_parallel=False)))
        state = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True,
                                            multiprocessing_options=multiprocessing,
                                            type_handler_registry=registry)
        data = ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=False, enable_async_checkpointing=True,
            multiprocessing_options=multiprocessing, save_root_metadata=False,
            enable_per_process_directory_creation=True, enable_background_delete=False,
            # a step directory that cannot be made fails save() itself, not a background
            # thread whose array writes would wait for it for orbax's 300 s timeout
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
        prepare_directory(self.directory, workdir)  # before anything is read or deleted
        orbax_paths.remove_left_unfinished(self.directory)  # this process's own directory
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_handlers={"state": state, "data": data})

    def steps(self) -> list[int]:
        """The complete steps in this process's tier (orbax lists no half-written one)."""
        return sorted(self.manager.all_steps())

    def held_steps(self) -> dict[int, set[int]]:
        """Each step complete on some process's local tier, with the processes that hold it
        (the same on every process: each takes part in the same restores, in the same
        order)."""
        mine = np.full(MAX_AGREED, -1, np.int64)
        try:
            newest = self.steps()[-MAX_AGREED:]
        except Exception:  # an unreadable tier offers no step (the others' still restore)
            newest = []
        mine[:len(newest)] = newest
        held: dict[int, set[int]] = {}
        for process, row in enumerate(all_gather(mine)):
            for step in row[row >= 0]:
                held.setdefault(int(step), set()).add(process)
        return held

    def save(self, step: int, state: TrainState, data_state: dict | None) -> None:
        """Starts saving `step` (the whole state, with this process's data position); its
        commit continues in the background."""
        from jaxscale.train.checkpoint import _to_saveable
        tree = _to_saveable(state)
        meta = {"position": data_state or {}, "layout": layout_key(jax.tree.leaves(tree))}
        self.manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(tree), data=ocp.args.JsonSave(meta)))

    def restore(self, step: int, state: TrainState, shardings: TrainState,
                onto: TrainState | None = None) -> tuple[TrainState, dict | None]:
        """`step` from this process's tier onto the run's shardings (or `onto`: one replica's,
        `local_peers`); raises if this process's files do not hold what it needs (the caller
        agrees with the others on falling back)."""
        from jaxscale.train.checkpoint import _target
        target = _target(state, shardings, adapters_only=False)
        meta = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
        if (meta["data"] or {}).get("layout") != layout_key(jax.tree.leaves(target)):
            raise LayoutChanged(step)
        if onto is not None:
            target = _target(state, onto, adapters_only=False)
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        got = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
            data=ocp.args.JsonRestore()))
        s = got["state"]
        new = state.replace(step=s["step"], params=s["params"], frozen=s["frozen"],
                            opt_state=s["opt_state"], rng=jax.random.wrap_key_data(s["rng"]),
                            extra=s["extra"])
        return new, dict((got["data"] or {}).get("position") or {}) or None

    def drop_after(self, step: int) -> None:
        """Deletes this process's local steps newer than `step`, the step the run resumed from
        (0: a fresh start): they are of another trajectory (a run before a persistent
        fallback, or an older run in the same directory) and this run will save those step
        numbers again."""
        stale = [s for s in self.steps() if s > step]
        for s in stale:
            self.manager.delete(s)
        if stale:
            self.manager.reload()

    def finish(self) -> None:
        """Waits until the last local save is committed (raises if it failed), then closes."""
        try:
            self.manager.wait_until_finished()
        finally:
            self.manager.close()

    def discard_partial(self) -> None:
        """Removes what failed saves left (orbax's temporary step directories: never listed,
        never restored), so that a full disk gets its space back; no save is in flight."""
        orbax_paths.remove_unfinished(self.directory)


Restored = tuple[int, TrainState, "dict | None", str]  # step, state, data position, note


def restore_newest(tier: LocalTier, persistent_step: int | None, state: TrainState,
                   shardings: TrainState) -> tuple[Restored | None, str]:
    """((step, state, data state, note), "") from the newest local step at least as new as the
    persistent tier's that restores on every process: from each process's own tier where all
    hold it, else from the peers that hold it where the layout allows (`local_peers`; the note
    says which processes got their shards from peers), a damaged newest step giving way to the
    one before it; else (None, why not), and the persistent tier is restored."""
    held, n = tier.held_steps(), jax.process_count()
    if not held:
        return None, ("has no step complete on every process" if n > 1 else "has no step")
    failed: list[str] = []
    missing: list[str] = []
    for step in sorted(held, reverse=True):
        if persistent_step is not None and step < persistent_step:
            break
        if len(held[step]) < n:
            restored, why = _from_peers(tier, step, held[step], state, shardings)
            if restored is not None:
                return restored, ""
            missing.append(f"step {step} is on process {_names(held[step])} only and {why}")
            continue
        try:
            got: Any = tier.restore(step, state, shardings)
        except Exception:  # any failure here means: try an older step, then the persistent tier
            got = None
        if all_agree(got is not None):
            return (step, *got, ""), ""
        failed.append(str(step))
    if not failed and not missing:
        return None, f"has only the older step {max(held)}"
    if not failed:
        return None, "; ".join(missing)
    return None, "; ".join([f"could not restore step {', '.join(failed)} on every process "
                            "(damaged, or saved with another mesh or process count: each host "
                            "holds only its own shards)", *missing])


def _names(processes: set[int]) -> str:
    return ", ".join(str(p) for p in sorted(processes))


def _from_peers(tier: LocalTier, step: int, holders: set[int], state: TrainState,
                shardings: TrainState) -> tuple[Restored | None, str]:
    """`step`, which only `holders` hold: one replica of the state read by the processes that
    hold it and broadcast to all (`local_peers`), with the first reader's data position."""
    from jaxscale.train import local_peers

    plan, why = local_peers.replica_plan(jax.tree.leaves(shardings), holders)
    if plan is None:
        return None, why
    axis, rid = plan
    sources = local_peers.source_processes(jax.tree.leaves(shardings)[0].mesh, axis, rid)
    is_source = jax.process_index() in sources
    got: Any = None
    if is_source:
        try:
            got = local_peers.read_source(tier, step, state, shardings, axis, rid)
        except Exception:  # damaged or another layout: the others are told below
            got = None
    if not all_agree(got is not None or not is_source):
        return None, "could not be read there (damaged, or saved with another mesh)"
    restored, position = got if got is not None else (None, None)
    new = local_peers.broadcast_state(restored, state, shardings, axis, rid, is_source)
    position = broadcast_json(position, min(sources))
    others = set(range(jax.process_count())) - holders
    return (step, new, position or None,
            f"process {_names(others)} got its shards from its peers' local tiers"), ""


class LocalTierHook:
    """Saves to the local tier on its `Interval` (after finiteness is checked, like the
    persistent saves: a NaN state never replaces a good step), and waits for the last local
    commit at the end or a pre-emption (where the persistent tier saves the stopping step).
    A save that fails on any process is agreed on by all, warned about once, and training
    goes on; `FAILURES_IN_A_ROW` failures in a row stop every process (`local_faults`)."""

    def __init__(self, tier: LocalTier, interval: Any, skip_nonfinite: bool,
                 events: Any = None, persistent_every: int = 0):
        from jaxscale.train.hooks import ORDER
        self.order = ORDER["checkpoint"]
        self.tier, self.interval = tier, interval
        self.skip_nonfinite, self.events = skip_nonfinite, events
        self.outcomes = SaveOutcomes(tier.directory, persistent_every, events)
        self.saved = 0  # the step of the last save started (its commit may be in flight)

    def after_step(self, info: Any) -> None:
        if self.interval.due(info.step):
            from jaxscale.train.hooks import check_finite
            check_finite(info.state, self.skip_nonfinite)
            began, step, error = time.monotonic(), self.saved, None
            try:
                self.tier.manager.wait_until_finished()  # the previous save's commit
                step = info.step
                self.tier.save(step, info.state, info.data_state)
            except Exception as e:
                error = e
                self.tier.discard_partial()
            self.saved = info.step
            try:
                ok = self.outcomes.agree(step, error)
            except LocalTierFailed:  # every process stops: let the healthy tiers commit
                with contextlib.suppress(Exception):
                    self.tier.finish()
                raise
            if ok and self.events is not None:
                self.events.timed("save", time.monotonic() - began, step=info.step,
                                  tier="local")

    def _finish(self) -> None:
        """Waits for the last local commit; a failure is agreed on and warned about, never
        fatal here (the run has finished or is stopping, the persistent tier saves it)."""
        error = None
        try:
            self.tier.finish()
        except Exception as e:
            error = e
        self.outcomes.agree(self.saved, error, final=True)

    def at_end(self, info: Any) -> None:
        self._finish()

    def at_preemption(self, info: Any) -> bool:
        self._finish()
        return False
