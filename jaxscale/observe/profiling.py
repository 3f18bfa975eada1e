"""Profiler traces of chosen steps, and a terminal summary of a trace (no browser needed).

`config.train.profile` picks the steps: `num_steps` steps from `start_step` (0 steps: off) are
captured with `jax.profiler` into `WORKDIR/profile/` on process 0, or on every process with
`all_processes` (process i > 0 into `WORKDIR/profile/process_<i>/`, since processes on one
machine would otherwise write the same file). `host_tracing` is the host tracer level (0 off,
1 user annotations, 2 + the runtime's high-level events, 3 verbose). JAX writes
`plugins/profile/<time>/<host>.xplane.pb` (TensorBoard's profile plugin, `xprof`) and, as asked
here, `perfetto_trace.json.gz` beside it (drop it on https://ui.perfetto.dev).

`summarize` reads the `.xplane.pb` with `jax.profiler.ProfileData` (jaxlib's own XSpace reader,
so neither TensorFlow nor TensorBoard is needed): on GPUs and TPUs the ops of each device plane
(its "XLA Ops" line, else kernels grouped by their `hlo_op`), on the CPU backend the XLA ops the
thunk executor records on host threads (events carrying an `hlo_op` stat). Collectives are the
ops named like XLA's collective instructions (all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute, send/recv and their -start/-done halves).
"""

from __future__ import annotations

import collections
import glob
import os
import re
from dataclasses import dataclass
from typing import Any

from jaxscale.errors import ConfigError, JaxscaleError, paragraph

COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|"
                        r"collective-permute|collective-broadcast|send|recv)([-._]|$)")


class ProfileError(JaxscaleError):
    """No readable trace where one was expected."""


def check_settings(profile: Any) -> None:
    """The `config.train.profile` section (`config.validate` calls this)."""
    if not (profile.start_step >= 1 and profile.num_steps >= 0):
        raise ConfigError(paragraph(
            f"train.profile.start_step={profile.start_step} must be >= 1 and",
            f"train.profile.num_steps={profile.num_steps} >= 0 (0: no profile)."))
    if not 0 <= profile.host_tracing <= 3:
        raise ConfigError(paragraph(
            f"train.profile.host_tracing={profile.host_tracing}: use a host tracer level from 0",
            "(off) to 3 (verbose); 2 (the default) records the runtime's high-level events."))


def profile_dir(workdir: str, process_index: int) -> str:
    base = os.path.join(workdir, "profile")
    return base if process_index == 0 else os.path.join(base, f"process_{process_index}")


class Profiler:
    """Starts a trace before step `start_step` and stops it after the last profiled step."""

    def __init__(self, cfg: Any, workdir: str | None, process_index: int):
        self.first = int(cfg.start_step)
        self.last = self.first + int(cfg.num_steps) - 1
        wanted = process_index == 0 or bool(cfg.all_processes)
        self.enabled = bool(workdir) and int(cfg.num_steps) > 0 and wanted
        if self.enabled and "://" in workdir and not workdir.startswith("file://"):
            raise JaxscaleError(paragraph(
                f"config.train.profile asks for a trace, but --workdir={workdir} is a bucket and",
                "profiler traces are written to a local directory. Profile a short run with a local",
                "--workdir (the checkpoints of the bucket run are not needed for that), or set",
                "--config.train.profile.num_steps=0."))
        self.directory = profile_dir(workdir, process_index) if self.enabled else None
        self.host_tracing = int(cfg.host_tracing)
        self.active = False

    def before_step(self, step: int) -> None:
        if self.enabled and step == self.first and not self.active:
            import jax
            options = jax.profiler.ProfileOptions()
            options.host_tracer_level = self.host_tracing
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True,
                                     profiler_options=options)
            self.active = True

    def after_step(self, step: int, outputs: Any) -> bool:
        """Stops after the last profiled step, once its `outputs` are computed; True then."""
        if self.active and step >= self.last:
            import jax
            jax.block_until_ready(outputs)
            self.stop()
            return True
        return False

    def stop(self) -> None:
        if self.active:
            import jax
            jax.profiler.stop_trace()
            self.active = False
            print(f"jaxscale: profile of steps {self.first}-{self.last} in {self.directory} "
                  f"(jaxscale profile-summary {os.path.dirname(self.directory)})",
                  flush=True)


@dataclass
class OpTime:
    name: str
    total_ns: float
    count: int
    collective: bool


@dataclass
class Summary:
    trace: str           # the .xplane.pb read
    source: str          # which events were counted ("device ops" / "CPU host ops")
    devices: int         # planes (devices) or host threads that ran ops
    ops: list[OpTime]    # by total time, largest first

    @property
    def total_ns(self) -> float:
        return sum(op.total_ns for op in self.ops)

    @property
    def collective_share(self) -> float:
        total = self.total_ns
        return sum(op.total_ns for op in self.ops if op.collective) / total if total else 0.0


