"""Where each parameter goes on a mesh (`param_specs`) and the one function that puts it there
(`place(leaves, shardings, dtype)`).

`param_specs` resolves every parameter's logical axes through the rules: the train state,
Hugging Face import, evaluation and generation all place weights with it, so loading a model
never needs the train state.

Leaves may be host arrays (numpy), device arrays, or lazily-read leaves (`sources.Leaf`, which
read any part of a parameter on demand). Each parameter is assembled only for the shards this
process holds, every distinct shard is read once (replicas share it), and the previous
parameter's host copy is dropped before the next is read: at most one parameter is on the host
at a time, so a model larger than one device's memory loads onto a mesh, and on several hosts
each reads only its own part. Arrays already placed with the wanted sharding and dtype are
kept as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec, Sharding

from jaxscale.models import ModelDef
from jaxscale.rules import AxisRules

# Flax's keyword for a variable's sharding (renamed from `sharding_names` in flax 0.12.4); the
# only place jaxscale spells it.
FLAX_SHARDING_KEY = "out_sharding"


def sharded_abstract(model_def: ModelDef, rules: AxisRules, mesh: Mesh) -> nnx.State:
    """A copy of the abstract NNX state whose variables carry their resolved PartitionSpecs in
    Flax's sharding metadata, so `nnx.get_partition_spec` and NNX tooling see jaxscale's rules."""
    state = jax.tree.map(lambda x: x, model_def.abstract)
    for path, var in nnx.to_flat_state(state):
        name = "/".join(map(str, path))
        spec = rules.spec(var.get_metadata()["logical_axes"], var.shape, mesh, name)
        var.set_metadata(**{FLAX_SHARDING_KEY: tuple(spec)})
    return state


def param_specs(model_def: ModelDef, rules: AxisRules, mesh: Mesh) -> dict[str, PartitionSpec]:
    """Flat {path: PartitionSpec} for every parameter, resolved through the rules."""
    specs = nnx.get_partition_spec(sharded_abstract(model_def, rules, mesh))
    return {"/".join(map(str, path)): var.get_value()
            for path, var in nnx.to_flat_state(specs)}


def place(leaves: Mapping[str, Any], shardings: Mapping[str, Sharding],
          dtype: Any | Mapping[str, Any]) -> dict[str, jax.Array]:
    """{path: jax.Array} for every path of `shardings`, read from `leaves` and cast to `dtype`
    (one dtype for all, or {path: dtype}, e.g. the run's own parameters)."""
    out = {}
    for path, sharding in shardings.items():
        dt = dtype[path] if isinstance(dtype, Mapping) else dtype
        if not isinstance(dt, (np.dtype, type, str)):  # an array or ShapeDtypeStruct
            dt = dt.dtype
        out[path] = place_leaf(leaves[path], sharding, dt)
    return out


def place_leaf(value: Any, sharding: Sharding, dtype: Any) -> jax.Array:
    """One parameter as a global jax.Array with `sharding`, built from its local shards."""
    dtype = np.dtype(dtype)
    if (isinstance(value, jax.Array) and value.dtype == dtype
            and value.sharding.is_equivalent_to(sharding, value.ndim)):
        return value
    shape = tuple(value.shape)
    read = _reader(value)
    full = lambda idx: tuple(idx) + (slice(None),) * (len(shape) - len(tuple(idx)))
    key = lambda idx: tuple(s.indices(n) for s, n in zip(full(idx), shape))
    shards: dict[tuple, np.ndarray] = {}
    for idx in sharding.addressable_devices_indices_map(shape).values():
        if key(idx) not in shards:
            shards[key(idx)] = np.asarray(read(full(idx)), dtype=dtype)
    return jax.make_array_from_callback(shape, sharding, lambda idx: shards[key(idx)])


def _reader(value: Any) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """How to read one part: lazy leaves that read slices cheaply (`reads_slices`) read just
    that part; anything else is converted to one host array once and sliced."""
    if getattr(value, "reads_slices", False):
        return value.read
    if isinstance(value, jax.Array):
        value = jax.device_get(value)
    host = np.asarray(value)
    return lambda idx: host[idx]


def named_shardings(mesh: Any, specs: Mapping[str, Any]) -> dict[str, Sharding]:
    """{path: NamedSharding} from {path: PartitionSpec} (e.g. `param_specs`)."""
    from jax.sharding import NamedSharding
    return {path: NamedSharding(mesh, spec) for path, spec in specs.items()}
