"""Image classification data that needs no download: scikit-learn's 8x8 handwritten digits.

1,797 grey-scale 8x8 images of the digits 0-9 ship inside scikit-learn. A fixed permutation
(seed 0, independent of the run's seed) holds out 20% as the test split, so every run and mesh
evaluates on the same images. Training batches come from a grain `MapDataset` shuffled with the
run's seed, grouped into global batches of which each host keeps its own rows, exactly like the
text data in `jaxscale.data.registry`; batches are `{'images': (B, 8, 8, 1) float32 in [0, 1],
'labels': (B,) int32}`. `jaxscale.data.registry.DATASETS['digits']` names the two builders below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from jaxscale.errors import ConfigError, paragraph

TEST_FRACTION = 0.2


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((train images, labels), (test images, labels)); images (N, 8, 8, 1) in [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_load
    except ImportError:
        raise ConfigError(paragraph(
            "data.corpus='digits' needs scikit-learn, which ships the 8x8 digits dataset.",
            "Install it with `pip install scikit-learn` (it is in the test extras).",
        )) from None
    digits = sk_load()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    n_test = int(len(labels) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return (images[train], labels[train]), (images[test], labels[test])


@dataclass(frozen=True)
class ImageBatches:
    """Deterministic per-host batches of (images, labels)."""

    images: np.ndarray
    labels: np.ndarray
    global_batch: int
    process_index: int = 0
    process_count: int = 1
    shard_index: int = 0
    shard_count: int = 1
    seed: int = 0

    def dataset(self) -> grain.MapDataset:
        ids = grain.MapDataset.range(len(self.labels))[self.shard_index::self.shard_count]
        if len(ids) < self.global_batch or self.global_batch % self.process_count:
            raise ConfigError(paragraph(
                f"data.batch_size={self.global_batch} does not fit: the training shard has",
                f"{len(ids)} images and there are {self.process_count} processes. Use a batch",
                "no larger than the shard and divisible by the number of processes.",
            ))
        local = self.global_batch // self.process_count
        lo = self.process_index * local
        return (ids.shuffle(seed=self.seed).repeat(None)
                .batch(self.global_batch, drop_remainder=True)
                .map(lambda idx: self._gather(np.asarray(idx)[lo:lo + local])))

    def _gather(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {"images": self.images[ids], "labels": self.labels[ids]}

    def iterator(self, state: dict | None = None) -> grain.DatasetIterator:
        it = iter(self.dataset().to_iter_dataset())
        if state is not None:
            it.set_state(state)
        return it


def test_batches(images: np.ndarray, labels: np.ndarray, global_batch: int,
                 process_index: int = 0, process_count: int = 1, pad: bool = False
                 ) -> list[dict[str, np.ndarray]]:
    """The test split in global batches, unshuffled (this host's rows of each).

    Without `pad`, only whole batches (the training loop's fixed-shape eval step). With `pad`,
    every image: the last batch is filled with blank images and each batch carries a float32
    `mask` (1 for real images), so `launch.evaluate` counts all of them exactly once.
    """
    n = len(labels)
    mask = np.ones(n, np.float32)
    if pad and n % global_batch:
        extra = global_batch - n % global_batch
        images = np.concatenate([images, np.zeros((extra,) + images.shape[1:], images.dtype)])
        labels = np.concatenate([labels, np.zeros(extra, labels.dtype)])
        mask = np.concatenate([mask, np.zeros(extra, np.float32)])
    local = global_batch // process_count
    lo = process_index * local
    out = []
    for start in range(0, len(labels) - global_batch + 1, global_batch):
        rows = slice(start + lo, start + lo + local)
        batch = {"images": images[rows], "labels": labels[rows]}
        if pad:
            batch["mask"] = mask[rows]
        out.append(batch)
    return out


def digits_test_batches(config: Any, process_index: int, process_count: int
                        ) -> list[dict[str, np.ndarray]]:
    """All 359 test images in padded, masked batches (for `jaxscale.inference.evaluate`)."""
    _, (test_x, test_y) = load_digits()
    return test_batches(test_x, test_y, config.data.batch_size, process_index, process_count,
                        pad=True)


def digits_data(config: Any, process_index: int, process_count: int,
                shard_index: int = 0, shard_count: int = 1) -> tuple[ImageBatches, list]:
    (train_x, train_y), (test_x, test_y) = load_digits()
    batch = config.data.batch_size
    batches = ImageBatches(train_x, train_y, batch, process_index, process_count,
                           shard_index, shard_count, seed=config.seed)
    evals = test_batches(test_x, test_y, batch, process_index, process_count)
    if not evals:
        raise ConfigError(f"data.batch_size={batch} exceeds the {len(test_y)} test images; "
                          "use a smaller batch.")
    return batches, evals
