"""`config.init_from`: start a run from weights saved elsewhere (fine-tuning, Lo-Fi results).

Accepted sources, tried in order:
  * a params export, `DIR/params/` (written by `launch.lofi_average --final=DIR`, and by
    `export_params`): checksummed zarr arrays + JSON manifest, no code executed on load;
  * a Lo-Fi store: its newest complete average;
  * a training workdir or checkpoint directory, through `jaxscale.checkpoint` when present.
The loaded tree must match the model exactly (same leaves, shapes); dtypes are cast to the
run's parameter dtype.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.lofi import store as store_lib


class InitFromError(JaxscaleError):
    """`config.init_from` does not point at usable weights."""


def export_params(directory: str, flat_params: dict[str, Any], meta: dict | None = None) -> str:
    """Writes `DIR/params/` in the checksummed store format; returns the directory."""
    store = store_lib.Store(directory)
    store_lib.write_checkpoint(store, "params", {k: np.asarray(v) for k, v in flat_params.items()},
                               {"kind": "params", "step": 0, "samples_seen": 0, **(meta or {})})
    return directory


def load_flat_params(path: str) -> dict[str, np.ndarray]:
    """Flat {leaf: array} from any accepted source (see module docstring)."""
    store = store_lib.Store(path)
    try:
        return store_lib.read_params(store, store_lib.load_checkpoint(store, "params"))
    except store_lib.StoreError:
        pass
    average = store_lib.latest_average_checkpoint(store)
    if average is not None:
        return store_lib.read_params(store, average)
    try:
        from jaxscale import checkpoint  # orbax training checkpoints
    except ImportError:
        checkpoint = None
    if checkpoint is not None and hasattr(checkpoint, "load_flat_params") and os.path.exists(path):
        return checkpoint.load_flat_params(path)
    raise InitFromError(paragraph(
        f"config.init_from={path!r} holds no weights jaxscale can read: no committed",
        "params/ export, no Lo-Fi average and no training checkpoint were found there.",
        "Point it at a `launch.convert` output, a `launch.lofi_average --final=DIR` directory,",
        "a Lo-Fi store, or a training workdir.",
    ))


def check_matches(flat: dict[str, np.ndarray], expected: dict[str, Any], path: str) -> None:
    """Raises naming the first leaf whose presence or shape differs from the model's."""
    missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
    if missing or extra:
        raise InitFromError(paragraph(
            f"config.init_from={path!r} does not match the model: missing leaves {missing[:5]},",
            f"unexpected leaves {extra[:5]}. Use the same model config as the saved weights.",
        ))
    for leaf, ref in expected.items():
        if tuple(flat[leaf].shape) != tuple(ref.shape):
            raise InitFromError(paragraph(
                f"config.init_from={path!r}: leaf {leaf} has shape {tuple(flat[leaf].shape)} but",
                f"the model expects {tuple(ref.shape)}. Use the same model config as the saved",
                "weights.",
            ))
