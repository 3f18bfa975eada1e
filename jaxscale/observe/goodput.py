"""Goodput: how much of a run's wall time, across all its restarts, trained steps that it kept.

Read from the workdir's event log (`jaxscale.observe.events`). The log is cut into runs at
each `start` event. A run resumes from the step its `restore` event names (0 without one) and
reaches the largest step of its `progress`, `save`, `preempted` or `exit` events. The steps a
run took beyond the step the next run resumed from were trained twice: they are *lost* to that
interruption (a SIGKILL, a pre-emption, a crash), and so is their step time. *Productive* time
is the step time of the steps kept; *wall* time runs from the first start to the last event,
including the time no process was running between runs. Compiling, saving and restoring are
summed from their events. A run killed without an `exit` counts its steps up to its last
`progress` event (the steps after it were not logged).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.observe.events import FILE, read_log
from jaxscale.storage import locations

_STEP_EVENTS = ("progress", "save", "preempted", "exit")


@dataclass
class Interruption:
    """The end of one run and what the next run resumed from."""

    run: int            # 1-based index of the interrupted run
    how: str            # "killed" (no exit event), "pre-empted" or "exited"
    reached: int        # the largest step the run recorded
    resumed: int        # the step the next run restored
    lost_steps: int


@dataclass
class Goodput:
    runs: int
    first_step: int
    last_step: int
    wall_s: float
    productive_s: float
    compile_s: float
    save_s: float
    restore_s: float
    down_s: float       # between runs: from a run's last event to the next start
    interruptions: list[Interruption] = field(default_factory=list)
    unreadable_lines: int = 0  # all lines skipped: cut short by a kill, or malformed
    malformed_lines: int = 0    # of those, complete lines that are not a usable event
    finished: bool = False  # the last run wrote its exit event

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "goodput": self.goodput}


def _runs(events: list[dict]) -> list[list[dict]]:
    runs: list[list[dict]] = []
    for e in events:
        if e["event"] == "start" or not runs:
            runs.append([])
        runs[-1].append(e)
    return runs


def _resumed(run: list[dict]) -> int:
    return max((int(e["step"]) for e in run if e["event"] == "restore"), default=0)


def _reached(run: list[dict]) -> int:
    return max((int(e["step"]) for e in run if e["event"] in _STEP_EVENTS),
               default=_resumed(run))


def _kept_step_time(run: list[dict], limit: float) -> float:
    """Step time of the run's steps up to `limit`: each `progress` event covers the steps after
    the previous one; an interval cut by `limit` counts in proportion."""
    total, prev = 0.0, _resumed(run)
    for e in run:
        if e["event"] != "progress":
            continue
        step, seconds = int(e["step"]), float(e["seconds"])
        if step > prev:
            total += seconds * max(0.0, min(step, limit) - prev) / (step - prev)
            prev = step
    return total


def analyse(events: list[dict], unreadable_lines: int = 0, malformed_lines: int = 0) -> Goodput:
    """The goodput of a run's `events` (in the order written)."""
    runs = _runs(events)
    out = Goodput(runs=len(runs), first_step=_resumed(runs[0]), last_step=_reached(runs[-1]),
                  wall_s=float(events[-1]["time"]) - float(events[0]["time"]), productive_s=0.0,
                  compile_s=0.0, save_s=0.0, restore_s=0.0, down_s=0.0,
                  unreadable_lines=unreadable_lines, malformed_lines=malformed_lines,
                  finished=runs[-1][-1]["event"] == "exit")
    for i, run in enumerate(runs):
        for e in run:
            key = {"compile": "compile_s", "save": "save_s", "restore": "restore_s"}.get(
                e["event"])
            if key:
                setattr(out, key, getattr(out, key) + float(e.get("seconds", 0.0)))
        limit = math.inf
        if i + 1 < len(runs):
            nxt = runs[i + 1]
            limit = _resumed(nxt)
            out.down_s += float(nxt[0]["time"]) - float(run[-1]["time"])
            kinds = {e["event"] for e in run}
            how = ("pre-empted" if "preempted" in kinds else "exited" if "exit" in kinds
                   else "killed")
            reached = _reached(run)
            out.interruptions.append(Interruption(i + 1, how, reached, int(limit),
                                                  max(0, reached - int(limit))))
        out.productive_s += _kept_step_time(run, limit)
    return out


def goodput(workdir: str) -> Goodput:
    """The goodput of the run in `workdir` (local or a bucket); one paragraph if it has no
    event log."""
    events, cut, malformed = read_log(workdir)
    if not events:
        raise JaxscaleError(paragraph(
            f"{locations.join(workdir, FILE)} is missing or holds no events: no run of this",
            "version of jaxscale trained in this workdir (runs write it from their start).",
            "Point `jaxscale goodput` at a training workdir."))
    return analyse(events, cut + malformed, malformed)


def _skipped(g: Goodput) -> str:
    """The report's line on skipped lines, each kind named for what it is."""
    cut = g.unreadable_lines - g.malformed_lines
    parts = ([f"{cut} line(s) cut short by a kill"] if cut else []) + (
        [f"{g.malformed_lines} malformed line(s) (not a usable event)"] if g.malformed_lines
        else [])
    return f"  ({' and '.join(parts)} were skipped)"


def format_report(workdir: str, g: Goodput) -> str:
    """The terminal report of `jaxscale goodput`."""
    def pct(s: float) -> str:
        return f"{100 * s / g.wall_s:5.1f}%" if g.wall_s > 0 else "   - %"
    restarts = g.runs - 1
    lines = [f"goodput of {workdir}: {g.runs} run(s) ({restarts} restart(s)), steps "
             f"{g.first_step}->{g.last_step}" + ("" if g.finished else
                                               " (the last run wrote no exit: running or killed)"),
             f"  wall time     {g.wall_s:10.1f} s  from the first start to the last event",
             f"  productive    {g.productive_s:10.1f} s {pct(g.productive_s)}  step time of "
             "the steps kept (goodput)",
             f"  compiling     {g.compile_s:10.1f} s {pct(g.compile_s)}",
             f"  saving        {g.save_s:10.1f} s {pct(g.save_s)}",
             f"  restoring     {g.restore_s:10.1f} s {pct(g.restore_s)}",
             f"  between runs  {g.down_s:10.1f} s {pct(g.down_s)}  no process running"]
    lost = sum(i.lost_steps for i in g.interruptions)
    lines.append(f"  interruptions: {len(g.interruptions)}, {lost} step(s) lost")
    for i in g.interruptions:
        lines.append(f"    run {i.run} {i.how} at step {i.reached}, the next resumed from "
                     f"step {i.resumed}: {i.lost_steps} step(s) lost")
    if g.unreadable_lines:
        lines.append(_skipped(g))
    return "\n".join(lines)
