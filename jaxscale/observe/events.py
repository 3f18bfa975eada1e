"""The workdir's event log, `WORKDIR/events.jsonl`: what `jaxscale goodput` reads.

Why a log of its own: metrics.jsonl is truncated on resume (so that a resumed run's file equals
an uninterrupted run's), which erases exactly what goodput is about: the steps a run took and
then lost. `events.jsonl` is append-only across every restart of the run. Process 0 writes one
JSON object per line: `{"event": NAME, "time": <unix seconds>, ...}` with

- `start` (the process began building the run; `processes`, `devices`),
- `restore` (`step`, `seconds`, `tier`: where the checkpoint came from),
- `compile` (`seconds`), `first_step` (`step`, `seconds`),
- `progress` (`step`, `seconds`: time in the loop since the previous `progress` or the start of
  the loop, less the saves in it; written on logged steps),
- `save` (`step`, `seconds` the loop was held by it, `tier`),
- `local_save_failed` (`step`, `processes`, `errors`, `in_a_row`: a local-tier save that failed
  on those processes; `jaxscale.train.local_faults`),
- `preempted` (`step`), `exit` (`step`).

A process killed with SIGKILL writes no `exit`: the next `start` shows the interruption, and
its last `progress` says how far it got. Written through the storage layer like metrics.jsonl:
appended and flushed locally (a kill leaves whole lines, or one cut-short last line that the
reader skips); on gs:// / s3:// (no append) the whole object is rewritten at each event.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.storage import locations, workdir_files

FILE = "events.jsonl"


class EventLog:
    """Appends events to WORKDIR/events.jsonl; disabled (no workdir, process > 0) it only
    keeps the clocks the hooks read. `clock`: unix seconds (events of separate processes are
    compared, so not a monotonic clock); injectable for tests."""

    def __init__(self, workdir: str | None, enabled: bool = True,
                 clock: Callable[[], float] = time.time):
        self.enabled = bool(enabled and workdir)
        self.clock = clock
        self.path = locations.join(workdir, FILE) if workdir else None
        self._log = workdir_files.LineLog(self.path) if self.enabled else None
        self.overhead_s = 0.0  # seconds of saves since the last `progress` (not step time)
        self._mark: float | None = None

    def record(self, event: str, at: float | None = None, **fields: Any) -> None:
        """Appends `event` at `at` (default: now) with `fields`."""
        if not self.enabled:
            return
        line = json.dumps({"event": event, "time": self.clock() if at is None else at, **fields})
        try:
            self._log.append(line + "\n")
        except OSError as e:
            raise _unusable(self.path, e) from None

    def loop_started(self) -> None:
        """The step loop begins (after restoring and compiling): step time counts from here."""
        self._mark, self.overhead_s = self.clock(), 0.0

    def progress(self, step: int) -> None:
        """Records the loop time since the last mark, less the saves in it, as step time."""
        now = self.clock()
        if self._mark is None:
            self._mark = now
        self.record("progress", at=now, step=step,
                    seconds=round(max(0.0, now - self._mark - self.overhead_s), 6))
        self._mark, self.overhead_s = now, 0.0

    def timed(self, event: str, seconds: float, **fields: Any) -> None:
        """Records a save (or another pause of the loop) that step time must leave out."""
        self.overhead_s += seconds
        self.record(event, seconds=round(seconds, 6), **fields)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()


def read_events(workdir: str) -> tuple[list[dict], int]:
    """(the events of WORKDIR/events.jsonl, how many lines were skipped: writes cut short by
    a kill, or malformed); a workdir without the file has none."""
    events, cut, malformed = read_log(workdir)
    return events, cut + malformed


def read_log(workdir: str) -> tuple[list[dict], int, int]:
    """(the usable events of WORKDIR/events.jsonl, lines cut short, malformed lines), as
    `read_events` reads them but telling the skipped lines apart: a kill cuts short an
    object the writer began (a `{...` that does not parse), while a complete line that is not
    a usable event (valid JSON with `"time": "abc"`, a hand edit, foreign bytes) is malformed,
    and blaming a kill for it would send the user looking for a crash that never happened."""
    events, cut, malformed = [], 0, 0
    for line in _text(locations.join(workdir, FILE)).splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            truncated = line.startswith("{") and "\ufffd" not in line
            cut, malformed = cut + truncated, malformed + (not truncated)
            continue
        if _well_formed(record):
            events.append(record)
        else:
            malformed += 1
    return events, cut, malformed


def _text(path: str) -> str:
    """The event log's text ("" if absent); bytes that are not UTF-8 (a foreign or damaged
    file) become lines that do not parse, skipped like a write cut short."""
    try:
        data = workdir_files.read_bytes(path)
    except OSError as e:
        raise _unusable(path, e) from None
    return (data or b"").decode("utf-8", errors="replace")


def _unusable(path: str, e: OSError) -> JaxscaleError:
    return JaxscaleError(paragraph(
        f"{path} cannot be used as the run's event log ({e.strerror or e}): it is a",
        "directory, or not readable and writable. `jaxscale goodput` reads it and every run",
        "appends to it; move what is there aside and rerun."))


def _well_formed(record: Any) -> bool:
    """An event the report can use: a name, a time, and numbers where numbers belong (a hand
    edit or a foreign file is skipped like a cut-short line, not a traceback)."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
    if not (isinstance(record, dict) and isinstance(record.get("event"), str)):
        return False
    needs = ["time", *_NEEDS.get(record["event"], ())]
    return (all(number(record.get(k)) for k in needs)
            and all(number(record[k]) for k in ("step", "seconds") if k in record))


# The fields beside `time` that the goodput report reads of each event that has them.
_NEEDS = {"restore": ("step",), "progress": ("step", "seconds"), "save": ("step",),
          "preempted": ("step",), "exit": ("step",)}


class GoodputHook:
    """Writes the loop's events: `progress` on logged steps, `preempted`, `exit`. Runs after
    the checkpoint hook so that a step's save is counted as saving, not as step time."""

    order = 400  # jaxscale.train.hooks.ORDER["goodput"]: after the checkpoint hook

    def __init__(self, events: EventLog, log_every: int, last_step: int):
        self.events, self.log_every, self.last_step = events, log_every, last_step

    def after_step(self, info: Any) -> None:
        if info.step % self.log_every == 0 or info.step == self.last_step:
            self.events.progress(info.step)

    def at_end(self, info: Any) -> None:
        self.events.record("exit", step=info.step)
        self.events.close()

    def at_preemption(self, info: Any) -> bool:
        self.events.progress(info.step)
        self.events.record("preempted", step=info.step)
        self.events.close()
        return False
