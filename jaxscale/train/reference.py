"""The frozen reference model of `dpo` / `ipo`: which weights it is, where they live, how placed.

`objective.reference = "init"` is the weights training starts from (after `config.init_from`),
`objective.reference = PATH` any weights `weights.sources.open_weights` reads (a training
workdir or checkpoint, a params export, a Hugging Face directory); either must fit the model.
They live in the train state's `reference` field, sharded exactly as the parameters are (the
same rules, `state.state_shardings`), so ahead-of-time compilation counts them as the run holds
them. With LoRA, `"init"` is the frozen base with the adapters off: the model without adapters
bound to `state.frozen`, no second copy. The reference is never checkpointed: a resumed run
builds it again as the first run did (the same `init_from` and seed, or the same path), so a
resumed run equals the uninterrupted one. The train step donates the state and passes the
reference through unchanged (its buffers aliased, never copied).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import ml_collections as mlc
import numpy as np

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.models import ModelDef
from jaxscale.models.adapters import lora
from jaxscale.objectives import Settings, holds_reference, objective_of
from jaxscale.precision import get_policy
from jaxscale.weights.place import place
from jaxscale.weights.sources import WeightsError, open_weights, recorded
from jaxscale.weights.tree import flatten, merge_trees, unflatten

Tree = Any


class ReferenceError(JaxscaleError):
    """`objective.reference` names weights that cannot be the reference model."""


@dataclass(frozen=True)
class Reference:
    """How the step binds the reference model: `model_def` (the model without adapters) bound
    to `state.reference`, or, for LoRA's `"init"`, to `state.frozen` (`in_state` False)."""

    model_def: ModelDef
    in_state: bool

    def params(self, frozen: Tree, reference: Tree) -> Tree:
        return reference if self.in_state else frozen


def reference_for(config: mlc.ConfigDict) -> Reference | None:
    """The reference of `config`'s objective, or None for an objective without one."""
    if not objective_of(config).uses_reference:
        return None
    base = ModelDef.build(config.model, get_policy(config.precision))
    return Reference(base, holds_reference(config))


def base_of(params: Tree) -> dict:
    """`params` without LoRA adapters (the whole tree of a run without LoRA)."""
    return unflatten({k: v for k, v in flatten(params).items() if not lora.is_adapter(k)})


def initial_reference(config: mlc.ConfigDict) -> Callable[[Tree, Tree], Tree]:
    """For sharded initialisation: (trainable, frozen) -> the state's `reference` (shapes and
    placement; its values are set by `set_reference` once the starting weights are known)."""
    if not holds_reference(config):
        return lambda trainable, frozen: {}
    return lambda trainable, frozen: base_of(merge_trees(trainable, frozen))


def set_reference(config: mlc.ConfigDict, state: Any, shardings: Any) -> Any:
    """`state` with its `reference` filled: a copy of the starting weights (`"init"`: the
    state's parameters after `init_from`, in buffers of their own, as the step donates the
    state) or the weights at the path, placed by the same shardings."""
    if not holds_reference(config):
        return state
    target = flatten(shardings.reference)
    s = Settings.from_config(config.objective)
    if s.reference == "init":
        start = flatten(base_of(merge_trees(state.params, state.frozen)))
        copies = {k: jax.device_put(v, target[k], may_alias=False) for k, v in start.items()}
        return state.replace(reference=unflatten(copies))
    like = flatten(state.reference)
    return state.replace(reference=unflatten(place(reference_leaves(s.reference, like,
                                                                    config.model),
                                                   target, like)))


def reference_leaves(path: str, like: Mapping[str, Any], model_cfg: Any) -> dict:
    """The leaves at `path`, checked to be the model's weights (no adapters: a LoRA run's
    workdir gives its merged weights)."""
    from jaxscale.weights.sources import merged_params

    try:
        check_reference_model(path, model_cfg)
        weights = open_weights(path)
        leaves = weights.leaves
        if any(lora.is_adapter(k) for k in leaves):  # a LoRA run: its adapters folded in
            leaves = {k: np.asarray(v) for k, v in flatten(merged_params(weights)).items()}
    except WeightsError as e:
        raise ReferenceError(f"objective.reference: {e}") from None
    missing, extra = sorted(set(like) - set(leaves)), sorted(set(leaves) - set(like))
    wrong = [k for k in like if k in leaves and tuple(leaves[k].shape) != tuple(like[k].shape)]
    if missing or extra or wrong:
        raise ReferenceError(paragraph(
            f"objective.reference={path!r} is not this model's weights: missing {missing[:3]},",
            f"unexpected {extra[:3]}, of another shape {wrong[:3]}. Point it at weights of",
            "the model being trained (the same config.model), or use 'init'."))
    return leaves


def check_reference_model(path: str, model_cfg: Any) -> None:
    """Refuses reference weights that record another model than the policy's (`config.model`,
    already resolved against `config.init_from`). The fix is never to change the policy's
    model, as `init_from`'s message would suggest: the objective compares the two models'
    log-probabilities, so the reference must be the policy's own model."""
    from jaxscale.weights.resolve import mismatches

    saved = recorded(path).model if model_cfg is not None else None
    wrong = mismatches(model_cfg, saved) if saved is not None else []
    if wrong:
        raise ReferenceError(paragraph(
            f"objective.reference={path!r} holds another model than the policy being trained:",
            "; ".join(f"model.{k} is {a!r} for the policy but {b!r} in the reference"
                      for k, a, b in wrong) + ".",
            "The objective compares the policy with the reference on the same tokens, so the",
            "reference must be weights of the policy's model: leave objective.reference=init",
            "(the weights training starts from), or point it at a run or export of this model.",
        ))


def host_reference(config: mlc.ConfigDict) -> dict | None:
    """The reference weights of a finished run, rebuilt on the host as the run built them
    (flat; None for an objective without a reference): what `jaxscale evaluate` scores
    against. `"init"`: `config.init_from`'s weights, else the seed's initialisation (under
    LoRA the base, which the run kept frozen)."""
    if not objective_of(config).uses_reference:
        return None
    s = Settings.from_config(config.objective)
    model_def = ModelDef.build(config.model, get_policy(config.precision))
    like = model_def.shapes()
    if s.reference != "init":
        return {k: np.asarray(v) for k, v in reference_leaves(s.reference, like,
                                                              config.model).items()}
    saved = open_weights(config.init_from).leaves if config.get("init_from") else {}
    if set(like) <= set(saved):
        return {k: np.asarray(saved[k], like[k].dtype) for k in like}
    params_rng, _ = jax.random.split(jax.random.key(config.seed))  # as train.state does
    adapted = lora.with_adapters(model_def, config.lora)
    flat = flatten(base_of(jax.jit(adapted.init_params)(params_rng)))
    return {k: np.asarray(saved[k], like[k].dtype) if k in saved else np.asarray(v)
            for k, v in flat.items()}
