"""The round claim as a lease: its holder renews it while alive, so a dead holder's claim
expires in `lease_s` (default 60 s, well under a worker's `lofi.sync_timeout_s` of 600 s)
instead of blocking the round for as long as a round could ever take.

The claim key is a lease (`jaxscale.storage.lease`, shared with a training run's bucket
workdir): {"time": last renewal, "token": the holder's id}, its time rewritten every
`lease_s / 4` by a background `Renewal` until the holder releases the claim or finds it taken
over (then the single create-if-absent COMMIT still decides which attempt is the round, so a
presumed-dead holder waking up damages nothing).
"""

from __future__ import annotations

import logging
import uuid

from jaxscale.storage.lease import age, holder, lease_value
from jaxscale.storage.lease import release as release_lease
from jaxscale.weights.kv import Store
from jaxscale.weights.snapshot import average_prefix, commit_key, committed_data

log = logging.getLogger("jaxscale.lofi")


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
    token = lease_value(uuid.uuid4().hex)
    if store.write(key, token, if_absent=True):
        return token
    value, generation = store.read_stamped(key)
    stopped = age(value)
    if store.read(commit_key(average_prefix(round_))) is not None or stopped < timeout_s:
        return None
    log.warning("taking over round %d from an averager that stopped %.0fs ago", round_, stopped)
    if not store.write(key, token, if_generation=generation):
        return None
    return token


def release(store: Store, round_: int, token: bytes, data: str) -> None:
    """Drops this averager's unpublished data and its claim (only if still ours). Data that
    the round's COMMIT names is never dropped, whatever interrupted this averager after it."""
    if committed_data(store, average_prefix(round_)) != data.rsplit("/", 1)[1]:
        store.delete_prefix(data)
    release_lease(store, f"{average_prefix(round_)}/CLAIM", str(holder(token)))
