"""Checkpoints with orbax: async, sharded, multi-host safe; restore onto any mesh; no pickle.

`WORKDIR/checkpoints/<step>/` holds the train state (parameters, frozen parameters, optimizer
state, step, RNG key data, policy state) as orbax arrays and the grain data-iterator state as
JSON. Orbax writes each step into a temporary directory and renames it only when complete, so
an interrupted save is never listed. Restoring uses the *current* run's shardings as the
target, which re-shards a checkpoint saved on another mesh.

LoRA runs with `lora.save_adapters_only` save no frozen base weights, only a fingerprint of
them (`base_fingerprint`): the base is what the run rebuilds anyway (from `config.init_from` or
the seed), so on resume the freshly built base is checked against the fingerprint and the
adapters, optimizer state and step are restored on top of it.

Outages of a bucket (single-process runs): every save, the wait for its background commit and
every restore follow `config.storage.retry_s` (`jaxscale.storage.retry.for_workdir`). A save
whose background commit fails for an outage is noticed at the next save or at the end of the
run; its step directory (no commit file, so never restored) is removed and the save then in
hand is made again once the store answers, so an outage costs one checkpoint interval, not
the run. After the budget, `StoreUnavailable` says how to resume.
"""

from __future__ import annotations

import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxscale.errors import paragraph, short_error
from jaxscale.models.nn.fused import is_legacy
from jaxscale.storage import locations, orbax_paths
from jaxscale.storage.diskfull import disk_full_error, is_disk_full
from jaxscale.storage.retry import Retry, for_workdir, is_outage
from jaxscale.train import persistent_faults
from jaxscale.train.persistent_faults import Writes, recording_handlers
from jaxscale.train.state import TrainState
from jaxscale.weights.legacy import LEGACY_RESUME
from jaxscale.weights.restore import (
    CheckpointError,
    base_fingerprint,
    fingerprints_match,
    newest_restorable,
)
from jaxscale.weights.tree import flatten


def _to_saveable(state: TrainState, adapters_only: bool = False) -> dict:
    """Typed PRNG keys are stored as their raw key data (plain uint32 arrays). Adapters-only:
    the frozen base is replaced by its fingerprint."""
    out = {"step": state.step, "params": state.params, "frozen": state.frozen,
           "opt_state": state.opt_state, "rng": jax.random.key_data(state.rng),
           "extra": state.extra}
    if adapters_only:
        del out["frozen"]
        out["base_fingerprint"] = base_fingerprint(state.frozen)
    return out


def _target(state: TrainState, shardings: TrainState, adapters_only: bool) -> dict:
    """Abstract arrays carrying the current run's shardings: the restore target."""
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, shardings)
    rng = jax.eval_shape(jax.random.key_data, state.rng)
    out = {"step": abstract.step, "params": abstract.params, "frozen": abstract.frozen,
           "opt_state": abstract.opt_state, "extra": abstract.extra,
           "rng": jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=shardings.rng)}
    if adapters_only:
        del out["frozen"]
        fp = jax.eval_shape(base_fingerprint, abstract.frozen)
        out["base_fingerprint"] = jax.ShapeDtypeStruct(fp.shape, fp.dtype,
                                                       sharding=shardings.rng)
    return out


PROCESSES = "jaxscale_processes"  # beside the data position: how many processes saved it


