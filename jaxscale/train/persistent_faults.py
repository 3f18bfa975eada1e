"""A persistent (workdir) save that fails on some processes of a multi-process run: every
process stops at the same step with one paragraph, instead of hanging for orbax's timeout.

What used to happen (measured: tests/test_persistent_faults.py's worker, process 1 unable to
write its shards): orbax's background commit on the failing process raised before the
`async_write_complete` barrier, while its peers waited at that barrier for it, and at the
next save every process's main thread waited for its commit thread: the run hung until
orbax's 20-minute barrier timeout (`AsyncOptions.timeout_secs`), the failure shown only as
tracebacks logged by process 1.

So, with several processes, the persistent manager is given (1) item handlers whose commit
futures record a failed write instead of raising it (`recording_handlers`), so that every
process reaches the barrier, and (2) that barrier (`Writes.barrier`, orbax's
`AsyncOptions.barrier_sync_fn`), which publishes each process's outcome through the
coordination service's key-value store (safe from orbax's background thread, where a device
collective is not) and raises on every process if any failed: no process finalizes the step
(its temporary directory is never renamed, so never listed). At the next save, the end or a
pre-emption, where all processes wait for the commit at the same step, the main threads agree
on who failed with `local_faults`' one-int all-gather, and every process raises
`PersistentSaveFailed` (exit status 2).

Why stop rather than train on, as the local tier does: the persistent tier is the run's source
of truth (the local tier keeps only a few steps, on disks that go with their hosts); a run
whose persistent saves fail would train on towards a restart that loses everything since the
last good save. The failed step's temporary files are removed; the earlier steps are untouched,
and the rerun resumes from the newest one. The stop comes at the next commit wait, not the
moment a write fails: stopping between saves would need an agreement at every step.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxscale.errors import EveryProcessError, paragraph, short_error
from jaxscale.runtime.distributed import coordination_client
from jaxscale.train.local_faults import QuietTier, failed_processes, gather_texts


class PersistentSaveFailed(EveryProcessError):
    """A persistent save failed on some process; every process stops (module docstring)."""


class PeerFailed(Exception):
    """Raised by `Writes.barrier` on every process when some process's writes failed."""


class _Recorded:
    """An orbax commit future whose failure is recorded in `writes`, not raised (a timeout
    still is: orbax's deadline is the same everywhere)."""

    def __init__(self, inner: Any, writes: Writes):
        self.inner, self.writes = inner, writes

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self.inner.result(timeout=timeout)
        except TimeoutError:
            raise
        except Exception as e:  # the process's own write failed: told at the barrier
            self.writes.error = self.writes.error or e
            return None

    def cancel(self) -> Any:
        return self.inner.cancel()


