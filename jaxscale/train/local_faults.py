"""A local-tier save that fails on some processes (disk full, the directory removed or replaced
by a file, no permission): every process agrees on it, the run warns once and trains on.

Why this policy: the local tier is an optimisation beside the persistent tier, which still
saves on its schedule; losing some local steps costs at most the steps since the last
persistent save on a later restart, whereas stopping the run costs a restart now. What must
not happen is what used to: the failing process raised alone while its peers went on into the
next collective (the next step, the next save's barrier) and waited there for a process that
was gone, until the launcher's grace period or JAX's timeouts (minutes) stopped them.

So each local save (and the final wait for its commit) ends with one all-gather of one int per
process, in the hook every process runs at the same step: every process learns which processes
failed, none is left in a collective alone. Only then, and only if one did fail, a second
gather brings each failing process's directory and error to process 0, which prints one
warning paragraph and records one `local_save_failed` event (events.jsonl: `step`,
`processes`, `errors`, `in_a_row`). Orbax's local manager has no cross-process barrier (it is
configured with this process alone: `local_tier`), so its failure cannot hang the others.

A tier that fails `FAILURES_IN_A_ROW` local saves in a row is broken, not unlucky (a disk gone
or full): every process raises `LocalTierFailed` at the same step (one paragraph naming the
processes, directories and errors; exit status 2 like every user-facing error), and the rerun
resumes from the newest checkpoint that restores, local or persistent (`restore_newest`).
"""

from __future__ import annotations

import json
import logging
import traceback
from typing import Any

import jax
import numpy as np

from jaxscale.errors import EveryProcessError, paragraph, short_error

FAILURES_IN_A_ROW = 3  # failed local saves in a row that stop the run (a broken tier)
_TEXT_BYTES = 512  # each failing process's "directory: error", as gathered to process 0


class LocalTierFailed(EveryProcessError):
    """The local tier failed `FAILURES_IN_A_ROW` saves in a row on some process."""


def all_gather(values: np.ndarray) -> np.ndarray:
    """Every process's `values`, stacked (one process: its own, as one row)."""
    if jax.process_count() == 1:
        return values[None]
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(values))


def broadcast_json(value: Any, source: int) -> Any:
    """Process `source`'s JSON-able `value` on every process (one process: its own)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    mine = jax.process_index() == source
    data = np.frombuffer(json.dumps(value).encode(), np.uint8) if mine else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(data.size), is_source=mine))
    if not mine:
        data = np.zeros(n, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(data, is_source=mine))
    return json.loads(got.tobytes().decode())


def all_agree(ok: bool) -> bool:
    """Whether `ok` holds on every process (each process passes its own)."""
    return not failed_processes(ok)


def failed_processes(ok: bool) -> list[int]:
    """The processes that passed ok=False (the same list on every process)."""
    rows = all_gather(np.array([int(ok)], np.int32))
    return [p for p, row in enumerate(rows) if not row[0]]


def gather_texts(text: str) -> list[str]:
    """Every process's `text` (cut to `_TEXT_BYTES` bytes), in process order."""
    data = np.zeros(_TEXT_BYTES, np.uint8)
    raw = text.encode()[:_TEXT_BYTES]
    data[:len(raw)] = np.frombuffer(raw, np.uint8)
    rows = all_gather(data)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]


_NEVER_RETRIEVED = ("Future exception was never retrieved", "Task exception was never retrieved")


def _abandoned_orbax_write(text: str, error: BaseException | None) -> bool:
    """asyncio's note of a write orbax abandoned when another write of the same save failed:
    the save's failure is reported by its owner, and this echo may name no file at all (a write
    past a file-size limit: `OSError(27, 'File too large')`)."""
    return (text.startswith(_NEVER_RETRIEVED) and error is not None
            and any("/orbax/" in frame.filename
                    for frame in traceback.extract_tb(error.__traceback__)))


class QuietTier(logging.Filter):
    """Orbax logs a failed background save as several tracebacks (one per writer thread, and
    asyncio's "never retrieved" for the writes it abandons); a failure under the tier's
    directory is reported once, by `SaveOutcomes`, so those records are dropped, as are the
    abandoned writes' notes that name no file. Orbax also warns at every array of every local
    save that it cannot log global sizes without a primary host: true of every local save by
    design, so dropped too."""

    def __init__(self, directory: str):
        super().__init__()
        self.directory = directory

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "logging disabled for `primary_host=None`" in text:
            return False
        error = record.exc_info[1] if record.exc_info else None
        if _abandoned_orbax_write(text, error):
            return False
        return self.directory not in text and (error is None or
                                               self.directory not in str(error))


class SaveOutcomes:
    """Agrees on each local save's outcome across processes (see the module docstring);
    counts failed saves in a row."""

    def __init__(self, directory: str, persistent_every: int, events: Any = None):
        self.directory, self.persistent_every, self.events = directory, persistent_every, events
        self.in_a_row = 0

    def agree(self, step: int, error: BaseException | None, final: bool = False) -> bool:
        """Whether the save of `step` succeeded on every process; if not, warns once (process
        0) and, at the `FAILURES_IN_A_ROW`-th failure in a row (unless `final`: the run has
        finished), raises `LocalTierFailed` on every process."""
        failed = failed_processes(error is None)
        if not failed:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        mine = f"{self.directory}: {short_error(error)}" if error is not None else ""
        texts = [gather_texts(mine)[p] for p in failed]
        where = "; ".join(f"process {p} ({t})" for p, t in zip(failed, texts))
        if self.events is not None:
            self.events.record("local_save_failed", step=step, processes=failed, errors=texts,
                               in_a_row=self.in_a_row)
        if self.in_a_row >= FAILURES_IN_A_ROW and not final:
            raise LocalTierFailed(paragraph(
                f"The local checkpoint tier (checkpoint.local_dir) failed {self.in_a_row} saves",
                f"in a row, the last at step {step}, on {where}. The run stopped on every",
                "process. Free space on that disk or give a writable directory (it may contain",
                "{process}), or leave checkpoint.local_dir out; run the same command again: it",
                "resumes from the newest checkpoint that restores, local or persistent."))
        if jax.process_index() == 0:
            persistent = (f"every {self.persistent_every} steps" if self.persistent_every
                          else "at the end and at a pre-emption")
            print("jaxscale: warning: " + paragraph(
                f"the local checkpoint tier could not save step {step} on {where}.",
                "The run finishes" if final else "Training continues",
                "on every process: the local tier is an optimisation, and the",
                f"persistent tier still saves {persistent}; a restart resumes from the newest",
                "step that restores on every process. The run stops if",
                f"{FAILURES_IN_A_ROW} local saves fail in a row (this is {self.in_a_row})."),
                flush=True)
        return False
