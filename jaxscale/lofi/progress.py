"""The combined progress line of a Lo-Fi job, read from what the job writes for machines.

Each worker's step and loss come from the newest record of its `WORKDIR/metrics.jsonl` (and its
total steps from `WORKDIR/config.json`); the newest average round from listing the store's
COMMIT markers. Nothing is parsed out of printed text, so changing how a worker prints its
progress cannot break this line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import StoreError
from jaxscale.weights.snapshot import average_rounds

_TAIL_BYTES = 1 << 16   # the last records of a metrics.jsonl: enough for the newest step


def newest_record(workdir: str) -> dict | None:
    """The newest complete record with a `step` in WORKDIR/metrics.jsonl (None: none yet).
    Reads only the file's tail: it grows for the whole run and is polled every second."""
    path = os.path.join(workdir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - _TAIL_BYTES))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):  # the last line may be cut short while being written
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            return record
    return None


def total_steps(workdir: str) -> int | None:
    """`train.steps` of the run's saved WORKDIR/config.json (None before it is written)."""
    try:
        with open(os.path.join(workdir, "config.json")) as f:
            return int(json.load(f)["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def worker_status(workdir: str) -> str:
    """`12/20 loss=3.1416`, or `starting` before the first record."""
    record = newest_record(workdir)
    if record is None:
        return "starting"
    total = total_steps(workdir)
    text = f"{record['step']}/{total}" if total else f"step {record['step']}"
    loss = record.get("loss")
    return f"{text} loss={float(loss):.4f}" if isinstance(loss, (int, float)) else text


@dataclass
class JobProgress:
    """One status line for the whole job; `poll` returns it when it changed since last time."""

    store: str
    workdirs: list[str]
    last: str = ""
    _store: Store | None = field(default=None, repr=False)

    def newest_round(self) -> str:
        try:
            self._store = self._store or Store(self.store)
            rounds = average_rounds(self._store)
        except (StoreError, ValueError, OSError):  # not created yet, or unreachable for now
            return "-"
        return str(rounds[-1]) if rounds else "-"

    def line(self) -> str:
        workers = " | ".join(f"w{i} {worker_status(w)}" for i, w in enumerate(self.workdirs))
        return f"[lofi] {workers} | average round {self.newest_round()}"

    def poll(self) -> str | None:
        line = self.line()
        if line == self.last:
            return None
        self.last = line
        return line
