"""The length index of on-the-fly sources: each process tokenizes only its own files.

Packing plans rows from document token lengths, and rows must be the same on every host so that
the global batch at a step does not depend on the process count. For `text`, `jsonl` and
`parquet` the lengths are unknown until the text is tokenized. Rather than every process
tokenizing the whole corpus, the files (*units*) are dealt out: process `p` of `P` scans and
tokenizes files `p, p + P, ...` and the per-file results (document counts, jsonl line offsets,
token lengths) are summed across processes with one all-gather (`jax.experimental.multihost_utils`).
Every process then holds the same document table, plans the same rows, and during training reads
only the documents of its own rows (`jaxscale.file_data`). A process never reads another's files
to build the index.

Why this and not lanes of per-host document streams: the checkpointed iterator state stays
grain's `{"next_index": step}` (the same for every process, as Lo-Fi workers and resume expect),
and the plan is a pure function of the data, so any process count and mesh gives the same rows.
The index is a few integers per document (an int32 length and an int64 offset); it is rebuilt
at start-up (tokenizing 1/P of the corpus per process), which is why large corpora are better
prepared once with `launch.prepare_data` (lengths stored beside the shards).

A bad record met while indexing stops the process that owns its file with the usual one-paragraph
error; its peers then stop at the all-gather (the launcher or JAX's coordination service ends
them), as they would at any collective of a failed host.

Processes simulated in one Python process (tests, `process_count != jax.process_count()`) have no
peers to share with, so such a process indexes every file itself; rows are still the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

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


def build_index(reader: Any, process_index: int, process_count: int,
                exchange: Exchange | None = None) -> None:
    """Scans and tokenizes this process's files of `reader`, shares the results and attaches
    the whole document table. With `exchange=None` this process indexes every file."""
    units = range(len(reader.units))
    mine = [u for u in units if exchange is None or u % process_count == process_index]
    found = {u: reader.scan_unit(u) for u in mine}
    counts_U = np.zeros(len(units), np.int32)
    for u, locs in found.items():
        counts_U[u] = len(locs)
    if exchange is not None:
        counts_U = exchange(counts_U)
    starts = np.concatenate([[0], np.cumsum(counts_U, dtype=np.int64)])
    lengths_N = np.zeros(int(starts[-1]), np.int64)
    offsets_N = np.zeros(int(starts[-1]), np.int64)
    skipped_before = reader.skipped
    for u, locs in found.items():
        at = slice(int(starts[u]), int(starts[u + 1]))
        lengths_N[at] = [len(reader.tokens_at(loc)) for loc in locs]
        offsets_N[at] = [loc[2] for loc in locs]
    skipped = np.asarray([reader.skipped - skipped_before], np.int32)
    if exchange is not None:
        lengths_N = exchange(lengths_N.astype(np.int32)).astype(np.int64)
        offsets_N = exchange(_as_int32(offsets_N)).view(np.int64)
        skipped = exchange(skipped)
    reader.skipped = skipped_before + int(skipped[0])
    locs = [(u, j, int(offsets_N[starts[u] + j])) for u in units for j in range(counts_U[u])]
    reader.attach(locs, lengths_N)
