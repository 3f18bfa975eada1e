"""What a Lo-Fi worker writes to the shared store: its pushes, in the snapshot format.

The format (committed zarr3 snapshots, manifests, COMMIT markers, bounded retry) is
`jaxscale/weights/snapshot.py`'s, shared with params exports; this module adds the Lo-Fi side
of the layout: a worker's push of step `s` is the snapshot `workers/<worker_id>/<s>`, and
`commits/workers/` lists every committed push. Averages (`average/<round>`) are written by
`averager.py`; who may write a round (claims, leases) is `lease.py`'s.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxscale.errors import paragraph
from jaxscale.storage import locations
from jaxscale.weights.kv import Store
from jaxscale.weights.localfs import local_root
from jaxscale.weights.manifest import StoreError
from jaxscale.weights.snapshot import (
    LostRace,
    commit_key,
    committed,
    latest_average_snapshot,
    write_snapshot,
)


def worker_prefix(worker_id: int, step: int) -> str:
    return f"workers/{int(worker_id)}/{int(step)}"


def worker_pushes(store: Store) -> dict[int, list[int]]:
    """{worker_id: committed steps, ascending}."""
    out: dict[int, list[int]] = {}
    for worker, step in committed(store, "workers", 2):
        out.setdefault(worker, []).append(step)
    return out


@dataclass(frozen=True)
class PushReport:
    prefix: str
    bytes_written: int
    raw_bytes: int
    skipped: bool = False      # this step was already committed: kept, not overwritten


def push(location: str | Store, worker_id: int, step: int, params: Mapping[str, Any],
         samples_seen: int, compress: bool = False, synced_round: int | None = None
         ) -> PushReport:
    """A worker's push of flat {leaf: array} weights; compressed pushes store 8-bit deltas from
    the newest average (falling back to raw when there is none yet). `synced_round` is the
    average the worker last continued from (the averager measures staleness against it).

    A step that is already committed (a restarted worker redoing steps, or two processes with
    one worker id) is kept as it is: the averager may be reading it, and committed data is
    never overwritten. A partial push of the same step (a worker killed mid-push) is simply
    written again into a new attempt directory; the killed attempt's files are never read.
    """
    store = location if isinstance(location, Store) else Store(location)
    prefix = worker_prefix(worker_id, step)
    raw = sum(np.asarray(v).nbytes for v in params.values())
    if store.read(commit_key(prefix)) is not None:
        return PushReport(prefix, 0, raw, skipped=True)
    before = store.bytes_written
    base = latest_average_snapshot(store) if compress else None
    meta = {"kind": "worker", "worker_id": int(worker_id), "step": int(step),
            "samples_seen": int(samples_seen),
            "base_round": int(base.manifest["round"]) if base else None,
            "synced_round": None if synced_round is None or synced_round < 0
            else int(synced_round)}
    try:
        write_snapshot(store, prefix, params, meta, base,
                       compress=compress and base is not None, exclusive=True)
    except LostRace:  # another process pushed this worker step first: keep its push
        return PushReport(prefix, store.bytes_written - before, raw, skipped=True)
    return PushReport(prefix, store.bytes_written - before, raw)


def check_store_root(location: str, spec: dict, must_exist: bool) -> None:
    """A local store root must be a directory (and exist, unless workers will create it)."""
    root = local_root(spec)
    if root is None:
        return
    if os.path.exists(root) and not os.path.isdir(root):
        raise StoreError(paragraph(
            f"--store={location} is a file, not a Lo-Fi store directory. Give the directory the",
            "workers push to (their config.lofi.store).",
        ))
    if must_exist and not os.path.isdir(root):
        raise StoreError(paragraph(
            f"--store={location} does not exist, so there is nothing to average or account.",
            "Give the directory the workers push to (their config.lofi.store), or add --watch",
            "to wait for the workers to create it.",
        ))


# A store holds a Lo-Fi job once any snapshot attempt or COMMIT marker is in it. Before that
# (a job stopped while its first worker starts) it may hold `lofi-local`'s worker workdirs
# (runs/worker<i>, runs/final) and the job's config.json, written just before round 0, and
# `STARTED`, after which it may hold anything the job's workers wrote (their workdirs).
_JOB_MARKERS = {"average", "workers", "commits"}
_RUNS = re.compile(r"worker\d+|final")
STARTED = "stats/started.json"  # written by the first `claim_store` of a job


def top_level_names(location: str) -> set[str]:
    """The names at the top of a directory or bucket prefix (none where it does not exist)."""
    if locations.is_remote(location):
        return {key.split("/")[0] for key in Store(location).keys("")}
    return set(os.listdir(location)) if os.path.isdir(location) else set()


def check_new_store(location: str, flag: str = "--store") -> None:
    """`lofi-local --store` and a worker's `lofi.store` take a new or empty directory, or a
    store holding a Lo-Fi job (the job resumes), never another directory: the workers would
    push into it, and a training workdir would quietly become a Lo-Fi store. Checked before
    anything is written (`claim_store`, which then marks the store as the job's)."""
    names = top_level_names(location)
    if names & _JOB_MARKERS:
        return
    foreign = sorted(name for name in names if not _job_entry(location, name))
    if foreign and Store(location).read(STARTED) is None:  # not a sibling worker's files
        raise StoreError(paragraph(
            f"{flag}={location} holds {', '.join(foreign[:5])}{', ...' if foreign[5:] else ''}",
            "and no Lo-Fi job (no average/, workers/ or commits/): a training workdir, or",
            "another directory, that the workers would push their weights into. Give a new or",
            "empty directory, or an existing Lo-Fi store to resume its job. Nothing was written.",
        ))


def claim_store(location: str, flag: str) -> None:
    """`check_new_store`, then marks the store as a job's (`STARTED`) before anything else of
    the job is written there: workers starting together on a fresh store then never refuse
    what a sibling wrote after its own check (its workdir inside the store, config.json)."""
    check_new_store(location, flag)
    Store(location).write(STARTED, json.dumps({"checked": flag}).encode(), if_absent=True)


def _job_entry(location: str, name: str) -> bool:
    """Whether `name`, at the top of a store without snapshots, is what a starting job wrote."""
    if name == "stats":
        return True
    if name == "config.json":  # the job's config (`worker.export_config`: lofi.store set),
        try:                     # not a training run's
            lofi = json.loads(Store(location).read("config.json") or b"{}").get("lofi") or {}
            return bool(lofi.get("enabled") or lofi.get("store"))
        except (ValueError, AttributeError, StoreError):
            return False
    if name == "runs" and not locations.is_remote(location):
        runs = os.path.join(location, name)
        return os.path.isdir(runs) and all(_RUNS.fullmatch(n) for n in os.listdir(runs))
    return name == "runs"
