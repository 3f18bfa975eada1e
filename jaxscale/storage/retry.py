"""Bounded retries of Lo-Fi store operations across an object-store outage.

Why: Lo-Fi workers and the averager run for days against a bucket, and buckets have bad
minutes (a restarting S3 gateway, a network partition, throttling). tensorstore retries each
HTTP request itself, but with its defaults (32 attempts, up to 32 s apart) a dead endpoint
looks like a hang for a quarter of an hour, and when it does give up the error would reach
code that reads any failed read as a damaged snapshot, dropping a healthy worker's push or
falling back from a healthy average. So: tensorstore's own retries are cut to a few seconds
(`REQUEST_RETRIES`, in `weights/kv.py`'s context), and this module retries the whole operation with
exponential backoff for up to `config.storage.retry_s` (`--store_retry_s` for the averager)
measured from the start of the outage. It logs once when an outage begins and once when it
ends, and on exhaustion raises `StoreUnavailable`, one paragraph naming the location and the
fix, which no caller mistakes for damaged data. Only transient failures are retried
(connection errors, time-outs, 5xx and throttling); a checksum mismatch or a missing object is
a fact about the data and goes straight to the caller. A training run's workdir on a bucket
(checkpoints, metrics.jsonl, TensorBoard events) follows the same policy through
`for_workdir`: one outage clock per bucket, whichever file meets the outage first, and on
exhaustion a paragraph that ends with the command that resumes the run. Every attempt waits at most
`config.storage.timeout_s` (plus time for its bytes at `MIN_BYTES_PER_S`), so a server that
accepts connections and then stalls is an outage too, not a hang. Local and memory:// stores
are not retried.
"""

from __future__ import annotations

import logging
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from jaxscale.errors import paragraph, short_error
from jaxscale.storage import locations

log = logging.getLogger("jaxscale.lofi")
T = TypeVar("T")

# tensorstore's per-request retries for s3 and gcs (context resources): a few seconds in all.
REQUEST_RETRIES = {"max_retries": 3, "initial_delay": "0.25s", "max_delay": "2s"}
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.5, 10.0
# A transfer's time limit grows with its size, as if the link did at least this much: a slow
# but moving link is not an outage (a 512 MiB leaf read gets timeout_s + 128 s).
MIN_BYTES_PER_S = 4 << 20
# tensorstore's words for "the server did not answer properly", as opposed to "the data is bad".
_TRANSIENT = re.compile(
    r"retry attempts failed|UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|CURL error|"
    r"Could not connect|Connection (refused|reset)|timed? ?out|HTTP response code: (429|5\d\d)",
    re.IGNORECASE)
# The same, as s3fs / botocore / aiohttp spell it (the files orbax writes through etils.epath).
_OUTAGE_TEXT = re.compile(_TRANSIENT.pattern + r"|ServiceUnavailable|SlowDown|InternalError|"
                          r"Could not connect to the endpoint|Connect timeout|Read timeout",
                          re.IGNORECASE)
_CONNECTION_ERRORS = {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                      "ConnectionClosedError", "ClientConnectorError", "ServerDisconnectedError",
                      "ClientOSError"}  # botocore / aiohttp class names (neither is imported)


class StoreUnavailable(locations.StorageError):
    """The store did not answer for longer than the retry budget (not a damaged snapshot)."""


def is_transient(error: BaseException) -> bool:
    return isinstance(error, TimeoutError) or (
        isinstance(error, ValueError) and bool(_TRANSIENT.search(str(error))))


