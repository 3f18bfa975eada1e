"""The dataset registry (`DATASETS`, one explicit table) and the zero-download text demo.

Each entry names how to build training batches and the full held-out split (`Dataset`), so the
training loop and `launch.evaluate` ask this module alone. The `stdlib` demo reads the Python
standard library's own sources as bytes: files are split into train / held-out by a hash of
their path (stable across runs), concatenated and cut into windows by `jaxscale.data.batching`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxscale.data import images, mixture
from jaxscale.data.batching import Batches, eval_batches
from jaxscale.errors import ConfigError, paragraph

__all__ = ["Batches", "DATASETS", "Dataset", "build_data", "eval_batches", "heldout_batches",
           "load_corpus"]


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


@dataclass(frozen=True)
class Dataset:
    """One entry of the registry: how to build training batches and the full held-out split.

    `build(config, process_index, process_count, shard_index, shard_count)` returns (an object
    with `.iterator(state)` whose batches are dicts of per-host numpy arrays sharing the leading
    batch dimension, the list of held-out batches the training loop evaluates). `heldout(config,
    process_index, process_count)` returns every held-out example for `launch.evaluate` (e.g.
    padded, masked image batches); None means the loop's own held-out batches.
    """

    build: Callable[..., tuple[Any, list]]
    heldout: Callable[..., list] | None = None
    # The iterator's state is a position in *global* batches (each process takes its rows of
    # every global batch), the same on every process, so a checkpoint resumes onto any process
    # count with no example repeated or skipped (tests/test_elastic_data.py). A source whose
    # position is per process sets False: `check_resize` then refuses such a resume.
    elastic: bool = True


# `config.data.corpus` -> its Dataset. An explicit table: every dataset is listed here.
DATASETS: dict[str, Dataset] = {
    "stdlib": Dataset(stdlib_data),
    "digits": Dataset(images.digits_data, images.digits_test_batches),
    "files": Dataset(mixture.files_data, mixture.files_heldout),
}


def dataset_for(config: Any) -> Dataset:
    """The registry entry of `config.data` (`files` whenever `data.sources` is set)."""
    name = "files" if config.data.get("sources") else config.data.corpus
    if name not in DATASETS:
        raise ConfigError(paragraph(
            f"Unknown data.corpus={name!r}; available: {', '.join(sorted(DATASETS))}.",
        ))
    return DATASETS[name]


def check_resize(config: Any, saved: int, now: int) -> bool:
    """Whether the saved data position applies to this run, which resumes a checkpoint that
    `saved` processes wrote on `now` processes: yes for an elastic source; for another, a
    refusal in one paragraph, or False (restart the position) when the user accepted that with
    `data.restart_position_on_resize`."""
    if saved == now or dataset_for(config).elastic:
        return True
    name = "files" if config.data.get("sources") else config.data.corpus
    if config.data.get("restart_position_on_resize", False):
        return False
    raise ConfigError(paragraph(
        f"The checkpoint was written by {saved} processes and this run has {now}, but data",
        f"source {name!r} keeps a position per process that cannot be re-sharded onto another",
        "process count: resuming would repeat or skip training examples. Resume with",
        f"{saved} processes, or set --config.data.restart_position_on_resize=True to accept",
        "restarting the data from its beginning (the weights and step are kept)."))


def build_data(config: Any, process_index: int, process_count: int,
               shard_index: int = 0, shard_count: int = 1) -> tuple[Any, list]:
    """(training batches, held-out batches) of `config.data` for this process / Lo-Fi shard."""
    return dataset_for(config).build(config, process_index, process_count, shard_index,
                                     shard_count)


def heldout_batches(config: Any, process_index: int, process_count: int,
                    sources: str = "") -> list:
    """Every held-out example of the config's dataset, as this host's rows of global batches;
    with `sources` (`FORMAT=GLOB;...`), every row of those files instead, with the run's
    tokenizer and packing (`launch.evaluate --eval_sources`)."""
    if sources:
        return mixture.source_eval_batches(config, sources, process_index, process_count)
    entry = dataset_for(config)
    if entry.heldout is not None:
        return entry.heldout(config, process_index, process_count)
    return entry.build(config, process_index, process_count)[1]
