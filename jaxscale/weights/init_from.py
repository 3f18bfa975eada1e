"""`config.init_from`: start a run from weights saved elsewhere (fine-tuning, Lo-Fi results).

Any location `jaxscale.weights.sources.open_weights` reads is accepted (a params export, a
training workdir, a Lo-Fi store's newest average, a Hugging Face directory); a run whose model
is a stand-in takes its model from there first (`weights/resolve.py`). `load_params`, the one
function the train loop calls, checks that the saved weights fit the run's model (the tree
must match exactly: same leaves, shapes; weights that record their model fields must run with
them, `resolve.SAFE` aside) and places the leaves one at a time with
`jaxscale.weights.place`, casting them to the run's parameter dtype. This module also writes
params exports (`export_params`) in the snapshot format (`weights/snapshot.py`).
"""

from __future__ import annotations

from typing import Any

from jaxscale.errors import paragraph
from jaxscale.models.adapters import lora
from jaxscale.weights.kv import Store
from jaxscale.weights.place import place
from jaxscale.weights.resolve import InitFromError, check_model, mismatches
from jaxscale.weights.snapshot import PARAMS, write_snapshot
from jaxscale.weights.sources import WeightsError, open_weights, recorded
from jaxscale.weights.tree import flatten


def load_params(path: str, abstract: Any, shardings: Any, model_cfg: Any = None
                ) -> dict[str, Any]:
    """{parameter path: jax.Array} of the saved weights at `path`, each placed as the run's
    own (`abstract` and `shardings`: `train.state.TrainState`s of its shapes and shardings,
    read by field name: weights sit below train) and cast to its dtype. They fill both the
    trainable and the frozen parameters (a LoRA base, a router's balancing bias); adapters are
    left out and start fresh. `train.state.init_state` builds the state around them, so the
    random weights they replace are never made: no second copy of the model at start-up.

    Leaves are read and placed one at a time (`open_weights` + `place`), so a converted model
    never sits whole on the host.
    """
    like = {k: v for part in ("params", "frozen")
            for k, v in flatten(getattr(abstract, part)).items() if not lora.is_adapter(k)}
    leaves = checked_leaves(path, like, model_cfg)
    sh = {k: v for part in ("params", "frozen") for k, v in flatten(getattr(shardings, part)).items()}
    return place(leaves, {k: sh[k] for k in like}, like)


def checked_leaves(path: str, like: dict[str, Any], model_cfg: Any = None) -> dict[str, Any]:
    """The (lazy) leaves of the weights at `path`, adapters left out, once the model fields
    they record and every leaf's presence and shape match `like` ({path: array or
    ShapeDtypeStruct} of the run's model): what `train` checks before it loads them, and
    `inspect` before it reports a run (metadata only; nothing is read)."""
    check_model_config(path, model_cfg)
    try:
        leaves = open_weights(path).leaves
    except WeightsError as e:
        raise InitFromError(f"config.init_from: {e}") from None
    leaves = {k: v for k, v in leaves.items() if not lora.is_adapter(k)}
    like = {k: v for k, v in like.items() if not lora.is_adapter(k)}
    check_matches({k: v.shape for k, v in leaves.items()}, like, path, model_cfg)
    return leaves


def export_params(directory: str, flat_params: dict[str, Any], meta: dict | None = None) -> str:
    """Writes `DIR/params/` in the checksummed snapshot format; returns the directory.

    Values may be anything `np.asarray` converts (host or device arrays, lazy leaves): they
    are converted one at a time while writing, so a lazy source is never all on the host.
    """
    write_snapshot(Store(directory), PARAMS, dict(flat_params),
                   {"kind": "params", "step": 0, "samples_seen": 0, **(meta or {})})
    return directory


def _model_hint(path: str, model_cfg: Any) -> str:
    saved = recorded(path).model if model_cfg is not None else None
    if saved is None:
        return ("The weights record no model fields (no model_config.json or config.json beside"
                " them): give config.model the fields they were made with.")
    wrong = mismatches(model_cfg, saved)
    return (f"The weights were made with other model fields; add {' '.join(flags(wrong))}, or "
            "take the model from the weights with --config.model_from_weights=true."
            if wrong else "Use the same model config as the saved weights.")


def flags(wrong: list[tuple[str, Any, Any]]) -> list[str]:
    return [f"--config.model.{k}={b}" for k, _, b in wrong]


def check_model_config(path: str, model_cfg: Any) -> None:
    """Weights that record their model (a conversion, a training workdir, a Lo-Fi export, a
    Hugging Face directory) must run with it: every field outside `resolve.SAFE` equal.

    Shapes alone do not catch a different rope_theta, norm_eps or a tied head of equal shape,
    which would silently compute another model; this compares every recorded field.
    """
    if model_cfg is None:
        return
    saved = recorded(path).model
    if saved is not None:
        check_model(model_cfg, saved, path)


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


def check_init_from(config: Any) -> None:
    """`config.init_from`'s weights checked as `train` checks them when it loads them
    (`load_params`: the recorded model fields, then every leaf's presence and shape), reading
    their metadata only: `jaxscale inspect` must not report a run train refuses."""
    path = config.get("init_from")
    if not path:
        return
    from jaxscale.models import ModelDef
    from jaxscale.precision import get_policy

    checked_leaves(path, ModelDef.build(config.model, get_policy(config.precision)).shapes(),
                   config.model)
