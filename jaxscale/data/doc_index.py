"""The length index of on-the-fly sources: each process tokenizes only its own files.

Packing plans rows from document token lengths, and rows must be the same on every host so that
the global batch at a step does not depend on the process count. For `text`, `jsonl` and
`parquet` the lengths are unknown until the text is tokenized. Rather than every process
tokenizing the whole corpus, the files (*units*) are dealt out: process `p` of `P` scans and
tokenizes files `p, p + P, ...` and the per-file results (document counts, jsonl line offsets,
token lengths) are summed across processes with one all-gather (`jax.experimental.multihost_utils`).
Every process then holds the same document table, plans the same rows, and during training reads
only the documents of its own rows (`jaxscale.data.mixture`). A process never reads another's files
to build the index.

Why this and not lanes of per-host document streams: the checkpointed iterator state stays
grain's `{"next_index": step}` (the same for every process, as Lo-Fi workers and resume expect),
and the plan is a pure function of the data, so any process count and mesh gives the same rows.
The index is a few integers per document (an int32 length and an int64 offset). It is built at
start-up, tokenizing 1/P of the corpus per process; with `data.index_cache` set to a directory
each process keeps the results for its own files on local disk, so a resumed run with the same
process count tokenizes nothing again. Large corpora are still best prepared once with
`launch.prepare_data` (lengths stored beside the shards).

A bad record met while indexing stops the process that owns its file with the usual one-paragraph
error; its peers then stop at the all-gather (the launcher or JAX's coordination service ends
them), as they would at any collective of a failed host.

Processes simulated in one Python process (tests, `process_count != jax.process_count()`) have no
peers to share with, so such a process indexes every file itself; rows are still the same.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxscale.storage import data_files

Exchange = Callable[[np.ndarray], np.ndarray]  # int32 array -> its sum over all processes


def jax_exchange(x_N: np.ndarray) -> np.ndarray:
    """The element-wise sum of `x_N` (int32) over every process of the jax job."""
    import jax
    from jax.experimental import multihost_utils
    if jax.process_count() == 1 or x_N.size == 0:  # sizes agree: counts are exchanged first
        return x_N
    gathered_PN = np.asarray(multihost_utils.process_allgather(x_N.astype(np.int32)))
    return gathered_PN.sum(axis=0, dtype=np.int64).astype(np.int32)


def default_exchange(process_count: int) -> Exchange | None:
    """The all-gather when `process_count` is the real jax job's, else None (index alone)."""
    import jax
    if process_count > 1 and jax.process_count() == process_count:
        return jax_exchange
    return None


def _as_int32(x_N: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x_N, np.int64).view(np.int32)


class IndexCache:
    """Per-file index results on local disk (`data.index_cache`), so that a resumed or repeated
    run does not tokenize its files again. An entry is named by the file's absolute path, size
    and modification time (an object's URL, size and ETag or generation) and by `salt`
    (format, tokenizer hash, text field, skip setting), so a changed file or tokenizer is
    indexed afresh. Entries are plain `.npz` arrays (no pickle),
    written to a temporary name and renamed, so a crash never leaves a torn entry."""

    def __init__(self, directory: str, salt: str):
        self.directory, self.salt = os.path.expanduser(directory), salt

    def _path(self, path: str) -> str:
        key = f"{self.salt}|{data_files.fingerprint(path)}"
        return os.path.join(self.directory, hashlib.sha1(key.encode()).hexdigest() + ".npz")

    def load(self, path: str) -> tuple[np.ndarray, np.ndarray, int] | None:
        try:
            with np.load(self._path(path), allow_pickle=False) as z:
                return z["offsets"], z["lengths"], int(z["skipped"])
        except (OSError, KeyError, ValueError):
            return None

    def save(self, path: str, offsets: np.ndarray, lengths: np.ndarray, skipped: int) -> None:
        os.makedirs(self.directory, exist_ok=True)
        final = self._path(path)
        tmp = f"{final}.{os.getpid()}.tmp.npz"
        np.savez(tmp, offsets=offsets, lengths=lengths, skipped=np.asarray(skipped))
        os.replace(tmp, final)


def _index_unit(reader: Any, u: int, cache: IndexCache | None
                ) -> tuple[np.ndarray, np.ndarray, int]:
    """(byte offsets, token lengths, skipped bad records) of the documents of file `u`."""
    path = reader.units[u]
    got = cache.load(path) if cache is not None else None
    if got is not None:
        return got
    before = reader.skipped
    locs = reader.scan_unit(u)
    lengths = np.asarray([len(reader.tokens_at(loc)) for loc in locs], np.int64)
    offsets = np.asarray([loc[2] for loc in locs], np.int64)
    reader.check_unit(u)  # before the cache: a refused file is never cached
    if cache is not None:
        cache.save(path, offsets, lengths, reader.skipped - before)
    return offsets, lengths, reader.skipped - before


def build_index(reader: Any, process_index: int, process_count: int,
                exchange: Exchange | None = None, cache: IndexCache | None = None) -> None:
    """Indexes this process's files of `reader` (from `cache` where it has them), shares the
    results and attaches the whole document table. With `exchange=None` this process indexes
    every file."""
    units = range(len(reader.units))
    mine = [u for u in units if exchange is None or u % process_count == process_index]
    skipped_before = reader.skipped
    found = {u: _index_unit(reader, u, cache) for u in mine}
    counts_U = np.zeros(len(units), np.int32)
    for u, (offsets, _, _) in found.items():
        counts_U[u] = len(offsets)
    if exchange is not None:
        counts_U = exchange(counts_U)
    starts = np.concatenate([[0], np.cumsum(counts_U, dtype=np.int64)])
    lengths_N = np.zeros(int(starts[-1]), np.int64)
    offsets_N = np.zeros(int(starts[-1]), np.int64)
    for u, (offsets, lengths, _) in found.items():
        offsets_N[starts[u]:starts[u + 1]] = offsets
        lengths_N[starts[u]:starts[u + 1]] = lengths
    skipped = np.asarray([sum(k for _, _, k in found.values())], np.int32)
    if exchange is not None:
        lengths_N = exchange(lengths_N.astype(np.int32)).astype(np.int64)
        offsets_N = exchange(_as_int32(offsets_N)).view(np.int64)
        skipped = exchange(skipped)
    reader.skipped = skipped_before + int(skipped[0])
    locs = [(u, j, int(offsets_N[starts[u] + j])) for u in units for j in range(counts_U[u])]
    reader.attach(locs, lengths_N)
