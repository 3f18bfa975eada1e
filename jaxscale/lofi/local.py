"""Runs a whole Lo-Fi job on one machine: N worker processes (each its own simulated mesh) plus
the averager, with one combined progress line and the other output under `[w0]`/`[avg]`.

Used by `python -m launch.lofi_local`; `lofi_vm_commands` prints the same job as one worker per
TPU VM with a shared `gs://` store. SIGTERM/SIGINT stop every child (the averager releases its
claim on the way out) so an interrupted job leaves only committed or ignorable data behind.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

_STEP_RE = re.compile(r"^step (\d+)/(\d+)\s*(.*?)(?: \(\d+s\))?$")
_ROUND_RE = re.compile(r"^round (\d+): averaged (.*)$")


def _quorum(train_flags: Sequence[str], num_workers: int) -> list[str]:
    """Full quorum unless the train flags choose one: every round waits for all workers."""
    given = any(f.startswith("--config.lofi.min_workers") for f in train_flags)
    return [] if given else [f"--config.lofi.min_workers={num_workers}"]


@dataclass(frozen=True)
class LofiJob:
    store: str
    num_workers: int
    devices_per_worker: int
    train_flags: tuple[str, ...]
    workdir: str
    aggregator: str = "mean"
    outer: str = "none"


    def worker_argv(self, worker_id: int, python: str = sys.executable) -> list[str]:
        return [python, "-m", "launch.train", *self.train_flags,
                f"--workdir={os.path.join(self.workdir, f'worker{worker_id}')}",
                f"--cpu_devices={self.devices_per_worker}",
                "--config.lofi.enabled=True", f"--config.lofi.store={self.store}",
                f"--config.lofi.worker_id={worker_id}",
                f"--config.lofi.num_workers={self.num_workers}",
                *_quorum(self.train_flags, self.num_workers)]

    def averager_argv(self, python: str = sys.executable, final: str | None = None) -> list[str]:
        argv = [python, "-m", "launch.lofi_average", f"--store={self.store}",
                f"--aggregator={self.aggregator}", f"--outer={self.outer}"]
        return argv + ([f"--final={final}"] if final else ["--watch"])


@dataclass
class Progress:
    """One status line for the whole job: each worker's step and loss, the newest round."""

    num_workers: int
    stream: object = sys.stdout
    steps: dict[str, str] = field(default_factory=dict)
    round: str = "-"
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_print: float = 0.0

    def line(self) -> str:
        workers = " | ".join(f"w{i} {self.steps.get(f'w{i}', 'starting')}"
                             for i in range(self.num_workers))
        return f"[lofi] {workers} | average round {self.round}"

    def feed(self, prefix: str, text: str) -> None:
        """Step lines update the combined line; everything else is passed through."""
        text = text.rstrip("\n")
        step, round_ = _STEP_RE.match(text), _ROUND_RE.match(text)
        with self.lock:
            if step:
                self.steps[prefix] = f"{step[1]}/{step[2]} {step[3]}".strip()
            else:
                self.stream.write(f"[{prefix}] {text}\n")
            if round_:
                self.round = round_[1]
            now = time.monotonic()
            if (step or round_) and (now - self.last_print > 1.0 or step and step[1] == step[2]):
                self.stream.write(self.line() + "\n")
                self.last_print = now
            self.stream.flush()


def _pump(prefix: str, proc: subprocess.Popen, progress: Progress) -> None:
    for line in proc.stdout:
        progress.feed(prefix, line)


class _Children:
    """The job's processes. A signal only asks them to stop (SIGTERM, non-blocking, safe in a
    handler); `wait` polls, so it notices the request and SIGKILLs what outlives the grace."""

    def __init__(self, progress: Progress, grace_s: float = 20.0):
        self.progress, self.procs, self.threads = progress, [], []
        self.stopping, self.grace_s = 0, grace_s
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env.pop("XLA_FLAGS", None)  # each worker sets its own simulated device count

    def start(self, argv: Sequence[str], prefix: str) -> subprocess.Popen:
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=self.env)
        thread = threading.Thread(target=_pump, args=(prefix, proc, self.progress), daemon=True)
        thread.start()
        self.procs.append(proc)
        self.threads.append(thread)
        self.progress.feed("lofi", f"started {prefix} (pid {proc.pid})")
        return proc

    def request_stop(self, signum: int) -> None:
        self.stopping = signum
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()

    def wait(self, procs: Sequence[subprocess.Popen]) -> list[int]:
        """Exit codes of `procs`; if a stop was requested, of every child once all are gone."""
        deadline = None
        while True:
            if self.stopping:
                procs = self.procs
                deadline = deadline or time.monotonic() + self.grace_s
                if time.monotonic() > deadline:
                    for proc in procs:
                        if proc.poll() is None:
                            proc.kill()
            if all(p.poll() is not None for p in procs):
                return [p.returncode for p in procs]
            time.sleep(0.1)


def run_local(job: LofiJob, periodic: bool) -> int:
    """Starts the workers (and, for periodic sync, a watching averager); returns an exit code.

    After the workers finish, one final averaging round is run with `--final` so the averaged
    model is left in the store and exported as a regular checkpoint under WORKDIR/final.
    SIGTERM / SIGINT stop every child and return 128 + the signal number.
    """
    children = _Children(Progress(job.num_workers))

    def on_signal(signum, frame):
        print(f"lofi_local: signal {signum}, stopping all workers and the averager",
              file=sys.stderr, flush=True)
        children.request_stop(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = _run(job, periodic, children)
        return 128 + children.stopping if children.stopping else code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run(job: LofiJob, periodic: bool, children: _Children) -> int:
    workers = [children.start(job.worker_argv(i), f"w{i}") for i in range(job.num_workers)]
    watcher = children.start(job.averager_argv(), "avg") if periodic else None
    codes = children.wait(workers)
    if watcher is not None:
        watcher.terminate()
        children.wait([watcher])
    if children.stopping:
        return 1
    if any(codes):
        print(f"lofi_local: worker exit codes {codes}", file=sys.stderr)
        return 1
    final = children.start(job.averager_argv(final=os.path.join(job.workdir, "final")), "avg")
    code = children.wait([final])[0]
    for t in children.threads:
        t.join(timeout=5)
    return code


def lofi_vm_commands(store: str, num_workers: int, train_flags: Sequence[str],
                     aggregator: str = "mean", outer: str = "none",
                     periodic: bool = False) -> list[str]:
    """A shell script: the command for TPU VM number i (one independent worker per VM, a shared
    store), then the averager's, which can run on any machine that reaches the store."""
    lines = []
    for i in range(num_workers):
        lines += [f"# TPU VM {i}: worker {i} (its own devices, data shard {i}/{num_workers})",
                  shlex.join(["python", "-m", "launch.train", *train_flags,
                              f"--workdir=runs/lofi_worker{i}", "--config.lofi.enabled=True",
                              f"--config.lofi.store={store}", f"--config.lofi.worker_id={i}",
                              f"--config.lofi.num_workers={num_workers}",
                              *_quorum(train_flags, num_workers)])]
    averager = ["python", "-m", "launch.lofi_average", f"--store={store}",
                f"--aggregator={aggregator}", f"--outer={outer}"]
    if periodic:
        lines += ["# any machine that reaches the store, while the workers run: the averager",
                  shlex.join(averager + ["--watch"])]
    lines += ["# after every worker has finished: the final average, exported for init_from",
              shlex.join(averager + ["--final=runs/lofi_final"])]
    return lines
