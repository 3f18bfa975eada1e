"""Aggregators over workers' deltas: pure float32 array math that knows nothing of models.

Every aggregator takes `deltas` of shape (workers, n) — one block of each worker's flattened
difference from the previous average — and per-worker `weights` (samples seen), and returns the
aggregated (n,) delta. The averager streams blocks through them, so the robust ones are
coordinate-wise (median, trimmed mean) or clip per block (centered clip; see its docstring).
`OuterSGD` is DiLoCo's outer optimizer, applied to the aggregated delta.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxscale.errors import ConfigError, paragraph


def _normalized(weights: np.ndarray) -> np.ndarray:
    w = np.asarray(weights, np.float64)
    return (w / w.sum()).astype(np.float32)


def mean(deltas: np.ndarray, weights: np.ndarray, **_) -> np.ndarray:
    """Sample-weighted mean. Not robust: one huge contribution moves it arbitrarily far."""
    return np.tensordot(_normalized(weights), deltas, axes=1).astype(np.float32)


def median(deltas: np.ndarray, weights: np.ndarray, **_) -> np.ndarray:
    """Coordinate-wise median (unweighted): robust to fewer than half hostile workers."""
    return np.median(deltas, axis=0).astype(np.float32)


def trimmed_mean(deltas: np.ndarray, weights: np.ndarray, trim: float = 0.2, **_) -> np.ndarray:
    """Coordinate-wise mean after dropping the `trim` fraction of lowest and highest values."""
    n = deltas.shape[0]
    k = min(int(np.floor(trim * n)), (n - 1) // 2)
    ordered = np.sort(deltas, axis=0)
    return ordered[k:n - k].mean(axis=0).astype(np.float32)


def centered_clip(deltas: np.ndarray, weights: np.ndarray, tau: float = 1.0, iters: int = 3,
                  **_) -> np.ndarray:
    """Centered clipping (Karimireddy et al. 2020): from the median, iterate
    v <- v + sum_i w_i (d_i - v) min(1, tau / ||d_i - v||).

    Norms are taken over the block the averager streams (at most its chunk budget), not the
    whole model, which keeps memory bounded; a hostile worker is clipped in every block.
    """
    w = _normalized(weights)
    v = np.median(deltas, axis=0).astype(np.float32)
    for _ in range(iters):
        diff = deltas - v[None, :]
        norms = np.sqrt(np.sum(diff.astype(np.float64) ** 2, axis=1))
        scale = np.minimum(1.0, tau / np.maximum(norms, 1e-12)).astype(np.float32)
        v = v + np.tensordot(w * scale, diff, axes=1).astype(np.float32)
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
    """Boolean mask of workers whose block is entirely finite (checked before any reducer)."""
    return np.all(np.isfinite(deltas), axis=1)


@dataclass(frozen=True)
class OuterSGD:
    """DiLoCo's outer step: Nesterov SGD on the aggregated delta (treated as minus a gradient).

    m' = mu * m + delta;  new = base + lr * (delta + mu * m')
    With lr=1, mu=0 this is plain averaging.
    """

    lr: float = 0.7
    momentum: float = 0.9

    def step(self, base: np.ndarray, delta: np.ndarray,
             momentum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        m = (self.momentum * momentum + delta).astype(np.float32)
        new = base + self.lr * (delta + self.momentum * m)
        return new.astype(np.float32), m
