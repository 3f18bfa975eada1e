"""Byte-level text data that needs no download: the Python standard library's own sources.

Files are split into train / held-out by a hash of their path (stable across runs), concatenated
and cut into windows of `seq_len + 1` bytes. A grain `MapDataset` shuffles window indices with a
seed, groups them into *global* batches, and each host gathers only its rows of every batch, so
the global batch at a step is the same whatever the process count or mesh. Lo-Fi workers first
keep only the windows of their own shard (`shard_index` of `shard_count`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from jaxscale.errors import ConfigError, paragraph


def _bucket(path: str) -> int:
    return int(hashlib.sha1(path.encode()).hexdigest()[:8], 16) % 100


@functools.lru_cache(maxsize=4)
def load_corpus(max_bytes: int, part: str = "all") -> tuple[np.ndarray, np.ndarray]:
    """Returns (train, heldout) uint8 token arrays from the stdlib's `.py` files.

    `part` selects disjoint halves of the training files (`a` / `b`, by path hash), e.g. to
    pre-train on one part and fine-tune on the other; the held-out split is shared.
    """
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, fs in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages")]
        files += [os.path.relpath(os.path.join(d, f), root) for f in fs if f.endswith(".py")]
    files.sort()
    train, heldout, sizes = [], [], [0, 0]
    for rel in files:
        b = _bucket(rel)
        is_eval = b < 5
        if not is_eval and part != "all" and (b % 2 == 0) != (part == "a"):
            continue
        if sizes[is_eval] >= (max_bytes // 10 if is_eval else max_bytes):
            continue
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        (heldout if is_eval else train).append(data)
        sizes[is_eval] += len(data)
    to_arr = lambda chunks: np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return to_arr(train), to_arr(heldout)


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


def eval_batches(tokens: np.ndarray, seq_len: int, global_batch: int, count: int,
                 process_index: int = 0, process_count: int = 1) -> list[dict[str, np.ndarray]]:
    """The first `count` unshuffled held-out batches: the same for every run and mesh."""
    ds = Batches(tokens, seq_len, global_batch, process_index, process_count,
                 shuffle=False).dataset()
    return [ds[i] for i in range(count)]


def stdlib_data(config: Any, process_index: int, process_count: int,
                shard_index: int = 0, shard_count: int = 1) -> tuple[Batches, list]:
    """(training batches, held-out batches) of byte tokens for `config.data`."""
    d = config.data
    train, heldout = load_corpus(d.max_bytes, d.part)
    batches = Batches(train, d.seq_len, d.batch_size, process_index, process_count,
                      shard_index, shard_count, seed=config.seed)
    evals = eval_batches(heldout, d.seq_len, d.batch_size, d.eval_batches,
                         process_index, process_count)
    return batches, evals


# `config.data.corpus` -> builder(config, process_index, process_count, shard_index, shard_count)
# returning (an object with `.iterator(state)`, a list of held-out batches). Each batch is a
# dict of per-host numpy arrays sharing the leading batch dimension.
DATASETS: dict[str, Callable[..., tuple[Any, list]]] = {"stdlib": stdlib_data}


def build_data(config: Any, process_index: int, process_count: int,
               shard_index: int = 0, shard_count: int = 1) -> tuple[Any, list]:
    name = config.data.corpus
    if name not in DATASETS:
        try:  # image datasets live beside their models
            import jaxscale.vision_data  # noqa: F401
        except ImportError:
            pass
    if name not in DATASETS:
        raise ConfigError(f"Unknown data.corpus={name!r}; available: {sorted(DATASETS)}.")
    return DATASETS[name](config, process_index, process_count, shard_index, shard_count)
