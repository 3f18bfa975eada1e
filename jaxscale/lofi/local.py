"""Runs a whole Lo-Fi job on one machine: N worker processes (each its own simulated mesh) plus
the averager, with their output interleaved under `[w0]`/`[avg]` prefixes.

Used by `python -m launch.lofi_local`; the same commands, one worker per TPU VM with a shared
`gs://` store, are what `lofi_vm_commands` prints for a real deployment.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass


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
                f"--config.lofi.num_workers={self.num_workers}"]

    def averager_argv(self, python: str = sys.executable, final: str | None = None) -> list[str]:
        argv = [python, "-m", "launch.lofi_average", f"--store={self.store}",
                f"--aggregator={self.aggregator}", f"--min_workers={self.num_workers}",
                f"--outer={self.outer}"]
        return argv + ([f"--final={final}"] if final else ["--watch"])


def _pump(prefix: str, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"[{prefix}] {line}")
        sys.stdout.flush()


def _start(argv: Sequence[str], prefix: str, env: dict) -> tuple[subprocess.Popen, threading.Thread]:
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    thread = threading.Thread(target=_pump, args=(prefix, proc), daemon=True)
    thread.start()
    return proc, thread


def run_prefixed(commands: dict[str, Sequence[str]]) -> int:
    """Runs commands in parallel with prefixed output; non-zero if any fails."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    procs = {name: _start(argv, name, env) for name, argv in commands.items()}
    codes = {name: p.wait() for name, (p, _) in procs.items()}
    for _, t in procs.values():
        t.join()
    failed = {n: c for n, c in codes.items() if c}
    if failed:
        print(f"failed processes (exit codes): {failed}", file=sys.stderr)
    return 1 if failed else 0


def run_local(job: LofiJob, periodic: bool) -> int:
    """Starts the workers (and, for periodic sync, a watching averager); returns an exit code.

    After the workers finish, one final averaging round is run with `--final` so the averaged
    model is left in the store and exported as a regular checkpoint under WORKDIR/final.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)  # each worker sets its own simulated device count
    workers = [_start(job.worker_argv(i), f"w{i}", env) for i in range(job.num_workers)]
    watcher = _start(job.averager_argv(), "avg", env) if periodic else None
    codes = [p.wait() for p, _ in workers]
    for _, t in workers:
        t.join()
    if watcher is not None:
        watcher[0].terminate()
        watcher[0].wait()
    if any(codes):
        print(f"lofi_local: worker exit codes {codes}", file=sys.stderr)
        return 1
    final_dir = os.path.join(job.workdir, "final")
    proc, thread = _start(job.averager_argv(final=final_dir), "avg", env)
    code = proc.wait()
    thread.join()
    return code


def lofi_vm_commands(store: str, num_workers: int, train_flags: Sequence[str]) -> list[str]:
    """The command to run on TPU VM number i: one independent worker per VM, a shared store."""
    return [shlex.join(["python", "-m", "launch.train", *train_flags,
                        f"--workdir=$HOME/lofi/worker{i}", "--config.lofi.enabled=True",
                        f"--config.lofi.store={store}", f"--config.lofi.worker_id={i}",
                        f"--config.lofi.num_workers={num_workers}"])
            for i in range(num_workers)]
