"""Several local processes joined into one global mesh (CPU collectives), for testing
multi-host behaviour on one machine:

    jaxscale local-multihost --num_processes=2 --devices_per_process=4 -- <train flags>

Every process gets the same flags plus `--coordinator_address`, `--num_processes`,
`--process_id` and `--cpu_devices`; their output is interleaved under `[p0]`, `[p1]`, ...
prefixes. Only process 0 writes logs and metrics, so all may share one `--workdir`.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import ConfigError, exit_on_user_error, paragraph
from jaxscale.runtime.distributed import worker_environment
from jaxscale.runtime.preemption import PREEMPTED_EXIT

_N = flags.DEFINE_integer("num_processes", 2, "Processes to start.", lower_bound=1)
_DEV = flags.DEFINE_integer("devices_per_process", 4, "Simulated CPU devices per process.",
                            lower_bound=1)
_MODULE = flags.DEFINE_string(
    "module", "jaxscale.launch.train", "Entry point every process runs (`python -m MODULE`): "
    "jaxscale.launch.train, .evaluate, .generate or .inspect (`launch.NAME` from a checkout), or "
    "a module of your own that takes the multi-host flags.")
_GRACE = flags.DEFINE_float(
    "grace_s", 15.0, "After one process fails, seconds the others get to finish before they "
    "are stopped (they usually fail the same way and print why).")


MULTIHOST_ENTRY_POINTS = ("train", "evaluate", "generate", "inspect")  # take --process_id


def check_module(module: str) -> None:
    """Refuses a `--module` that `python -m` cannot run from this directory before any process
    starts: each would print the same import traceback. `find_spec` imports the parent
    packages, never the module itself (a package runs its `__main__`)."""
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())  # where `python -m` in the children looks first
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{module}.__main__")
    except Exception:  # a parent package missing or failing to import, a relative name
        spec = None
    finally:
        sys.path[:] = saved
    if spec is None:
        ours = ", ".join(f"jaxscale.launch.{name}" for name in MULTIHOST_ENTRY_POINTS)
        raise ConfigError(paragraph(
            f"--module={module} is no module `python -m` can run from {os.getcwd()}, so no",
            f"process was started. Give one of jaxscale's multi-host entry points ({ours}; the",
            "default is jaxscale.launch.train, and launch.NAME works from a checkout's root), or",
            "a module of your own, importable here or from PYTHONPATH, that takes",
            "--coordinator_address, --num_processes, --process_id and --cpu_devices."))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _pump(prefix: str, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"[{prefix}] {line}")
        sys.stdout.flush()


def run_group(commands: dict[str, Sequence[str]], grace_s: float) -> int:
    """Runs `commands` in parallel with prefixed output; 0 if all succeed, 75 if all stopped
    for a pre-emption (`jaxscale.runtime.preemption.PREEMPTED_EXIT`), else 1.

    Once one fails, the others are stopped after `grace_s`: a survivor would otherwise sit in
    the join or in a collective waiting for its dead peer until JAX's timeouts (minutes).
    SIGTERM sent to this launcher is passed on to every process, as a pre-empted machine
    would deliver it to each of its processes.
    """
    env = worker_environment()
    procs = {name: subprocess.Popen(list(argv), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=env)
             for name, argv in commands.items()}
    pumps = [threading.Thread(target=_pump, args=(name, p), daemon=True)
             for name, p in procs.items()]
    for t in pumps:
        t.start()
    signal.signal(signal.SIGTERM, lambda *_: [p.send_signal(signal.SIGTERM)
                                              for p in procs.values() if p.poll() is None])
    deadline, stopped = None, []
    try:
        while None in (polled := [p.poll() for p in procs.values()]):  # poll all: reaps
            if deadline is None and any(polled):
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                stopped = [n for n, p in procs.items() if p.poll() is None]
                break
            time.sleep(0.1)
    finally:  # also on Ctrl-C: never leave processes behind
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            p.wait()
        for t in pumps:
            t.join()
    codes = {n: p.returncode for n, p in procs.items() if n not in stopped}
    if not stopped and set(codes.values()) == {PREEMPTED_EXIT}:
        return PREEMPTED_EXIT
    failed = {n: c for n, c in codes.items() if c}
    if failed:
        print(f"local_multihost: failed processes (exit codes): {failed}"
              + (f"; stopped {stopped} {grace_s:g}s later" if stopped else ""), file=sys.stderr)
    if failed and not stopped and set(codes.values()) == {2}:
        return 2  # every process refused its input: a user error, said by each
    return 1 if failed else 0


@exit_on_user_error
def main(argv: list[str]) -> None:
    cli.refuse_device_flag(argv[1:], f"--devices_per_process={_DEV.value}")
    check_module(_MODULE.value)
    address = f"localhost:{_free_port()}"
    commands = {f"p{i}": [sys.executable, "-m", _MODULE.value, *argv[1:],
                          f"--coordinator_address={address}",
                          f"--num_processes={_N.value}", f"--process_id={i}",
                          f"--cpu_devices={_DEV.value}"] for i in range(_N.value)}
    raise SystemExit(run_group(commands, _GRACE.value))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
