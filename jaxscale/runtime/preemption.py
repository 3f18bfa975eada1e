"""Pre-emption: on SIGTERM every process finishes its step, saves at the same step, and exits.

Cloud schedulers announce a pre-emption (a spot/preemptible TPU VM or GPU node being taken back,
SLURM's time limit with `--signal`) with SIGTERM and a short grace period. The loop then stops
at a step boundary: the checkpoint hook saves the state at that step, the loggers close, and
the command exits with `PREEMPTED_EXIT` (75, sysexits' EX_TEMPFAIL: "try again later"), which
differs from a success (0), a user error (2) and a crash (1 or a signal's 128+N), so a wrapper
script can relaunch exactly when it should. The relaunched command resumes from that checkpoint.

Every host must save at the same step, or the hosts' shards of one checkpoint would not match.
With several processes, JAX's distributed runtime already runs a pre-emption sync service: it
catches SIGTERM itself, tells the other processes, and agrees on a step (one past the largest
step any host had reached); orbax's `CheckpointManager.reached_preemption(step)` (JAX's
`multihost_utils.reached_preemption_sync_point`) answers True on every host at that same step.
A single process has no such service, so a Python SIGTERM handler sets a flag that the loop
reads after the current step.

Before the loop starts (flags, devices, data index, a checkpoint restoring, the step compiling)
there is nothing to save, yet SIGTERM's default action would end the process with 143, which a
relaunch loop reads as a crash. `StartupGuard` (entered by `launch.train` before anything slow)
exits with `PREEMPTED_EXIT` at once instead, until the loop's `PreemptionWatch` takes over.
"At once" matters: a Python handler runs only when the main thread returns to Python, which a
compile can delay for minutes past the grace period, so the signal also wakes a thread through
`signal.set_wakeup_fd` and that thread exits the process.

Ctrl-C (SIGINT) on a single process is a user's stop, handled the same way: the first one
finishes the step, saves and exits with `INTERRUPTED_EXIT` (130, the shell's 128 + SIGINT, so a
relaunch loop that restarts on 75 does not restart a run its user stopped); a second Ctrl-C
stops at once without saving. Before the first step a Ctrl-C exits 130 at once, as SIGTERM does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, NoReturn

from jaxscale.runtime.distributed import coordination_client

PREEMPTED_EXIT = 75
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C

_WHAT = {signal.SIGTERM: "Pre-empted (SIGTERM)", signal.SIGINT: "Stopped by Ctrl-C (SIGINT)"}


class Preempted(Exception):
    """The run stopped for a pre-emption (or a Ctrl-C) after saving; exit with `exit_code`.
    Not a `JaxscaleError`: nothing is wrong with the input, and it must not exit with 2."""

    def __init__(self, step: int, saved: bool, signum: int = signal.SIGTERM):
        where = "saved a checkpoint at that step" if saved else "nothing was saved (no workdir)"
        super().__init__(f"{_WHAT[signum]}: stopped after step {step} and {where}. "
                         "Run the same command again to resume.")
        self.step, self.saved = step, saved
        self.exit_code = INTERRUPTED_EXIT if signum == signal.SIGINT else PREEMPTED_EXIT


def exit_preempted(error: Preempted) -> NoReturn:
    """What an entry point does with `Preempted`: says so and exits with its `exit_code`."""
    print(f"jaxscale: {error}", file=sys.stderr, flush=True)
    sys.exit(error.exit_code)


def _distributed() -> bool:
    """Whether JAX's distributed runtime (and with it the pre-emption sync service) is up."""
    return coordination_client() is not None


class PreemptionWatch:
    """`with PreemptionWatch() as watch: ... if watch.reached(step): stop`.

    On a single process it installs SIGTERM and SIGINT handlers (restoring the previous ones on
    exit; only possible on the main thread, elsewhere both keep their default actions). With
    several processes it leaves SIGTERM to JAX's sync service and asks orbax at every step;
    a Ctrl-C there reaches every process of the terminal's group and stops them unsaved.
    """

    def __init__(self) -> None:
        self.signalled = threading.Event()
        self.signum: int = signal.SIGTERM  # which signal asked the loop to stop
        self._previous: dict[int, Any] = {}
        self.distributed = False

    def __enter__(self) -> "PreemptionWatch":
        _loop_began.set()  # a StartupGuard stands aside: SIGTERM now means "save, then stop"
        self.distributed = _distributed()
        if not self.distributed and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal)
                              for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            print("jaxscale: Ctrl-C: finishing this step, then saving and exiting (Ctrl-C "
                  "again stops at once, without saving)", flush=True)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the second one
        else:
            print("jaxscale: SIGTERM received: finishing this step, then saving and exiting",
                  flush=True)
        if not self.signalled.is_set():
            self.signum = signum
        self.signalled.set()

    def reached(self, step: int) -> bool:
        """True at the step where this process (and, multi-host, every process) must stop.
        Multi-host, every process must call it at every step (it is a sync protocol)."""
        if self.distributed:
            from orbax.checkpoint import multihost
            return multihost.reached_preemption(step)
        return self.signalled.is_set()


_loop_began = threading.Event()  # set when a training loop's PreemptionWatch is entered


def _exit_at_startup(signum: int) -> None:
    """Says so and exits now. `os.write`, not `print`: the main thread may hold stderr's lock
    (blocked in a write), and this may run on the wakeup thread beside it."""
    os.write(2, f"jaxscale: {_WHAT[signum]} during start-up, before the first step: nothing "
                "needed saving and the workdir is as it was. Run the same command again to "
                "resume.\n".encode())
    os._exit(INTERRUPTED_EXIT if signum == signal.SIGINT else PREEMPTED_EXIT)


_STOPS = (signal.SIGTERM, signal.SIGINT)


class StartupGuard:
    """`with StartupGuard(): set up and train`: a SIGTERM (or Ctrl-C) before the loop's first
    step exits with `PREEMPTED_EXIT` (`INTERRUPTED_EXIT`) at once, even inside a long compile or
    restore. Single process only (`enabled=False` for a multi-host run, whose SIGTERM belongs
    to JAX's sync service once it joins), on the main thread only. Once the loop's
    `PreemptionWatch` has been entered, the guard stands aside; after the loop (its watch
    restored these handlers) both signals have their default actions again, as they had
    before this guard existed."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self._previous: dict[int, Any] = {}
        self._old_fd = -1
        self._write_fd = -1

    def __enter__(self) -> "StartupGuard":
        if not self.enabled:
            return self
        _loop_began.clear()
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = {s: signal.signal(s, self._on_signal) for s in _STOPS}
        self._old_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._wake_on_signal, args=(read_fd,), daemon=True,
                         name="sigterm-at-start-up").start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        signal.set_wakeup_fd(self._old_fd)
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        os.close(self._write_fd)  # the thread reads end-of-file and ends

    def _wake_on_signal(self, read_fd: int) -> None:
        """Runs beside a main thread stuck in C++: the C-level handler writes the signal number
        to the wakeup fd at once."""
        with os.fdopen(read_fd, "rb", buffering=0) as wake:
            while data := wake.read(64):
                for signum in _STOPS:
                    if signum in data and not _loop_began.is_set():
                        _exit_at_startup(signum)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not _loop_began.is_set():
            _exit_at_startup(signum)
        if signum == signal.SIGINT:  # after the loop: the default action
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
