"""The round claim as a lease: its holder renews it while alive, so a dead holder's claim
expires in `lease_s` (default 60 s, well under a worker's `lofi.sync_timeout_s` of 600 s)
instead of blocking the round for as long as a round could ever take.

The claim key holds {"time": last renewal, "token": the holder's id}. A background thread
rewrites the time every `lease_s / 4` by compare-and-swap, and stops when the holder releases
the claim or finds it taken over (then the single create-if-absent COMMIT still decides which
attempt is the round, so a presumed-dead holder waking up damages nothing).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

from jaxscale.weights.kv import Store
from jaxscale.weights.snapshot import average_prefix, commit_key, committed_data

log = logging.getLogger("jaxscale.lofi")
DEFAULT_LEASE_S = 60.0


def claim_value(token_id: str) -> bytes:
    return json.dumps({"time": time.time(), "token": token_id}).encode()


def holder(value: bytes | None) -> str | None:
    """The token id a claim value names (None if unreadable)."""
    try:
        return str(json.loads(value or b"{}").get("token"))
    except (ValueError, AttributeError):
        return None


class Renewal:
    """Renews the claim at `key` for `token_id` every `lease_s / 4` until `stop()`."""

    def __init__(self, store: Store, key: str, token_id: str, lease_s: float):
        self.store, self.key, self.token_id = store, key, token_id
        self.period = max(lease_s / 4, 0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"lease {key}")

    def __enter__(self) -> "Renewal":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                value, generation = self.store.read_stamped(self.key)
                if holder(value) != self.token_id:
                    return  # released, or taken over by another averager
                self.store.write(self.key, claim_value(self.token_id),
                                 if_generation=generation)
            except Exception as e:  # an outage: the averager's own I/O reports it
                log.debug("claim renewal of %s failed (%s); trying again", self.key, e)


def claim(store: Store, round_: int, timeout_s: float) -> bytes | None:
    """Claims a round so racing averagers publish it only once; returns the claim's token.

    The claim is a create-if-absent key holding a token and its time, renewed by its holder
    while alive (`Renewal`); a claim not renewed for `timeout_s` whose round never committed
    (its averager died) is taken over by compare-and-swap. Nothing of the dead averager is
    deleted: a presumed-dead averager that wakes up cannot damage the round either, since each
    attempt writes only its own directory and the single create-if-absent COMMIT decides which
    attempt is the round.
    """
    key = f"{average_prefix(round_)}/CLAIM"
    token = claim_value(uuid.uuid4().hex)
    if store.write(key, token, if_absent=True):
        return token
    value, generation = store.read_stamped(key)
    try:
        age = time.time() - float(json.loads(value or b"{}").get("time", 0))
    except (ValueError, AttributeError):
        age = float("inf")
    if store.read(commit_key(average_prefix(round_))) is not None or age < timeout_s:
        return None
    log.warning("taking over round %d from an averager that stopped %.0fs ago", round_, age)
    if not store.write(key, token, if_generation=generation):
        return None
    return token


def release(store: Store, round_: int, token: bytes, data: str) -> None:
    """Drops this averager's unpublished data and its claim (only if still ours). Data that
    the round's COMMIT names is never dropped, whatever interrupted this averager after it."""
    if committed_data(store, average_prefix(round_)) != data.rsplit("/", 1)[1]:
        store.delete_prefix(data)
    key = f"{average_prefix(round_)}/CLAIM"
    value, generation = store.read_stamped(key)
    if holder(value) == holder(token):  # renewed since: same holder, newer time
        store.write(key, None, if_generation=generation)
