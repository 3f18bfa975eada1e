"""Sharded initialisation in four visible steps: shapes -> shardings -> jitted init -> donate.

1. `ModelDef.build` (jaxscale/models) traces the model abstractly (`nnx.eval_shape`): shapes
   and logical axes, no memory. 2. `weights.place.param_specs` resolves every parameter's
   logical axes through the rules (`state_shardings` adds the optimizer state's).
3. `init_state` jits the real initialisation with those `out_shardings`, so each device only ever
   materialises its own shards (a full copy never exists on one device). 4. The train step
   donates the state. Parameters are held as plain nested dicts (the NNX state's pure form):
   easy to checkpoint, average and convert, and merged back into the NNX module inside jit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.models import ModelDef
from jaxscale.optim import on_host
from jaxscale.rules import AxisRules, as_tuple
from jaxscale.weights.place import param_specs

# merge_trees: used by train/step.py (the train state keeps trainable and frozen apart).
from jaxscale.weights.tree import all_trainable, flatten, merge_trees, split_trainable, unflatten  # noqa: F401

Tree = Any


@flax.struct.dataclass
class TrainState:
    step: jax.Array            # int32 scalar
    params: Tree               # trainable parameters (nested dict)
    frozen: Tree               # parameters without gradients or optimizer state (e.g. LoRA base)
    opt_state: Tree
    rng: jax.Array
    extra: dict                # policy state such as the dynamic loss scale
    # A preference objective's frozen reference model (`train/reference.py`), sharded as the
    # parameters are; never checkpointed (a resumed run builds it again). {}: none held.
    reference: Tree = flax.struct.field(default_factory=dict)


def derived_spec(param_shape: tuple, spec: PartitionSpec, leaf_shape: tuple,
                 mesh: Mesh | None = None) -> PartitionSpec | None:
    """The sharding of an optimizer statistic derived from a parameter, or None if unrelated.

    Same shape: the parameter's spec (Adam / LAMB / SGD moments, 8-bit Adam's int8 moments).
    One dimension fewer (Adafactor's factored row / column statistics): the spec without that
    dimension. Same rank, only the last dimension differs (8-bit Adam's per-block scales along
    the last axis): the spec, the last dimension keeping its mesh axes only when they divide
    the number of blocks (with `mesh` given; replicated otherwise).
    """
    axes = tuple(spec) + (None,) * (len(param_shape) - len(spec))
    if tuple(leaf_shape) == tuple(param_shape):
        return PartitionSpec(*axes)
    if len(leaf_shape) == len(param_shape) - 1:
        for k in range(len(param_shape)):
            if param_shape[:k] + param_shape[k + 1:] == tuple(leaf_shape):
                return PartitionSpec(*(axes[:k] + axes[k + 1:]))
    if (len(leaf_shape) == len(param_shape) > 0
            and tuple(leaf_shape[:-1]) == tuple(param_shape[:-1])):
        last = axes[-1]
        names = as_tuple(last)
        size = math.prod(mesh.shape[a] for a in names) if mesh is not None and names else 0
        keep = size and leaf_shape[-1] % size == 0
        return PartitionSpec(*axes[:-1], last if keep else None)
    return None


def _opt_state_shardings(abstract_opt: Tree, flat_param_sh: Mapping[str, NamedSharding],
                         flat_shapes: Mapping[str, Any], mesh: Mesh) -> Tree:
    """Optimizer-state leaves derived from a parameter (found by the parameter's path at the
    end of the leaf's key path) are sharded like it (`derived_spec`); others replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(keypath, leaf):
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in keypath]
        for start in range(len(names)):
            path = "/".join(names[start:])
            if path in flat_param_sh:
                shape = tuple(flat_shapes[path].shape)
                spec = derived_spec(shape, flat_param_sh[path].spec, tuple(leaf.shape), mesh)
                return NamedSharding(mesh, spec) if spec is not None else replicated
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_opt)


def base_extra() -> dict:
    """Counters every run keeps: non-finite steps seen, and the first one (-1: none)."""
    return {"nonfinite_steps": jnp.zeros((), jnp.int32),
            "first_nonfinite": jnp.full((), -1, jnp.int32)}


