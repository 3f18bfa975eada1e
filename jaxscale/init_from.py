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
    """Writes `DIR/params/` in the checksummed store format; returns the directory.

    Values may be anything `np.asarray` converts (host or device arrays, lazy leaves): they
    are converted one at a time while writing, so a lazy source is never all on the host.
    """
    store = store_lib.Store(directory)
    store_lib.write_snapshot(store, "params", dict(flat_params),
                               {"kind": "params", "step": 0, "samples_seen": 0, **(meta or {})})
    return directory


def load_flat_params(path: str) -> dict[str, np.ndarray]:
    """Flat {leaf: array} from any accepted source (see module docstring)."""
    store = store_lib.Store(path)
    try:
        return store_lib.read_params(store, store_lib.load_snapshot(store, "params"))
    except store_lib.StoreError:
        pass
    average = store_lib.latest_average_snapshot(store)
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


class LeafSource:
    """The leaves of an init_from source: shapes known up front, values read one at a time.

    Params exports and Lo-Fi averages are read leaf by leaf from the store, so starting a run
    from them never holds more than one parameter on the host; orbax training checkpoints are
    restored whole (they were written by a run of the same size).
    """

    def __init__(self, path: str):
        self.path = path
        store = store_lib.Store(path)
        try:
            ckpt = store_lib.load_snapshot(store, "params")
        except store_lib.StoreError:
            ckpt = store_lib.latest_average_snapshot(store)
        if ckpt is not None:
            self.shapes = {k: tuple(e["shape"]) for k, e in ckpt.leaves.items()}
            self._read = lambda leaf: store_lib.read_leaf(store, ckpt, leaf)
        else:
            flat = load_flat_params(path)
            self.shapes = {k: tuple(np.shape(v)) for k, v in flat.items()}
            self._read = flat.pop  # each leaf handed out once, then dropped

    def read(self, leaf: str) -> np.ndarray:
        return np.asarray(self._read(leaf))


def place_leaves(source: LeafSource, shardings: dict[str, Any], like: dict[str, Any]
                 ) -> dict[str, Any]:
    """{leaf: jax.Array} in the run's shardings and dtypes, reading one leaf at a time."""
    import jax

    placed = {}
    for leaf, sharding in shardings.items():
        arr = source.read(leaf).astype(like[leaf].dtype)
        placed[leaf] = jax.make_array_from_callback(arr.shape, sharding,
                                                    lambda idx, a=arr: a[idx])
        del arr
    return placed


def _saved_model_config(path: str) -> dict | None:
    """The `config.model` fields a launch.convert output was converted with, if any. Read
    through etils.epath, as orbax reads the weights beside it, so gs:// outputs are checked
    too."""
    import json

    from etils import epath

    meta = epath.Path(path) / "model_config.json"
    return json.loads(meta.read_text()) if meta.exists() else None


def _differing_flags(saved: dict, model_cfg: Any, skip: tuple[str, ...] = ()) -> list[str]:
    return [f"--config.model.{k}={v}" for k, v in saved.items()
            if k not in skip and model_cfg.get(k) != v]


def _model_hint(path: str, model_cfg: Any) -> str:
    saved = _saved_model_config(path) if model_cfg is not None else None
    flags = _differing_flags(saved, model_cfg) if saved else []
    return (f"The weights were converted with different model fields; add {' '.join(flags)}."
            if flags else "Use the same model config as the saved weights.")


# Fields a run may change on purpose: a longer context only extends the rotary positions.
ADJUSTABLE = ("max_len",)


def check_model_config(path: str, model_cfg: Any) -> None:
    """A launch.convert output must run with the model fields it was converted with.

    Shapes alone do not catch a different rope_theta, norm_eps or a tied head of equal shape,
    which would silently compute another model; this compares every converted field.
    """
    saved = _saved_model_config(path)
    if saved is None or model_cfg is None:
        return
    flags = _differing_flags(saved, model_cfg, ADJUSTABLE)
    if flags:
        raise InitFromError(paragraph(
            f"config.init_from={path!r} was converted from a model whose fields differ from",
            f"config.model, so the run would compute a different model. Add {' '.join(flags)}",
            "(launch.convert printed them).",
        ))


def check_matches(shapes: dict[str, tuple], expected: dict[str, Any], path: str,
                  model_cfg: Any = None) -> None:
    """Raises naming the first leaf whose presence or shape differs from the model's."""
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or extra:
        raise InitFromError(paragraph(
            f"config.init_from={path!r} does not match the model: missing leaves {missing[:5]},",
            f"unexpected leaves {extra[:5]}.", _model_hint(path, model_cfg),
        ))
    for leaf, ref in expected.items():
        if tuple(shapes[leaf]) != tuple(ref.shape):
            raise InitFromError(paragraph(
                f"config.init_from={path!r}: leaf {leaf} has shape {tuple(shapes[leaf])} but",
                f"the model expects {tuple(ref.shape)}.", _model_hint(path, model_cfg),
            ))
