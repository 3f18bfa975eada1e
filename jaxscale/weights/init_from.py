"""`config.init_from`: start a run from weights saved elsewhere (fine-tuning, Lo-Fi results).

Any location `jaxscale.weights.sources.open_weights` reads is accepted (a params export, a
training workdir, a Lo-Fi store's newest average, a Hugging Face directory). `init_params`, the
one function the train loop calls, checks that the saved weights fit the run's model (the tree
must match exactly: same leaves, shapes; a conversion output must be used with the model
fields it was converted with) and places the leaves one at a time with
`jaxscale.weights.place`, casting them to the run's parameter dtype. This module also writes
params exports (`export_params`) in the snapshot format (`weights/snapshot.py`).
"""

from __future__ import annotations

from typing import Any

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.models.adapters import lora
from jaxscale.weights.kv import Store
from jaxscale.weights.place import place
from jaxscale.weights.snapshot import PARAMS, write_snapshot
from jaxscale.weights.sources import WeightsError, open_weights
from jaxscale.weights.tree import flatten, unflatten


class InitFromError(JaxscaleError):
    """`config.init_from` does not point at usable weights."""


def init_params(path: str, state: Any, shardings: Any, model_cfg: Any = None) -> Any:
    """`state` (a `train.state.TrainState`, read by field name: weights sit below train) with
    its freshly initialised parameters replaced by the saved ones at `path`, placed by
    `shardings` (the same TrainState of shardings). LoRA runs (a frozen base) take the saved
    weights as the frozen base; their adapters start fresh.

    Leaves are read and placed one at a time (`open_weights` + `place`), so a converted model
    never sits whole on the host.
    """
    check_model_config(path, model_cfg)
    try:
        leaves = open_weights(path).leaves
    except WeightsError as e:
        raise InitFromError(f"config.init_from: {e}") from None
    part = "frozen" if state.frozen else "params"
    if state.frozen:
        leaves = {k: v for k, v in leaves.items() if not lora.is_adapter(k)}
    like = flatten(getattr(state, part))
    check_matches({k: v.shape for k, v in leaves.items()}, like, path, model_cfg)
    placed = place(leaves, flatten(getattr(shardings, part)), like)
    return state.replace(**{part: unflatten(placed)})


def export_params(directory: str, flat_params: dict[str, Any], meta: dict | None = None) -> str:
    """Writes `DIR/params/` in the checksummed snapshot format; returns the directory.

    Values may be anything `np.asarray` converts (host or device arrays, lazy leaves): they
    are converted one at a time while writing, so a lazy source is never all on the host.
    """
    write_snapshot(Store(directory), PARAMS, dict(flat_params),
                   {"kind": "params", "step": 0, "samples_seen": 0, **(meta or {})})
    return directory


def _saved_model_config(path: str) -> dict | None:
    """The `config.model` fields a launch.convert output was converted with, if any. Read
    through etils.epath, as orbax reads the weights beside it, so gs:// outputs are checked
    too."""
    import json

    from jaxscale.storage import locations

    if str(path).startswith("memory://"):
        return None
    meta = locations.epath(locations.join(str(path), "model_config.json"))
    return json.loads(meta.read_text()) if meta.exists() else None


def _differing_flags(saved: dict, model_cfg: Any, skip: tuple[str, ...] = ()) -> list[str]:
    return [f"--config.model.{k}={v}" for k, v in saved.items()
            if k not in skip and _plain(model_cfg.get(k)) != _plain(v)]


def _plain(value: Any) -> Any:
    """A sequence as a list: JSON keeps a tuple field (Gemma's `layer_types`) as a list."""
    return list(value) if isinstance(value, (list, tuple)) else value


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
