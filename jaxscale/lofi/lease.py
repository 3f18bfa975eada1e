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
import threading
import time

from jaxscale.lofi.kv import Store

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
            result = self.store.kv.read(self.key).result()
            value = bytes(result.value) if result.state == "value" else None
            if holder(value) != self.token_id:
                return  # released, or taken over by another averager
            self.store.kv.write(self.key, claim_value(self.token_id),
                                if_equal=result.stamp.generation).result()