class Checkpointer:
    """Saves every `every` steps (keeping `keep`) and restores the newest complete step."""

    def __init__(self, workdir: str, every: int, keep: int):
        self.every = every
        self.directory = locations.join(workdir, "checkpoints")  # local paths made absolute
        # Step directories are created before save() returns, not by a background thread:
        # orbax's array and JSON writes would wait for that thread's "directory created"
        # signal, which a creation failed by an outage never sends, so they sat in non-daemon
        # threads for orbax's 300 s coordination timeout and held the process at exit after
        # the run had already stopped (or retried). Created here, such a failure is raised by
        # save() and retried like any other; the writes then wait for nothing.
        # Several processes: a write failing on some of them is agreed on by all
        # (`persistent_faults`), through its barrier and handlers.
        self._writes = Writes() if jax.process_count() > 1 else None
        if self._writes:
            persistent_faults.quiet(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(
                create_directories_asynchronously=False,
                barrier_sync_fn=self._writes.barrier if self._writes else None),
            atomicity_options=orbax_paths.atomicity_options(self.directory))
        self.manager = ocp.CheckpointManager(
            self._path(), options=options,
            handler_registry=recording_handlers(self._writes) if self._writes else None)
        if jax.process_index() == 0:  # one deleter; no process saves before every one is here
            orbax_paths.remove_left_unfinished(self.directory)
        # One process: a failed save can be redone alone; with several, every host would have
        # to agree to redo it, so an outage there stops the run (orbax's error).
        self._retry = for_workdir(self.directory)
        if jax.process_count() > 1:
            self._retry = Retry(self.directory)
            self._retry.enabled = False
        self._dirty = False  # an outage may have left a half-written step to remove
        self._lost = False   # a save's commit failed: the state at hand must be saved again
        self._bytes = 0      # the last save's state, in bytes (what a full disk needed)
        self.saved_processes: int | None = None  # of the step restored
        self._pending: int | None = None  # the step of the last save started
        # The echoes of what is reported in one paragraph (an outage, a full disk): orbax's
        # logged tracebacks of its background commit, and the writes it abandons at the first
        # failure (closed event loops), which can print before the failure reaches us.
        orbax_paths.quiet_outage_logs()
        orbax_paths.drop_orphaned_echoes()

    def _path(self, *parts: str) -> epath.Path:
        """The directory (or an entry under it) as the epath orbax reads and writes."""
        return orbax_paths.path(locations.join(self.directory, *parts))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: TrainState, data_state: dict | None,
             adapters_only: bool = False) -> None:
        """Starts saving `step` (its commit continues in the background) once the previous
        save is committed; `adapters_only` (LoRA): the frozen base is saved as its fingerprint
        only. Across an outage: see the module docstring."""
        args = _save_args(state, data_state, adapters_only)
        self._bytes = _nbytes(state)

        def attempt(_: float | None) -> None:
            self._settle(step)
            self._start(step, args)
        self._retry.call(f"saving checkpoint step {step}", attempt)

    def finish(self, step: int, state: TrainState, data_state: dict | None,
               adapters_only: bool = False, save: bool = True) -> None:
        """Waits until the last save is committed, then closes. `save`: `step` is saved too
        (unless it already is); so is it when an earlier save's commit failed in an outage,
        since `state` is the only copy left of what was trained."""
        self._bytes = _nbytes(state)

        def attempt(_: float | None) -> None:
            self._settle(step)
            if (save or self._lost) and self.manager.latest_step() != step:
                self._start(step, _save_args(state, data_state, adapters_only))
                self._settle(step)
        self._retry.call(f"saving checkpoint step {step}", attempt)
        self._lost = False
        self.manager.close()

    def _settle(self, at: int) -> None:
        """Removes what an outage left half-written, then waits for the background commit of
        the last save; one that failed for an outage marks its state as lost. Several
        processes: a save failed on any stops every process at step `at` (`persistent_faults`)."""
        if self._writes is not None:
            self._writes.settle(self.manager.wait_until_finished, self._pending, at,
                                self.directory, locations.join(self.directory, self._staging()),
                                self._discard_failed)
            return
        if self._dirty:
            orbax_paths.discard_partial(self.directory, locations.settings().timeout_s)
            self.manager.reload()
            self._dirty = False
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            if self._retry.enabled and is_outage(e):
                self._dirty = self._lost = True
            self._raise_if_disk_full(e)
            raise

    def _start(self, step: int, args: Any) -> None:
        """Starts saving `step`; a newer state than a lost one supersedes it."""
        try:
            self.manager.save(step, args=args, force=True)
        except Exception as e:
            if self._retry.enabled and is_outage(e):
                self._dirty = True
            self._raise_if_disk_full(e)
            raise
        self._lost = False
        self._pending = step

    def _discard_failed(self) -> tuple[str, int | None]:
        """Removes (on process 0) what the failed save of `_pending` left; returns its name
        and the newest intact step."""
        name = self._staging()
        if jax.process_index() == 0:
            if locations.is_remote(self.directory):
                orbax_paths.discard_partial(self.directory, locations.settings().timeout_s)
            else:
                shutil.rmtree(str(self._path(name)), ignore_errors=True)
        self.manager.reload()
        return name, self.manager.latest_step()

    def _staging(self) -> str:
        """The name under which the pending step is written: the step itself on a bucket
        (commit-file steps: a step without one is unfinished), orbax's temporary directory on
        a file system (renamed once complete)."""
        if locations.is_remote(self.directory):
            return str(self._pending)
        return f"{self._pending}.orbax-checkpoint-tmp"

    def stop_for_full_disk(self) -> None:
        """Another workdir write (metrics.jsonl, events.jsonl, TensorBoard) met a full disk,
        most often filled by the save whose commit is still in flight: that save, which would
        only report at the next one, is waited for here, so that its own paragraph (raised)
        names the checkpoint, and its unfinished step is removed (freeing what it took) before
        the run stops. A commit that failed otherwise, or succeeded, leaves the other write's
        error to be reported. Several processes: nothing is waited for (that needs every
        process, and only process 0 writes those files)."""
        if self._writes is not None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # not the disk: the other write's full disk is reported
            self._raise_if_disk_full(e)
        orbax_paths.remove_unfinished(self.directory)

    def _raise_if_disk_full(self, error: Exception) -> None:
        """A full disk (or quota) while a step is written: the unfinished step is removed (it was
        never listed: orbax renames a step only once complete) and one paragraph says so."""
        if not is_disk_full(error):
            return
        removed = orbax_paths.remove_unfinished(self.directory)
        raise disk_full_error(self.directory, "writing a checkpoint", self._bytes,
                              ", ".join(removed) or "none") from None

    def saved_keys(self, step: int) -> set[str]:
        """Top-level entries of a saved state ('frozen' or 'base_fingerprint', 'params', ...)."""
        path = self._path(str(step), "state")
        meta = ocp.StandardCheckpointHandler().metadata(path)
        return set(meta.tree if hasattr(meta, "tree") else meta)

    def restore(self, state: TrainState, shardings: TrainState,
                step: int | None = None) -> tuple[TrainState, dict]:
        """Restores onto this run's shardings: `step`, or the newest step that restores (a
        truncated newer one is skipped with a warning). An adapters-only checkpoint keeps the
        run's own frozen base (from init_from / the seed) after checking it against the
        fingerprint."""
        def attempt(step: int) -> tuple[bool, dict]:
            adapters_only = "base_fingerprint" in self.saved_keys(step)
            self._check_layout(step)
            target = _target(state, shardings, adapters_only)
            args = ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                      data=ocp.args.JsonRestore())
            return adapters_only, self.manager.restore(step, args=args)

        def mismatch(step: int, e: Exception) -> CheckpointError:
            return _unrestorable(self.directory, step, e)

        def retried(step: int) -> tuple[bool, dict]:
            return self._retry.call(f"restoring checkpoint step {step}", lambda _: attempt(step))

        if step is None:
            step, (adapters_only, restored) = newest_restorable(
                self.directory, retried, mismatch, self._set_aside)
        else:
            try:
                adapters_only, restored = retried(step)
            except (ValueError, KeyError, FileNotFoundError) as e:
                raise mismatch(step, e) from None
        s = restored["state"]
        if adapters_only:
            self._check_base(step, s["base_fingerprint"], state.frozen)
        new = state.replace(step=s["step"], params=s["params"],
                            frozen=state.frozen if adapters_only else s["frozen"],
                            opt_state=s["opt_state"], rng=jax.random.wrap_key_data(s["rng"]),
                            extra=s["extra"])
        data = dict(restored["data"] or {})
        self.saved_processes = data.pop(PROCESSES, None)  # None: saved before it was recorded
        return new, data or None

    def _check_layout(self, step: int) -> None:
        """A pre-fusion Llama checkpoint (separate wq/wk/wv, w_gate/w_up) gets one clear error
        naming the fix (`weights/legacy.py`), not a restore failure taken for a broken step."""
        path = epath.Path(self.directory) / str(step) / "state"
        meta = ocp.StandardCheckpointHandler().metadata(path)
        tree = meta.tree if hasattr(meta, "tree") else meta
        saved = {f"{part}/{k}": None for part in ("params", "frozen")
                 for k in flatten(dict(tree.get(part) or {}))}
        if is_legacy(saved):
            raise CheckpointError(paragraph(
                f"Checkpoint step {step} under {self.directory}", *LEGACY_RESUME))

    def _set_aside(self, broken: list[int]) -> str:
        """Renames broken steps to `<step>.broken` (kept for inspection, ignored by orbax) so
        that the resumed run can save those step numbers again."""
        moved = []
        if jax.process_index() == 0:
            for step in broken:
                src = self._path(str(step))
                dst = self._path(f"{step}.broken")
                n = 1
                while dst.exists():
                    dst, n = self._path(f"{step}.broken{n}"), n + 1
                orbax_paths.move_step(src, dst)
                moved.append(dst.name)
        self.manager.reload()
        return (f"The broken step was moved aside to {', '.join(moved)} (nothing deleted) so "
                "that this run can save that step again." if moved else "")

    def _check_base(self, step: int, saved: jax.Array, frozen: Any) -> None:
        current = np.asarray(jax.device_get(base_fingerprint(frozen)))
        if not fingerprints_match(np.asarray(jax.device_get(saved)), current):
            raise CheckpointError(paragraph(
                f"Checkpoint step {step} in {self.directory} holds LoRA adapters only",
                "(lora.save_adapters_only), and the base weights this run built do not match the",
                "ones they were trained on. Resume with the same config.init_from and seed as the",
                "run that wrote it (the base is rebuilt from them, not saved), or start a fresh",
                "workdir."))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _nbytes(state: TrainState) -> int:
    return sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))


