"""Deterministic global batches of token windows, of which each host gathers only its rows.

A token stream (a numpy array, a memory map, or anything sliceable with a length) is cut into
windows of `seq_len + 1` tokens. A grain `MapDataset` shuffles window indices with a seed, groups
them into *global* batches, and each host gathers only its rows of every batch, so the global
batch at a step is the same whatever the process count or mesh. Lo-Fi workers first keep only
the windows of their own shard (`shard_index` of `shard_count`). The iterator state is grain's
(JSON), saved in checkpoints, and resumes mid-epoch exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from jaxscale.errors import ConfigError, paragraph


@dataclass(frozen=True)
class Batches:
    """Deterministic per-host batches of shape (local_batch, seq_len + 1)."""

    tokens: np.ndarray
    seq_len: int
    global_batch: int
    process_index: int = 0
    process_count: int = 1
    shard_index: int = 0
    shard_count: int = 1
    seed: int = 0
    shuffle: bool = True

    def dataset(self) -> grain.MapDataset:
        n = (len(self.tokens) - 1) // self.seq_len
        windows = grain.MapDataset.range(n)[self.shard_index::self.shard_count]
        if len(windows) < self.global_batch:
            raise ConfigError(paragraph(
                f"The corpus has only {len(windows)} windows of {self.seq_len} tokens in this",
                f"shard, fewer than one global batch of {self.global_batch}. Raise",
                "data.max_bytes or lower data.batch_size / data.seq_len.",
            ))
        if self.shuffle:
            windows = windows.shuffle(seed=self.seed)
        if self.global_batch % self.process_count:
            raise ConfigError(paragraph(
                f"data.batch_size={self.global_batch} is not divisible by the number of",
                f"processes ({self.process_count}); every host needs the same share.",
            ))
        local = self.global_batch // self.process_count
        lo = self.process_index * local
        return (windows.repeat(None).batch(self.global_batch, drop_remainder=True)
                .map(lambda idx: self._gather(np.asarray(idx)[lo:lo + local])))

    def _gather(self, window_ids: np.ndarray) -> dict[str, np.ndarray]:
        starts = window_ids * self.seq_len
        rows = [self.tokens[s:s + self.seq_len + 1] for s in starts]
        return {"tokens": np.stack(rows).astype(np.int32)}

    def iterator(self, state: dict | None = None) -> grain.DatasetIterator:
        """An iterator whose `get_state()` is JSON and is saved in checkpoints."""
        it = iter(self.dataset().to_iter_dataset())
        if state is not None:
            it.set_state(state)
        return it


def eval_batches(tokens: Any, seq_len: int, global_batch: int, count: int,
                 process_index: int = 0, process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """The first `count` unshuffled held-out batches: the same for every run and mesh."""
    ds = Batches(tokens, seq_len, global_batch, process_index, process_count,
                 shuffle=False).dataset()
    return [ds[i] for i in range(count)]