def is_outage(error: BaseException | None) -> bool:
    """Whether `error`, or an error it wraps, says the store did not answer: tensorstore's
    transient errors, and connection errors and 5xx/throttling from s3fs/botocore/aiohttp (orbax
    writes a step's metadata and commit file through etils.epath, not tensorstore)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        names = {t.__name__ for t in type(error).__mro__}
        if (is_transient(error) or isinstance(error, ConnectionError)
                or names & _CONNECTION_ERRORS or _OUTAGE_TEXT.search(str(error))):
            return True
        error = error.__cause__ or error.__context__
    return False


class Retry:
    """The retry policy of one store; one outage clock shared by every thread using it.
    `kind` names the store in the log lines; `transient` tells an outage from a fact about the
    data; `advice(what, budget, cause)` is the paragraph raised when the budget is spent."""

    def __init__(self, location: str, kind: str = "Lo-Fi store",
                 transient: Callable[[BaseException], bool] = is_transient,
                 advice: Callable[[str, float, str], str] | None = None,
                 logger: logging.Logger = log):
        self.location, self.kind, self._log = location, kind, logger
        self.enabled = locations.is_remote(location)
        self._transient, self._advice = transient, advice
        self._lock = threading.Lock()
        self._down_since: float | None = None   # monotonic time the current outage began
        self._cause = ""

    def call(self, what: str, op: Callable[[float | None], T], nbytes: int = 0) -> T:
        """`op(timeout_s)` (which waits on its tensorstore future for at most `timeout_s`),
        retried across transient failures until the outage is older than the budget;
        `nbytes`: what the operation transfers (a longer time limit for larger transfers)."""
        if not self.enabled:
            return op(None)
        delay = FIRST_BACKOFF_S
        while True:
            try:
                result = op(locations.settings().timeout_s + nbytes / MIN_BYTES_PER_S)
            except Exception as e:  # classified just below
                if not self._transient(e):
                    raise
                waited = self._failed(what, e)
                budget = locations.settings().retry_s
                if waited >= budget:
                    raise self._exhausted(what, budget) from None
                time.sleep(min(delay, budget - waited))
                delay = min(2 * delay, MAX_BACKOFF_S)
                continue
            self._succeeded()
            return result

    def future(self, what: str, start: Callable[[], Any], nbytes: int = 0) -> "RetryingFuture":
        """A future of `start()` (begun now, so it overlaps the caller's work) whose `result`
        retries by calling `start()` again."""
        return RetryingFuture(self, what, start, nbytes)

    def _failed(self, what: str, error: Exception) -> float:
        with self._lock:
            now = time.monotonic()
            if self._down_since is None:
                self._down_since, self._cause = now, short_error(error)
                self._log.warning("%s %s did not answer (%s while %s); retrying for up to %.0f s "
                            "(config.storage.retry_s)", self.kind, self.location, self._cause,
                            what, locations.settings().retry_s)
            return now - self._down_since

    def _succeeded(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            if self._down_since is not None:
                self._log.warning("%s %s answers again after %.1f s; continuing", self.kind,
                            self.location, time.monotonic() - self._down_since)
                self._down_since = None

    def _exhausted(self, what: str, budget: float) -> StoreUnavailable:
        if self._advice is not None:
            return StoreUnavailable(self._advice(what, budget, self._cause))
        return StoreUnavailable(paragraph(
            f"The Lo-Fi store {self.location} has not answered for {budget:.0f} s (while",
            f"{what}; first error: {self._cause}). Nothing partial was published: a snapshot",
            "becomes visible only through its COMMIT, written last. Check that the endpoint",
            f"({locations.endpoint_of(self.location)}) is up and reachable from this machine,",
            "then restart this process (a worker resumes from its checkpoint, the averager from",
            "the store), or allow longer outages with config.storage.retry_s (workers) or",
            "--store_retry_s (launch.lofi_average).",
        ))


class RetryingFuture:
    """A started tensorstore read or write that is re-issued if it fails transiently."""

    def __init__(self, retry: Retry, what: str, start: Callable[[], Any], nbytes: int = 0):
        self._retry, self._what, self._start, self._nbytes = retry, what, start, nbytes
        try:
            self._first: Any = start()
        except Exception as e:  # re-raised (or retried) by result()
            self._first = e

    def result(self) -> Any:
        def attempt(timeout_s: float | None) -> Any:
            first, self._first = self._first, None
            if isinstance(first, Exception):
                raise first
            return (first or self._start()).result(timeout=timeout_s)
        return self._retry.call(self._what, attempt, self._nbytes)


_WORKDIRS: dict[str, Retry] = {}
_WORKDIRS_LOCK = threading.Lock()


def for_workdir(location: str) -> Retry:
    """The retry policy of a training run's files under `location` (checkpoints, metrics.jsonl,
    TensorBoard events): one per bucket, so an outage is one clock and one pair of log lines
    whichever file meets it first. Disabled for local paths."""
    loc = locations.parse(location)
    root = f"{loc.scheme}://{loc.bucket}" if loc.remote else loc.url()
    with _WORKDIRS_LOCK:
        if root not in _WORKDIRS:
            _WORKDIRS[root] = Retry(root, "workdir store", is_outage, _workdir_advice(root),
                                    logging.getLogger("jaxscale.storage"))
        return _WORKDIRS[root]


def _workdir_advice(root: str) -> Callable[[str, float, str], str]:
    def advice(what: str, budget: float, cause: str) -> str:
        return paragraph(
            f"The workdir's store {root} has not answered for {budget:.0f} s (while {what};",
            f"first error: {cause}). Nothing complete was lost: a checkpoint step counts only",
            "once its commit file is written, and metrics.jsonl is replaced whole by each",
            f"write. Check that the endpoint ({locations.endpoint_of(root)}) is up and",
            "reachable from this machine, then run the same command again to resume from the",
            f"last complete checkpoint: {resume_command()} ; or ride out longer outages with a",
            "larger config.storage.retry_s.",
        )
    return advice


def resume_command() -> str:
    """The command line of this process, as a shell would take it (the same command resumes)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name.removesuffix(".__main__")
        return shlex.join([sys.executable, "-m", module, *sys.argv[1:]])
    if sys.argv and sys.argv[0].endswith(".py"):
        return shlex.join([sys.executable, *sys.argv])
    return shlex.join(sys.argv)