def _save_args(state: TrainState, data_state: dict | None, adapters_only: bool) -> Any:
    """The state, and the data position with the process count that wrote it (a resume onto
    another count checks that the data source can re-shard it: `registry.check_resize`)."""
    saveable = _to_saveable(state, adapters_only and bool(state.frozen))
    data = {**(data_state or {}), PROCESSES: jax.process_count()}
    return ocp.args.Composite(state=ocp.args.StandardSave(saveable),
                              data=ocp.args.JsonSave(data))


def _unrestorable(directory: str, step: int, error: Exception) -> CheckpointError:
    """Why step `step` does not restore, told apart: a saved tree of another structure (the
    model itself was compared with config.json before any restore, so the optimizer or the
    LoRA settings differ) or files that cannot be read (truncated, corrupt, missing)."""
    text = short_error(error).rstrip(":. ")
    if isinstance(error, KeyError) or "tree structures do not match" in text:
        return CheckpointError(paragraph(
            f"Cannot restore checkpoint step {step} from {directory}: the saved state has",
            "another structure than this run's, so its optimizer or LoRA settings",
            "(config.optim.*, config.lora.*) differ from the ones it was saved with. Resume",
            "with those settings, or start a fresh workdir (use config.init_from for weights).",
        ))
    return CheckpointError(paragraph(
        f"Cannot restore checkpoint step {step} from {directory}: {text}. Its files are",
        "truncated or corrupt (and no older step restores). Restore them from a copy, or",
        "start a fresh workdir (use config.init_from for the weights of another run).",
    ))
