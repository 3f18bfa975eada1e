"""One process of a multi-process run fails: every process stops within seconds, each naming
the process that failed and its error.

What used to happen (measured with tests/fault_worker.py's `--fault=raise`: process 1 of 2
raising a plain error after step 3): process 1 printed its traceback and, at exit, waited in
JAX's shutdown barrier for process 0, which waited for process 1 in the next step's collective.
After JAX's 300 s shutdown timeout both aborted (SIGABRT) with pages of coordination-service
logs and thread dumps. On a pod nothing else ends it (locally, the launcher's grace period did);
a reward function or a data file that fails on one host is enough.

Now (`together`, around an entry point's work): the failing process publishes its error, in one
line, under `jaxscale/failed/<process>` in the coordination service's key-value store, prints
it as usual, and leaves through JAX's shutdown barrier. Every other process has a thread that
polls that directory every `POLL_S`; seeing a failure, it gives its own main thread `GRACE_S`
(an error raised on every process, a NaN loss say, is then reported by each for itself), then
prints one paragraph naming the failed process and its error, joins the shutdown barrier and
exits with status 2. Every process thus leaves through the barrier at about the same time: no
abort, no coordination-service noise. The barrier is waited for at most `SHUTDOWN_S`, so a
process that never comes (killed, hung in C++) does not hold the others longer than that.

Errors that every process raises at once by agreement (`errors.EveryProcessError`, such as a
persistent save that failed somewhere, and a pre-emption's `Preempted`) are not published: each
process reports its own. What was committed stays: a step still being written is never renamed
into place, and the same command resumes from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from jaxscale.errors import EveryProcessError, JaxscaleError, paragraph, report, short_error
from jaxscale.runtime.distributed import jax_state
from jaxscale.runtime.preemption import Preempted

KEYS = "jaxscale/failed/"
POLL_S = 1.0  # how often each process looks for a peer's failure
GRACE_S = 10.0  # the time a process's own main thread gets to fail by itself
SHUTDOWN_S = 60.0  # the longest wait for the others in JAX's shutdown barrier
STOPPED_EXIT = 2  # as every user-facing error (`errors.exit_on_user_error`)


def _joined() -> Any:
    """JAX's distributed state (its coordination-service client, process index and count), or
    None outside a multi-process run."""
    state = jax_state()
    joined = getattr(state, "client", None) is not None and (state.num_processes or 1) > 1
    return state if joined else None


@contextlib.contextmanager
def together() -> Iterator[None]:
    """Runs the block; on a multi-process run, one process's failure stops every process
    (module docstring). A no-op for a single process."""
    state = _joined()
    if state is None:
        yield
        return
    watch = _Watch(state.client, state.process_id, state.num_processes)
    watch.thread.start()
    try:
        yield
    except Exception as error:
        if watch.stand_down() and not isinstance(error, (EveryProcessError, Preempted)):
            watch.publish(error)
            _leave(report(error))
        raise  # every process reports it itself; or the watch is stopping this process
    finally:
        if not watch.stand_down():  # the watch is stopping this process for a peer: an error
            watch.thread.join()  # of its own now (a collective losing that peer) stays unsaid


class _Watch:
    """The thread that stops this process when another one fails."""

    def __init__(self, client: Any, me: int, count: int):
        self.client, self.me, self.count = client, me, count
        self.done = threading.Event()  # this process finished or failed by itself
        self.lock = threading.Lock()  # whoever takes it first reports: this thread or main
        self.thread = threading.Thread(target=self._watch, name="peer-failure", daemon=True)

    def stand_down(self) -> bool:
        """Stops the watch; False if it is already stopping this process for a peer."""
        if self.done.is_set():
            return True
        if not self.lock.acquire(blocking=False):
            return False
        self.done.set()
        self.lock.release()
        self.thread.join()
        return True

    def publish(self, error: Exception) -> None:
        text = (str(error) if isinstance(error, JaxscaleError) else
                f"{type(error).__name__}: {short_error(error)}")
        with contextlib.suppress(Exception):  # the service is gone: nobody left to tell
            self.client.key_value_set(f"{KEYS}{self.me}", text)

    def _failed(self) -> dict[int, str]:
        try:
            entries = self.client.key_value_dir_get(KEYS)
        except Exception:  # the service is gone: JAX's own error polling stops this process
            return {}
        failed = {int(key.rsplit("/", 1)[1]): text for key, text in entries}
        failed.pop(self.me, None)
        return failed

    def _watch(self) -> None:
        while not self.done.wait(POLL_S):
            failed = self._failed()
            if not failed or self.done.wait(GRACE_S) or not self.lock.acquire(blocking=False):
                continue
            if self.done.is_set():  # failed or finished by itself while we looked
                self.lock.release()
                return
            print(f"jaxscale: error: {stopped_message(failed, self.me, self.count)}",
                  file=sys.stderr, flush=True)
            _leave(STOPPED_EXIT)


def stopped_message(failed: dict[int, str], me: int, count: int) -> str:
    first = min(failed)
    others = sorted(failed)[1:]
    also = (f" (process{'es' if len(others) > 1 else ''} {', '.join(map(str, others))} failed"
            " too)" if others else "")
    return paragraph(
        f"Process {first} of {count} failed{also}: {failed[first].rstrip('.')}. Process {me}",
        "stopped with it instead of waiting for it in the next collective (where the run would",
        "hang until JAX's shutdown timeout, then abort); that process's own log has the whole",
        "error. Fix its cause and run the same command again: a training run resumes from its",
        "newest checkpoint.")


def _leave(code: int) -> None:
    """Exits with `code` once every process has reached JAX's shutdown barrier (at most
    `SHUTDOWN_S`), skipping the interpreter's exit: its wait for threads (orbax's commit of a
    step that is now abandoned) could block on the peers."""
    import jax
    sys.stdout.flush()
    sys.stderr.flush()
    barrier = threading.Thread(target=jax.distributed.shutdown, daemon=True)
    barrier.start()
    barrier.join(SHUTDOWN_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