def latest_trace(workdir: str) -> str:
    """The newest `.xplane.pb` under WORKDIR/profile/plugins/profile/ (process 0's traces)."""
    if "://" in workdir and not workdir.startswith("file://"):
        raise ProfileError(paragraph(
            f"No profiler trace in {workdir}: traces are written to a local --workdir only (a",
            "run on a bucket workdir refuses config.train.profile). Give the local workdir of",
            "the profiled run, or a copy of its profile/ directory's .xplane.pb file."))
    base = os.path.join(workdir, "profile")
    found = glob.glob(os.path.join(base, "plugins", "profile", "*", "*.xplane.pb"))
    if not found:
        raise ProfileError(paragraph(
            f"No profiler trace under {base}/plugins/profile/. Capture one by training with",
            "--config.train.profile.num_steps=N (and optionally",
            "--config.train.profile.start_step=S) and a --workdir, then summarize that workdir.",
        ))
    return max(found, key=os.path.getmtime)


def _op_name(event: Any) -> str | None:
    return dict(event.stats).get("hlo_op") or None


def _self_times(events: list[tuple[str | None, Any]]) -> list[tuple[str, float]]:
    """(op, exclusive ns) of one timeline line: an op event that encloses others (a `while`
    or `call` running its body's ops) keeps only the time not spent in them, so nothing is
    counted twice. Events without an op name are ignored."""
    ops = sorted(((n, e.start_ns, e.end_ns) for n, e in events if n), key=lambda t: (t[1], -t[2]))
    out: list[list] = []
    stack: list[int] = []  # indices into out of the enclosing ops
    for name, start, end in ops:
        while stack and out[stack[-1]][2] <= start:
            stack.pop()
        if stack:
            out[stack[-1]][3] -= min(end, out[stack[-1]][2]) - start
        out.append([name, start, end, end - start])
        stack.append(len(out) - 1)
    return [(name, max(own, 0.0)) for name, _, _, own in out]


def _collect(planes: list[Any]) -> tuple[dict[str, list[float]], int, str]:
    """{op name: [self times ns]}, the number of devices / threads seen, and the source."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    used = 0
    for plane in (p for p in planes if p.name.startswith("/device:")):
        lines = [ln for ln in plane.lines if ln.name == "XLA Ops"]
        events = ([(e.name, e) for ln in lines for e in ln.events] if lines else
                  [(_op_name(e), e) for ln in plane.lines for e in ln.events])
        for name, own in _self_times(events):
            times[name].append(own)
        used += any(name for name, _ in events)
    if times:
        return times, used, "device ops"
    for plane in planes:  # the CPU backend: ops run on host threads
        for line in plane.lines:
            found = _self_times([(_op_name(e), e) for e in line.events])
            for name, own in found:
                times[name].append(own)
            used += bool(found)
    return times, used, "CPU host ops (XLA CPU backend), on host threads"


def summarize(workdir_or_trace: str) -> Summary:
    """Op times of the newest trace in a workdir (or of one `.xplane.pb`)."""
    from jax.profiler import ProfileData

    path = (workdir_or_trace if workdir_or_trace.endswith(".xplane.pb")
            else latest_trace(workdir_or_trace))
    try:
        data = ProfileData.from_file(path)
    except Exception as e:  # a truncated or foreign file
        raise ProfileError(f"Cannot read the profiler trace {path}: {e}.") from None
    times, devices, source = _collect(list(data.planes))
    if not times:
        raise ProfileError(paragraph(
            f"The trace {path} holds no XLA op events: it captured no train step (was the",
            "profiled step range inside the run?) or host tracing was off on a CPU run (use",
            "--config.train.profile.host_tracing=2 or more).",
        ))
    ops = [OpTime(name, sum(d), len(d), bool(COLLECTIVE.match(name)))
           for name, d in times.items()]
    ops.sort(key=lambda op: op.total_ns, reverse=True)
    return Summary(path, source, devices, ops)


def format_summary(summary: Summary, top: int = 15) -> str:
    total = summary.total_ns
    coll = [op for op in summary.ops if op.collective]
    lines = [
        f"trace: {summary.trace}",
        f"counted: {summary.source}: {summary.devices} timeline(s), "
        f"{total / 1e6:,.2f} ms of op time in all (self time: nested ops counted once)",
        f"collectives: {100 * summary.collective_share:.1f}% of op time"
        + (f" ({', '.join(op.name for op in coll[:5])})" if coll else " (none in the trace)"),
        "",
        f"top {min(top, len(summary.ops))} ops by device time:",
        f"{'op':<40} {'time ms':>10} {'share':>7} {'calls':>6}  kind",
    ]
    for op in summary.ops[:top]:
        lines.append(f"{op.name[:40]:<40} {op.total_ns / 1e6:>10.3f} "
                     f"{100 * op.total_ns / total:>6.1f}% {op.count:>6}  "
                     f"{'collective' if op.collective else 'compute'}")
    return "\n".join(lines)
