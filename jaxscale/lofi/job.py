"""A whole Lo-Fi job: its worker and averager commands, run on one machine (`run_local`, behind
`launch.lofi_local`) or printed as one command per TPU VM (`lofi_vm_commands`).

On one machine: N worker processes (each its own simulated mesh) plus the averager, their
output under `[w0]`/`[avg]`, and a combined progress line built from the workers'
metrics.jsonl and the store (`progress.py`), printed whenever it changes. SIGTERM/SIGINT stop
every child (the averager releases its claim on the way out) so an interrupted job leaves only
committed or ignorable data behind.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxscale.lofi.progress import JobProgress
from jaxscale.runtime.distributed import worker_environment

# glibc's documented environment tunables (other C libraries ignore them), no code: glibc gives
# each of tensorstore's I/O threads a heap arena of its own, and the 1 MiB chunk buffers they
# free stay in it (its dynamic mmap threshold soon moves them from mmap onto the heap), so the
# averager's peak RSS grew by 40-90 MiB. Two arenas plus a fixed 512 KiB mmap threshold (every
# chunk and block buffer is an mmap, returned to the kernel when freed) keep it flat and below
# the old direct-I/O store's, at the cost of page faults: a slower round (bench/RESULTS.md).
AVERAGER_ENV = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "524288"}


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


    def worker_workdir(self, worker_id: int) -> str:
        return os.path.join(self.workdir, f"worker{worker_id}")

    def worker_argv(self, worker_id: int, python: str = sys.executable) -> list[str]:
        return [python, "-m", "jaxscale", "train", *self.train_flags,
                f"--workdir={self.worker_workdir(worker_id)}",
                f"--cpu_devices={self.devices_per_worker}",
                "--config.lofi.enabled=True", f"--config.lofi.store={self.store}",
                f"--config.lofi.worker_id={worker_id}",
                f"--config.lofi.num_workers={self.num_workers}",
                *_quorum(self.train_flags, self.num_workers)]

    def averager_argv(self, python: str = sys.executable, final: str | None = None) -> list[str]:
        argv = [python, "-m", "jaxscale", "lofi-average", f"--store={self.store}",
                f"--aggregator={self.aggregator}", f"--outer={self.outer}"]
        return argv + ([f"--final={final}"] if final else ["--watch"])


@dataclass
class Output:
    """The job's terminal: children's lines prefixed by who wrote them, and the progress line
    of `progress` whenever `show_progress` finds it changed (at most once a second)."""

    progress: JobProgress
    stream: object = sys.stdout
    lock: threading.Lock = field(default_factory=threading.Lock)

    def feed(self, prefix: str, text: str) -> None:
        with self.lock:
            self.stream.write(f"[{prefix}] {text.rstrip(chr(10))}\n")
            self.stream.flush()

    def show_progress(self) -> None:
        line = self.progress.poll()
        if line is not None:
            with self.lock:
                self.stream.write(line + "\n")
                self.stream.flush()


def _pump(prefix: str, proc: subprocess.Popen, output: Output) -> None:
    for line in proc.stdout:
        output.feed(prefix, line)


class _Children:
    """The job's processes. A signal only asks them to stop (SIGTERM, non-blocking, safe in a
    handler); `wait` polls, so it notices the request and SIGKILLs what outlives the grace."""

    def __init__(self, output: Output, grace_s: float = 20.0):
        self.output, self.procs, self.threads = output, [], []
        self.stopping, self.grace_s = 0, grace_s
        self.env = worker_environment()

    def start(self, argv: Sequence[str], prefix: str,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**self.env, **(env or {})})
        thread = threading.Thread(target=_pump, args=(prefix, proc, self.output), daemon=True)
        thread.start()
        self.procs.append(proc)
        self.threads.append(thread)
        self.output.feed("lofi", f"started {prefix} (pid {proc.pid})")
        return proc

    def request_stop(self, signum: int) -> None:
        self.stopping = signum
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()

    def wait(self, procs: Sequence[subprocess.Popen]) -> list[int]:
        """Exit codes of `procs`; if a stop was requested, of every child once all are gone.
        Shows the job's progress line while waiting, and once more at the end."""
        deadline, shown = None, 0.0
        while True:
            if time.monotonic() - shown >= 1.0:
                self.output.show_progress()
                shown = time.monotonic()
            if self.stopping:
                procs = self.procs
                deadline = deadline or time.monotonic() + self.grace_s
                if time.monotonic() > deadline:
                    for proc in procs:
                        if proc.poll() is None:
                            proc.kill()
            if all(p.poll() is not None for p in procs):
                self.output.show_progress()
                return [p.returncode for p in procs]
            time.sleep(0.1)


def run_local(job: LofiJob, periodic: bool) -> int:
    """Starts the workers (and, for periodic sync, a watching averager); returns an exit code.

    After the workers finish, one final averaging round is run with `--final` so the averaged
    model is left in the store and exported as a regular checkpoint under WORKDIR/final.
    SIGTERM / SIGINT stop every child and return 128 + the signal number.
    """
    workdirs = [job.worker_workdir(i) for i in range(job.num_workers)]
    children = _Children(Output(JobProgress(job.store, workdirs)))

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
    watcher = children.start(job.averager_argv(), "avg", AVERAGER_ENV) if periodic else None
    codes = children.wait(workers)
    if watcher is not None:
        watcher.terminate()
        children.wait([watcher])
    if children.stopping:
        return 1
    if any(codes):
        print(f"lofi_local: worker exit codes {codes}", file=sys.stderr)
        return 2 if set(codes) == {2} else 1  # every worker refused its input: a user error
    final = children.start(job.averager_argv(final=os.path.join(job.workdir, "final")), "avg",
                           AVERAGER_ENV)
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
                  shlex.join(["jaxscale", "train", *train_flags,
                              f"--workdir=runs/lofi_worker{i}", "--config.lofi.enabled=True",
                              f"--config.lofi.store={store}", f"--config.lofi.worker_id={i}",
                              f"--config.lofi.num_workers={num_workers}",
                              *_quorum(train_flags, num_workers)])]
    env = "".join(f"{k}={v} " for k, v in AVERAGER_ENV.items())
    averager = ["jaxscale", "lofi-average", f"--store={store}",
                f"--aggregator={aggregator}", f"--outer={outer}"]
    if periodic:
        lines += ["# any machine that reaches the store, while the workers run: the averager",
                  env + shlex.join(averager + ["--watch"])]
    lines += ["# after every worker has finished: the final average, exported for init_from",
              env + shlex.join(averager + ["--final=runs/lofi_final"])]
    return lines
