"""A worker joining a job checks that it trains the job's model before touching the store.

The first worker records the job's resolved config (`config.json`) and its initial weights
(round 0). A worker with another model (say another `model.embed`) would otherwise be skipped
by the averager while it silently adopted the average's weights, or crash deep in JAX with a
broadcasting error; instead it refuses at start, naming the fields that differ.
"""

from __future__ import annotations

import json
from typing import Any

from jaxscale.errors import ConfigError, paragraph
from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import StoreError
from jaxscale.weights.snapshot import average_prefix, load_snapshot


def _differences(mine: Any, job: Any, path: str = "model") -> list[str]:
    if isinstance(mine, dict) and isinstance(job, dict):
        return [d for k in sorted(set(mine) | set(job))
                for d in _differences(mine.get(k), job.get(k), f"{path}.{k}")]
    return [] if mine == job else [f"{path}={mine!r} (the job's: {job!r})"]


def _leaf_problem(store: Store, shapes: dict[str, tuple[tuple[int, ...], str]]) -> str | None:
    try:
        leaves = load_snapshot(store, average_prefix(0)).leaves
    except StoreError:
        return None  # no (readable) round 0 yet: this worker may be the one to publish it
    for leaf in sorted(set(leaves) | set(shapes)):
        if leaf not in leaves or leaf not in shapes:
            return f"parameter {leaf} exists in only one of this worker's model and the job's"
        shape, dtype = shapes[leaf]
        if list(shape) != leaves[leaf]["shape"] or dtype != leaves[leaf]["dtype"]:
            return (f"parameter {leaf} is {list(shape)} {dtype} here but "
                    f"{leaves[leaf]['shape']} {leaves[leaf]['dtype']} in the job's round 0")
    return None


def check_same_model(store: Store, config_json: bytes,
                     shapes: dict[str, tuple[tuple[int, ...], str]], worker_id: int) -> None:
    """Raises ConfigError unless this worker's `model` config (as `export_config` writes it)
    and parameter shapes match the job's recorded config.json and round 0."""
    recorded = store.read("config.json")
    try:
        job = json.loads(recorded)["model"] if recorded is not None else None
    except (ValueError, KeyError, TypeError):
        job = None  # a damaged record: the round-0 shapes still decide
    fields = _differences(json.loads(config_json)["model"], job) if job is not None else []
    leaf = _leaf_problem(store, shapes)
    if fields or leaf:
        raise ConfigError(paragraph(
            f"Lo-Fi worker {worker_id} trains another model than the job in {store.location}:",
            "; ".join(fields[:5] + ([leaf] if leaf else [])) + ".",
            "The averager would skip every push of it. Run it with the job's model config (the",
            "store's config.json), or give it its own lofi.store.",
        ))


# The job settings a worker records with round 0 (`LofiWorker.job`), as its config names them.
JOB_FLAGS = {"total_steps": "train.steps", "batch_size": "data.batch_size",
             "allowed_workers": "lofi.num_workers / lofi.allowed_workers", "sync": "lofi.sync",
             "min_workers": "lofi.min_workers", "max_staleness": "lofi.max_staleness"}


def check_same_job(store: Store, job: dict, worker_id: int) -> None:
    """Raises ConfigError unless this worker's job settings equal those recorded with round 0:
    the averager judges every push by the recorded ones, so a worker with another worker set,
    batch, sync, quorum or step count would train and have its pushes rejected (with more
    steps, every push past the job's last step)."""
    try:
        recorded = load_snapshot(store, average_prefix(0)).manifest.get("job") or {}
    except StoreError:
        return  # no (readable) round 0 yet: this worker may be the one to publish it
    if not isinstance(recorded, dict):
        return  # malformed: the averager's `job_settings` names it
    differ = [f"{JOB_FLAGS[k]}: {job[k]!r} here, {recorded[k]!r} in the job" for k in JOB_FLAGS
              if k in recorded and k in job and recorded[k] != job[k]]
    if differ:
        raise ConfigError(paragraph(
            f"Lo-Fi worker {worker_id} joins the job in {store.location} with other job settings",
            f"than its round 0 recorded: {'; '.join(differ)}. The averager judges every push by",
            "the recorded ones, so its work would be rejected. Run it with the job's settings;",
            "to train a finished job further, start a new job in a new lofi.store from its",
            "final average (config.init_from).",
        ))