class Writes:
    """This process's outcome of the persistent save in flight, and the barrier that shares it
    (see the module docstring)."""

    def __init__(self):
        self.error: BaseException | None = None  # this process's first failed write
        self._calls = 0  # barriers so far: the same sequence on every process

    def wrap(self, futures: Any) -> list[Any]:
        return [_Recorded(f, self) for f in futures or []]

    def barrier(self, *, key: str, timeout_ms: int) -> None:
        """Orbax's `async_write_complete` barrier, carrying each process's outcome; raises
        `PeerFailed` on every process if any process's writes failed."""
        client = coordination_client()
        self._calls += 1
        base = f"jaxscale/persistent/{self._calls}/{key}"
        client.key_value_set(f"{base}/{jax.process_index()}",
                             "ok" if self.error is None else "failed")
        deadline = time.monotonic() + timeout_ms / 1000
        failed = []
        for p in range(jax.process_count()):
            left = max(1, int(1000 * (deadline - time.monotonic())))
            if client.blocking_key_value_get(f"{base}/{p}", left) != "ok":
                failed.append(p)
        if failed:
            raise PeerFailed(failed)

    def settle(self, wait: Any, step: int | None, at: int, directory: str, staging: str,
               cleanup: Any) -> None:
        """Runs `wait` (the manager's wait for the last commit) on every process, then agrees
        on the outcome: if some process's save of `step` failed, every process runs `cleanup`
        (returns what it removed and the newest intact step) and raises `PersistentSaveFailed`
        at step `at`. `staging` is where `step` was being written: named for a failed write
        whose error does not say which file."""
        error: BaseException | None = None
        try:
            wait()
        except Exception as e:
            error = e
        own, self.error = self.error, None
        if own is None and error is not None and not isinstance(error, PeerFailed):
            own = error  # failed outside the writes (the finalize): only here
        failed = failed_processes(own is None)
        if not failed:
            return
        texts = gather_texts(describe(own, staging) if own is not None else "")
        removed, newest = cleanup()
        where = "; ".join(f"process {p} ({texts[p]})" for p in failed)
        intact = (f"the checkpoints before it are intact, the newest step {newest}, and a rerun "
                  "resumes from it" if newest is not None else
                  "there is no earlier checkpoint: a rerun starts from the beginning")
        raise PersistentSaveFailed(paragraph(
            f"The persistent checkpoint of step {step} in {directory} could not be written on",
            f"{where}. Every process stopped at step {at}: the workdir's checkpoints are the",
            "run's source of truth, and training on without them would only lengthen what a",
            f"restart loses. Step {step} was not committed (its temporary directory {removed} is",
            "removed by process 0);",
            f"{intact}. Fix that host's storage (space, quota, permissions, a file where a",
            "directory should be) and run the same command again."))


class QuietSave(QuietTier):
    """The failed write is reported once, in `PersistentSaveFailed`: orbax's logged tracebacks
    of it (its writer thread's, which `_Recorded` records, its commit thread's and its wait's:
    one per process) are dropped,
    as `QuietTier` drops the local tier's, and so is asyncio's note, at exit, of the metadata
    write the failed step abandoned."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        while error is not None:
            if isinstance(error, PeerFailed):
                return False
            error = error.__context__
        text = record.getMessage()
        if "_SignalingThread.run() raised an exception" in text:  # a write: recorded
            return False
        if text.startswith("Task was destroyed but it is pending") and "orbax" in text:
            return False
        return super().filter(record)


def quiet(directory: str) -> None:
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(QuietSave(directory))


def describe(error: BaseException, staging: str) -> str:
    """A failed write in a line, `file: OS error`, which is what says what to fix.
    Tensorstore's message names the database, the file and the OS error after a page of
    context; a plain write (orbax's metadata, the data position) raises an OSError that may not
    name its file, and then the step's staging directory `staging` stands in for it."""
    text = str(error)
    file = re.search(r'Failed writing: "([^"]+)": .*?([^:]+?)(?: \[os_error_code.*)?$',
                     text.splitlines()[0] if text else "")
    if file:
        return f"{file.group(1)}: {file.group(2).strip()}"
    cause: BaseException | None = error
    while cause is not None and not (isinstance(cause, OSError) and cause.strerror):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        return f"{cause.filename or staging}: {cause.strerror}"
    return f"{staging}: {short_error(error)}"


def recording_handlers(writes: Writes) -> Any:
    """The persistent manager's handler registry: the train state (`state`) and the data
    position (`data`), saved and restored as orbax's own handlers do, their commit futures
    wrapped by `writes`."""
    def recording(base: type) -> Any:
        class Recording(base):
            async def async_save(self, *args: Any, **kwargs: Any) -> Any:
                return writes.wrap(await super().async_save(*args, **kwargs))
        return Recording()
    registry = ocp.DefaultCheckpointHandlerRegistry()
    for item, handler, save, restore in (
            ("state", recording(ocp.StandardCheckpointHandler), ocp.args.StandardSave,
             ocp.args.StandardRestore),
            ("data", recording(ocp.JsonCheckpointHandler), ocp.args.JsonSave,
             ocp.args.JsonRestore)):
        registry.add(item, save, handler)
        registry.add(item, restore, handler)
    return registry
