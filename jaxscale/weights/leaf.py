"""`Leaf`: one parameter whose shape and dtype are known up front and whose values are read on
demand, whole or in part. Every saved format (`sources.open_weights`) hands its parameters out
as leaves, so converting, exporting or placing a model holds one parameter on the host at a
time; `place` reads only the part each local device needs when `reads_slices` is set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Index = tuple[slice, ...]


class Leaf:
    """A lazily-read parameter. `read(index)` returns the part `index` (default: all) in
    `dtype`; `np.asarray(leaf)` reads it whole."""

    def __init__(self, shape: tuple[int, ...], dtype: Any,
                 read: Callable[[Index | None], np.ndarray], reads_slices: bool = False):
        self.shape, self.dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        self._read = read
        # True when reading a part costs less than reading the whole (e.g. stacked HF layers):
        # `place` then reads each device's block instead of the whole parameter.
        self.reads_slices = reads_slices

    def read(self, index: Index | None = None) -> np.ndarray:
        return np.asarray(self._read(index), dtype=self.dtype)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self.read()
        return arr if dtype is None else arr.astype(dtype)

    def __repr__(self) -> str:
        return f"Leaf(shape={self.shape}, dtype={self.dtype})"
