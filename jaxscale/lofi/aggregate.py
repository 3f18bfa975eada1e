"""Aggregators over workers' deltas: pure float32 array math that knows nothing of models or
storage (`stream.py` feeds them block by block, `averager.py` runs the rounds).

Every aggregator takes `deltas` of shape (workers, n) — each worker's flattened difference from
the previous average — and per-worker `weights` (samples seen), and returns the aggregated (n,)
delta. `mean`, `median` and `trimmed_mean` are coordinate-wise, so the averager streams blocks
through them; `centered_clip` needs the norm of each worker's whole-model delta, so the averager
streams it in passes built from `clip_scales` and `clip_update` (this module's `centered_clip`
on the full vectors is the reference it must match). `OuterSGD` is DiLoCo's outer optimizer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxscale.errors import ConfigError, paragraph
from jaxscale.lofi.trust import trim_count


def check_weights(weights: np.ndarray) -> np.ndarray:
    """Sample weights as float64: finite, non-negative, not all zero (a hostile manifest must
    not turn the average into NaN or flip its sign)."""
    w = np.asarray(weights, np.float64)
    if w.ndim != 1 or not np.all(np.isfinite(w)) or np.any(w < 0) or not w.sum() > 0:
        raise ValueError(paragraph(
            f"Aggregation weights {w.tolist()[:8]} must be finite, non-negative and not all",
            "zero (they are the workers' samples seen); reject the offending contribution.",
        ))
    return w


def _normalized(weights: np.ndarray) -> np.ndarray:
    """Weights summing to 1, as float32 (memoized: the streamed reducers ask once per piece)."""
    w = np.asarray(weights, np.float64)
    return _normalized_tuple(tuple(w.tolist())) if w.ndim == 1 else check_weights(w)  # raises


@functools.lru_cache(maxsize=64)
def _normalized_tuple(weights: tuple[float, ...]) -> np.ndarray:
    w = check_weights(np.array(weights, np.float64))
    normalized = (w / w.sum()).astype(np.float32)
    normalized.flags.writeable = False  # shared by every caller with these weights
    return normalized


def mean(deltas: np.ndarray, weights: np.ndarray, **_) -> np.ndarray:
    """Sample-weighted mean. Not robust: one huge contribution moves it arbitrarily far."""
    return (_normalized(weights) @ deltas).astype(np.float32, copy=False)


def median(deltas: np.ndarray, weights: np.ndarray, **_) -> np.ndarray:
    """Coordinate-wise median (unweighted): robust to fewer than half hostile workers."""
    return np.median(deltas, axis=0).astype(np.float32)


def trimmed_mean(deltas: np.ndarray, weights: np.ndarray, trim: float = 0.2, **_) -> np.ndarray:
    """Coordinate-wise mean after dropping the `trim` fraction of lowest and highest values
    (at least one per side: `trust.trim_count`, which refuses when none can be dropped)."""
    n = deltas.shape[0]
    k = trim_count(n, trim)
    ordered = np.sort(deltas, axis=0)
    return ordered[k:n - k].mean(axis=0).astype(np.float32)


def clip_scales(sq_norms: np.ndarray, tau: float) -> np.ndarray:
    """min(1, tau / ||d_i - v||) from each worker's squared whole-model distance to v."""
    norms = np.sqrt(np.asarray(sq_norms, np.float64))
    return np.minimum(1.0, tau / np.maximum(norms, 1e-30)).astype(np.float32)


def clip_update(v: np.ndarray, deltas: np.ndarray, weights: np.ndarray,
                scales: np.ndarray) -> np.ndarray:
    """One centered-clip step on a block: v + sum_i w_i (d_i - v) scale_i."""
    diff = deltas - v[None, :]
    return (v + np.tensordot(_normalized(weights) * scales, diff, axes=1)).astype(np.float32)


def sq_dist(v: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """Per-worker squared distance of a block to v (float64, summed over blocks by callers)."""
    return np.sum((deltas.astype(np.float64) - v[None, :]) ** 2, axis=1)


def centered_clip(deltas: np.ndarray, weights: np.ndarray, tau: float = 1.0, iters: int = 3,
                  **_) -> np.ndarray:
    """Centered clipping (Karimireddy et al. 2020) on whole-model deltas: from the coordinate-
    wise median, iterate v <- v + sum_i w_i (d_i - v) min(1, tau / ||d_i - v||), where the norm
    is over every parameter of the model (the averager's streamed passes match this exactly)."""
    v = np.median(deltas, axis=0).astype(np.float32)
    for _ in range(iters):
        v = clip_update(v, deltas, weights, clip_scales(sq_dist(v, deltas), tau))
    return v


AGGREGATORS: dict[str, Callable[..., np.ndarray]] = {
    "mean": mean, "median": median, "trimmed_mean": trimmed_mean, "centered_clip": centered_clip,
}


def get_aggregator(name: str) -> Callable[..., np.ndarray]:
    if name not in AGGREGATORS:
        raise ConfigError(paragraph(
            f"Unknown aggregator {name!r}; choose one of {', '.join(AGGREGATORS)}.",
            "'mean' is sample-weighted but not robust; the others resist hostile workers.",
        ))
    return AGGREGATORS[name]


def finite_rows(deltas: np.ndarray) -> np.ndarray:
    """Boolean mask of workers whose block is entirely finite (checked before any reducer).

    Fast path: a row whose sum is finite has only finite values (an inf or nan makes any sum
    non-finite); only rows whose sum is not (non-finite values, or huge finite ones that
    overflow) get the element-wise check. The sums are a matrix-vector product with ones
    (BLAS: 2.5x faster than numpy's pairwise `sum(axis=1)` on float32 pieces)."""
    with np.errstate(over="ignore", invalid="ignore"):
        ok = np.isfinite(deltas @ _ones(deltas.shape[1], deltas.dtype))
    for i in np.flatnonzero(~ok):
        ok[i] = np.isfinite(deltas[i]).all()
    return ok


@functools.lru_cache(maxsize=8)
def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    ones = np.ones(n, dtype)
    ones.flags.writeable = False
    return ones


# DiLoCo's outer Nesterov step as its paper sets it (Douillard et al. 2023, "DiLoCo: Distributed
# Low-Communication Training of Language Models"): the averager's and its flags' defaults.
DILOCO_LR = 0.7
DILOCO_MOMENTUM = 0.9


@dataclass(frozen=True)
class OuterSGD:
    """DiLoCo's outer step: Nesterov SGD on the aggregated delta (treated as minus a gradient).

    m' = mu * m + delta;  new = base + lr * (delta + mu * m')
    With lr=1, mu=0 this is plain averaging.
    """

    lr: float = DILOCO_LR
    momentum: float = DILOCO_MOMENTUM

    def step(self, base: np.ndarray, delta: np.ndarray,
             momentum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(over="ignore"):  # overflow is caught by the averager's finite check
            m = (self.momentum * momentum + delta).astype(np.float32)
            new = base + self.lr * (delta + self.momentum * m)
        return new.astype(np.float32), m
