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
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any, NoReturn

PREEMPTED_EXIT = 75


class Preempted(Exception):
    """The run stopped for a pre-emption after saving; exit with `PREEMPTED_EXIT`. Not a
    `JaxscaleError`: nothing is wrong with the input, and it must not exit with status 2."""

    def __init__(self, step: int, saved: bool):
        where = "saved a checkpoint at that step" if saved else "nothing was saved (no workdir)"
        super().__init__(f"Pre-empted (SIGTERM): stopped after step {step} and {where}. "
                         "Run the same command again to resume.")
        self.step, self.saved = step, saved


def exit_preempted(error: Preempted) -> NoReturn:
    """What an entry point does with `Preempted`: says so and exits with `PREEMPTED_EXIT`."""
    print(f"jaxscale: {error}", file=sys.stderr, flush=True)
    sys.exit(PREEMPTED_EXIT)


def _distributed() -> bool:
    """Whether JAX's distributed runtime (and with it the pre-emption sync service) is up."""
    from jax._src import distributed  # the public API has no "is initialised" query
    return distributed.global_state.client is not None


class PreemptionWatch:
    """`with PreemptionWatch() as watch: ... if watch.reached(step): stop`.

    On a single process it installs a SIGTERM handler (restoring the previous one on exit; only
    possible on the main thread, elsewhere SIGTERM keeps its default action). With several
    processes it leaves SIGTERM to JAX's sync service and asks orbax at every step.
    """

    def __init__(self) -> None:
        self.signalled = threading.Event()
        self._previous: Any = None
        self._installed = False
        self.distributed = False

    def __enter__(self) -> "PreemptionWatch":
        self.distributed = _distributed()
        if not self.distributed and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        print("jaxscale: SIGTERM received: finishing this step, then saving and exiting",
              flush=True)
        self.signalled.set()

    def reached(self, step: int) -> bool:
        """True at the step where this process (and, multi-host, every process) must stop.
        Multi-host, every process must call it at every step (it is a sync protocol)."""
        if self.distributed:
            from orbax.checkpoint import multihost
            return multihost.reached_preemption(step)
        return self.signalled.is_set()
