"""How much the averager believes of what a push says about itself.

A push's manifest is written by the worker: its `step` and `samples_seen` are claims, and a
hostile or broken worker can claim anything. So:

- a step beyond the job's `train.steps` (recorded with round 0), or beyond what the int32 step
  counter of a run can hold, makes the push invalid (skipped like a corrupt one);
- a round's step is the (lower) median of its contributions' steps, so no single worker's
  claim sets it unless it is the only contributor (whose step is bounded as above);
- a worker's weight is its `samples_seen`, bounded by `step x per-worker batch` (the job's
  `data.batch_size`, recorded with round 0) and then by `WEIGHT_CAP` times the median weight
  of the round, so one worker cannot outweigh the others by claiming samples it never saw;
- `trimmed_mean` drops at least one value per side (see `trim_count`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxscale.errors import JaxscaleError, paragraph

MAX_STEP = 2**31 - 1   # a run's step counter is int32
WEIGHT_CAP = 2.0       # a worker's weight is at most this many times the round's median weight


class TrimError(JaxscaleError):
    """`trimmed_mean` was asked to trim, but this many contributions leave nothing to trim."""


def trim_count(n: int, trim: float) -> int:
    """Values dropped at each end by `trimmed_mean` of `n` contributions: floor(trim x n), but
    at least one (trimming was asked for) and at most (n - 1) // 2 (one value must remain).
    Refuses when not even one value per side can go: a silent plain mean is not robust."""
    if trim <= 0 or n < 3:
        raise TrimError(paragraph(
            f"trimmed_mean with trim={trim} over {n} contribution(s) cannot drop a value at",
            "each end (it needs trim > 0 and at least 3 contributions), so it would be a plain,",
            "non-robust mean. Raise --min_workers (or config.lofi.min_workers) to 3 or more,",
            "or choose --aggregator=median or centered_clip.",
        ))
    return min(max(1, int(math.floor(trim * n))), (n - 1) // 2)


def step_problem(step: int, max_step: int | None) -> str | None:
    """Why a push's claimed step is impossible (None if it is possible)."""
    if step > MAX_STEP:
        return f"step {step} is beyond a run's int32 step counter ({MAX_STEP}); rejected"
    if max_step is not None and step > max_step:
        return (f"step {step} is beyond the job's train.steps={max_step} (recorded with round "
                "0), so no worker of this job could have reached it; rejected")
    return None


def round_step(steps: list[int]) -> int:
    """The step a round covers: the lower median of its contributions' steps."""
    ordered = sorted(int(s) for s in steps)
    return ordered[(len(ordered) - 1) // 2]


def worker_weights(ckpts: list[Any], batch_size: int | None) -> np.ndarray:
    """Each contribution's aggregation weight (float64): its claimed `samples_seen`, at most
    `step x batch_size` when the job recorded its per-worker batch, then at most WEIGHT_CAP x
    the median of these; equal weights if every one is zero."""
    w = np.array([float(c.manifest["samples_seen"]) for c in ckpts], np.float64)
    if batch_size:
        w = np.minimum(w, np.array([float(c.step) * batch_size for c in ckpts]))
    if w.size and np.median(w) > 0:
        w = np.minimum(w, WEIGHT_CAP * np.median(w))
    return w if w.sum() > 0 else np.ones_like(w)
