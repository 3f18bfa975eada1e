"""Ways forward past a damaged checkpoint: the previous one that still verifies.

A committed checkpoint can turn out unusable after its commit (a flipped bit on disk, a lost
or rewritten file). Nobody may overwrite a committed round, so instead:

- the averager builds the next round on the newest average that verifies (`base_and_damaged`,
  `verify`): its candidates are then each worker's newest push since that average, which
  recomputes the damaged round from its inputs where those are intact (and `note` says which
  of the two happened);
- a worker loads the newest average whose data verifies (`readable_average`), and restarts from
  its own newest push that verifies (`own_push`), warning about each one it passes over.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from jaxscale.errors import paragraph
from jaxscale.lofi.store import worker_prefix
from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import StoreError
from jaxscale.weights.snapshot import (
    Snapshot,
    average_prefix,
    average_rounds,
    load_snapshot,
    read_params,
    read_range,
)

log = logging.getLogger("jaxscale.lofi")
_VERIFIED: set[tuple[str, str]] = set()   # (store, data directory) read back whole, this process


class BaseDamaged(StoreError):
    """The round's base average does not verify: the round must be built on an older one."""


def base_and_damaged(store: Store, damaged: dict[int, str]) -> tuple[Snapshot | None, int]:
    """(the newest committed average that loads and is not in `damaged`, the newest committed
    round number). Rounds passed over are added to `damaged` with the reason."""
    rounds = average_rounds(store)
    for round_ in reversed(rounds):
        if round_ in damaged:
            continue
        try:
            return load_snapshot(store, average_prefix(round_)), rounds[-1]
        except StoreError as e:
            damaged[round_] = str(e)
    return None, rounds[-1] if rounds else -1


def verify(store: Store, ckpt: Snapshot) -> None:
    """Reads every chunk of `ckpt` against its checksums (once per process): an idle averager
    checks the newest average, so a damaged one is replaced even when no push is new."""
    key = (store.location, ckpt.data)
    if key in _VERIFIED:
        return
    try:
        for leaf, entry in ckpt.leaves.items():
            size, step = math.prod(entry["shape"]), 64 * ckpt.chunk
            for a in range(0, size, step):
                read_range(store, ckpt, leaf, a, min(a + step, size))
    except StoreError as e:
        raise BaseDamaged(str(e)) from None
    _VERIFIED.add(key)


def note(store: Store, damaged: dict[int, str], base: Snapshot, used: dict[int, int],
         round_: int) -> str:
    """What was done about the damaged rounds newer than `base`, for the round's report."""
    newest = max(damaged)
    try:
        bad = load_snapshot(store, average_prefix(newest)).manifest.get("contributors", {})
        before = base.manifest.get("contributors", {})
        inputs = {int(w): s for w, s in bad.items() if before.get(w) != s}
    except StoreError:
        inputs = None
    how = (f"recomputes round {newest} from its inputs, which are intact," if inputs == used
           else f"was built on the previous good average (round {base.manifest['round']}) with "
                "each worker's newest push since it,")
    return paragraph(
        f"average/{newest} is committed but does not verify ({damaged[newest]}). Round",
        f"{round_} {how} so workers continue from it; average/{newest} is left as it is",
        "(inspect it, or delete it once no worker needs it).",
    )


def readable_average(store: Store, bad: set[int] | None = None
                     ) -> tuple[Snapshot, dict[str, Any]] | None:
    """The newest average whose data verifies, with its params; damaged ones are warned about
    (once each when the caller keeps `bad` across calls) and passed over."""
    bad = set() if bad is None else bad
    for round_ in reversed(average_rounds(store)):
        if round_ in bad:
            continue
        try:
            ckpt = load_snapshot(store, average_prefix(round_))
            return ckpt, read_params(store, ckpt)
        except StoreError as e:
            bad.add(round_)
            log.warning("average/%d does not verify (%s); using an older average until the "
                        "averager publishes the next round", round_, e)
    return None


def own_push(store: Store, worker: int, steps: list[int], after: int, max_step: int
             ) -> tuple[Snapshot, dict[str, Any]] | None:
    """A restarting worker's newest own push with a step in (after, max_step] that verifies,
    with its params; newer ones that do not are named in a warning."""
    for step in reversed([s for s in steps if after < s <= max_step]):
        try:
            ckpt = load_snapshot(store, worker_prefix(worker, step))
            return ckpt, read_params(store, ckpt)
        except StoreError as e:
            log.warning("Lo-Fi worker %d: its push of step %d is corrupt (%s); falling back to "
                        "its previous push (or the newest average)", worker, step, e)
    return None
