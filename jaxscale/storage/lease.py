"""A lease on one key of a key-value store: a create-if-absent value naming its holder and the
time it was last renewed, which the holder rewrites while alive, so a dead holder's lease
expires in `lease_s` (default 60 s) instead of blocking its key for good.

Two users: a Lo-Fi averager's round claim (`jaxscale.lofi.lease`) and a training run's bucket
workdir (`jaxscale.train.workdir_lock`). The value is JSON: {"time": last renewal, "token":
the holder's id, ...anything the user records (host, pid, start)}. `Renewal` rewrites the time
every `lease_s / 4` by compare-and-swap, keeping the rest, and stops when the holder releases
the lease or finds it taken over. Any store with `read_stamped(key)` and `write(key, data,
if_absent=..., if_generation=...)` will do (`jaxscale.weights.kv.Store`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Protocol

log = logging.getLogger("jaxscale.lease")
DEFAULT_LEASE_S = 60.0


class KeyValue(Protocol):
    """What a lease needs of a store (`jaxscale.weights.kv.Store` has it)."""

    def read_stamped(self, key: str) -> tuple[bytes | None, bytes]: ...

    def write(self, key: str, data: bytes | None, if_absent: bool = False,
              if_generation: bytes | None = None) -> bool: ...


def lease_value(token: str, **fields: Any) -> bytes:
    """A lease held by `token` renewed now, with `fields` recorded beside it."""
    return json.dumps({**fields, "time": time.time(), "token": token}).encode()


def fields(value: bytes | None) -> dict:
    """The lease's recorded fields ({} if absent or unreadable)."""
    try:
        got = json.loads(value or b"{}")
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


def holder(value: bytes | None) -> str | None:
    """The token a lease value names (None if unreadable)."""
    token = fields(value).get("token")
    return None if token is None else str(token)


def age(value: bytes | None) -> float:
    """Seconds since the lease was last renewed (infinite if unreadable)."""
    try:
        return time.time() - float(fields(value).get("time", "x"))
    except (TypeError, ValueError):
        return float("inf")


def renewed(value: bytes | None) -> bytes:
    """`value` with its time set to now, every other field kept."""
    return json.dumps({**fields(value), "time": time.time()}).encode()


def release(store: KeyValue, key: str, token: str) -> bool:
    """Deletes the lease at `key` if `token` still holds it; returns whether it did."""
    value, generation = store.read_stamped(key)
    if holder(value) != token:  # taken over (or gone): the new holder's now
        return False
    return store.write(key, None, if_generation=generation)


class Renewal:
    """Renews the lease at `key` held by `token` every `lease_s / 4` until `stop()` (or the
    block's end): a daemon thread, so it never keeps a process alive."""

    def __init__(self, store: KeyValue, key: str, token: str, lease_s: float):
        self.store, self.key, self.token = store, key, token
        self.period = max(lease_s / 4, 0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"lease {key}")

    def start(self) -> "Renewal":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> "Renewal":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                value, generation = self.store.read_stamped(self.key)
                if holder(value) != self.token:
                    return  # released, or taken over
                self.store.write(self.key, renewed(value), if_generation=generation)
            except Exception as e:  # an outage: the holder's own I/O reports it
                log.debug("lease renewal of %s failed (%s); trying again", self.key, e)