# (trainable, frozen) -> the state's `reference` (`train/reference.initial_reference`)
InitReference = Callable[[Any, Any], Any]


def no_reference(trainable: Any, frozen: Any) -> dict:
    return {}


def _initializer(model_def: ModelDef, optimizer: optax.GradientTransformation,
                 is_trainable: Callable[[str], bool], init_extra: Callable[[], dict],
                 init_reference: InitReference = no_reference):
    def init(rng: jax.Array, loaded: Mapping[str, jax.Array] | None = None) -> TrainState:
        """The initial state; parameters in `loaded` ({path: array}, `config.init_from`'s)
        replace the random ones, whose computation XLA then drops as unused."""
        params_rng, state_rng = jax.random.split(rng)
        params = model_def.init_params(params_rng)
        if loaded:
            params = unflatten({**flatten(params), **loaded})
        trainable, frozen = split_trainable(params, is_trainable)
        return TrainState(jnp.zeros((), jnp.int32), trainable, frozen,
                          optimizer.init(trainable), state_rng, {**base_extra(), **init_extra()},
                          init_reference(trainable, frozen))
    return init


def abstract_state(model_def: ModelDef, optimizer: optax.GradientTransformation,
                   rules: AxisRules, mesh: Mesh, is_trainable: Callable[[str], bool] = all_trainable,
                   init_extra: Callable[[], dict] = dict, offload_opt: bool = False,
                   init_reference: InitReference = no_reference
                   ) -> tuple[TrainState, TrainState]:
    """(ShapeDtypeStructs carrying their shardings, shardings) without allocating anything;
    `offload_opt`: the optimizer state in pinned host memory (`optim.on_host`)."""
    init = _initializer(model_def, optimizer, is_trainable, init_extra, init_reference)
    shapes = jax.eval_shape(init, jax.random.key(0))
    shardings = state_shardings(shapes, model_def, rules, mesh, offload_opt)
    with_sharding = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    return with_sharding, shardings


def init_state(model_def: ModelDef, optimizer: optax.GradientTransformation, rules: AxisRules,
               mesh: Mesh, seed: int, is_trainable: Callable[[str], bool] = all_trainable,
               init_extra: Callable[[], dict] = dict, offload_opt: bool = False,
               init_reference: InitReference = no_reference,
               loaded: Mapping[str, jax.Array] | None = None) -> tuple[TrainState, TrainState]:
    """Creates the TrainState already sharded; returns (state, its shardings). `loaded`:
    parameters placed with the state's shardings ({path: array}, `weights.init_from.
    load_params`), which become the state's own buffers (donated: never copied)."""
    init = _initializer(model_def, optimizer, is_trainable, init_extra, init_reference)
    _, shardings = abstract_state(model_def, optimizer, rules, mesh, is_trainable, init_extra,
                                  offload_opt, init_reference)
    make = jax.jit(init, out_shardings=shardings, donate_argnums=1)
    return make(jax.random.key(seed), dict(loaded or {})), shardings


def state_shardings(abstract: TrainState, model_def: ModelDef, rules: AxisRules,
                    mesh: Mesh, offload_opt: bool = False) -> TrainState:
    """NamedShardings for every leaf of an (abstract) TrainState; with `offload_opt` the
    optimizer state's are in pinned host memory."""
    flat_sh = {p: NamedSharding(mesh, s) for p, s in param_specs(model_def, rules, mesh).items()}
    shapes = model_def.shapes()
    replicated = NamedSharding(mesh, PartitionSpec())
    by_path = lambda tree: unflatten({p: flat_sh[p] for p in flatten(tree)}) if tree else {}
    return TrainState(
        step=replicated, params=by_path(abstract.params), frozen=by_path(abstract.frozen),
        opt_state=(on_host if offload_opt else lambda t: t)(
            _opt_state_shardings(abstract.opt_state, flat_sh, shapes, mesh)),
        rng=replicated, extra=jax.tree.map(lambda _: replicated, abstract.extra),
        reference=by_path(abstract.reference))
