"""Ordered logical-axis rules -> PartitionSpecs, for parameters and activations.

Rules are an ordered list of `(logical_name, mesh_axis | tuple_of_mesh_axes | None)`. Resolution
follows flax linen's `logical_to_mesh_axes`: rules are visited in order and a rule assigns its
mesh axes to the dimension carrying its logical name only if that dimension is still unassigned
and none of the rule's mesh axes is already used by this array. Unmatched names are replicated.
This lets MaxText-style fallbacks work: `('embed', ('fsdp', 'tensor'))` then `('embed', 'fsdp')`.
jaxscale owns this resolver (flax NNX's turns rules into a dict, so the last rule would win) and
only hands NNX finished PartitionSpecs. This module is the one place that knows how parameters
and activations are sharded: models call `constrain(x, 'batch', 'length', 'embed')` and declare
`logical_axes` on parameters, nothing else.

The rules presets (`PRESETS`), one per parallelism strategy: `--config.rules_preset=NAME`.
A preset replaces `config.rules` (see `AxisRules.from_config`); model code never changes. Every
preset is valid on every mesh (an axis of size 1 costs nothing), so a preset says which mesh
axes are *allowed* to shard what, and `config.mesh` says how large they are. Every preset puts
the stacked `layers` dimension on `pipeline`, so any of them runs pipeline stages when
`mesh.pipeline` > 1 (each stage stores only its own layers):

- `dp`: parameters replicated, batch split over `data` (and `fsdp`, if that axis is > 1).
- `fsdp`: ZeRO-3, parameters/gradients/optimizer state split over `fsdp` on their embed
  dimension (mlp/vocab as fallbacks), gathered layer by layer inside the scanned stack.
- `tp`: Megatron tensor parallelism: heads, kv heads, the mlp hidden and vocab dims over `tensor`.
- `fsdp_tp`: both (the default rules, `config.DEFAULT_RULES`).
- `pp`: pipeline stages over `pipeline` with FSDP and TP inside them (the same rules as
  `fsdp_tp`; the name says what the mesh is for).

Every preset also puts the `length` of activations on `context` (free when `mesh.context` is 1):
with `mesh.context` > 1 norms, MLPs and projections run on sequence shards and attention runs across
them (`models/attention/sequence/context.py`, `model.context_attention`). Weights have no `length`.

Every preset also puts MoE experts (`models/moe/layer.py`) on `expert` and splits the batch over it
as over `data` (free when `mesh.expert` is 1): with `mesh.expert` > 1 each device holds num_experts
/ expert of the experts and its own rows of the batch; tokens travel to their experts' devices and
back (an all-to-all), the weights never do.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.errors import ConfigError, RulesError, paragraph

MeshAxes = str | tuple[str, ...] | None
Rule = tuple[str, MeshAxes]

_BATCH = ("batch", ("data", "fsdp", "expert"))
# Replicated, except the sequence `length` of activations over `context` (context parallelism)
# and MoE experts over `expert` (expert parallelism).
_REPLICATED = [("length", "context"), ("head_dim", None), ("norm", None), ("lora_rank", None),
               ("fused", None),  # the q/k/v and gate/up parts of a fused weight
               ("expert", "expert"),  # MoE experts (models/moe/layer.py)
               ("expert_batch", ("data", "fsdp")),  # rows of the experts' capacity buffers
               ("q_lora", None), ("kv_lora", None)]  # latent attention's (when not on fsdp)
_STAGES = [("layers", "pipeline")]
_TP = [("vocab", "tensor"), ("heads", "tensor"), ("kv", "tensor"), ("mlp", "tensor")]
# q_lora / kv_lora: latent attention's bottleneck dims (models/attention/latent.py), whose
# up-projections have no embed dimension to shard.
_FSDP = [("embed", "fsdp"), ("mlp", "fsdp"), ("vocab", "fsdp"), ("q_lora", "fsdp"),
         ("kv_lora", "fsdp")]

PRESETS: dict[str, list[Rule]] = {
    "dp": [_BATCH, ("vocab", None), ("heads", None), ("kv", None), ("mlp", None),
           ("embed", None)] + _REPLICATED + _STAGES,
    "fsdp": [_BATCH] + _FSDP + [("heads", None), ("kv", None)] + _REPLICATED + _STAGES,
    "tp": [_BATCH] + _TP + [("embed", None)] + _REPLICATED + _STAGES,
    "fsdp_tp": [_BATCH] + _TP + _FSDP + _REPLICATED + _STAGES,
    "pp": [_BATCH] + _TP + _FSDP + _REPLICATED + _STAGES,
}


def as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    """One spec entry (None, an axis name or a tuple of them) as a tuple of mesh axis names."""
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def rule_axes(rules: Sequence[Sequence[Any]]) -> set[str]:
    """Mesh axes that at least one rule may shard over."""
    return {axis for _, mesh_axes in rules if mesh_axes for axis in as_tuple(mesh_axes)}


def check_mesh_use(rules: Sequence[Sequence[Any]], sizes: dict[str, int], preset: str) -> None:
    """A mesh axis > 1 (`sizes`: mesh.AXIS x mesh.dcn_AXIS) that no rule uses only duplicates
    work (e.g. the `fsdp` preset with mesh.tensor=4 compiles to 4x the compute and 4x the state
    per chip): refused (`config.validate`). `preset`: the rules' preset name, '' for
    config.rules."""
    used = rule_axes(rules)
    for axis, size in sizes.items():
        if size > 1 and axis not in used:
            users = [name for name, r in PRESETS.items() if axis in rule_axes(r)]
            what = f"rules preset {preset!r}" if preset else "config.rules"
            raise ConfigError(paragraph(
                f"The mesh axis '{axis}' has size {size} (mesh.{axis} x mesh.dcn_{axis}), but no",
                f"rule of {what} shards anything over it, so every device along it would",
                "repeat the same work and hold the same state. Use a preset that uses",
                f"'{axis}' ({', '.join(users)}: --config.rules_preset={users[0] if users else ''}),",
                f"add a rule naming it, or set --config.mesh.{axis}=1.",
            ))


def from_tuple(axes: Sequence[str]) -> MeshAxes:
    """`as_tuple`'s inverse, in a spec entry's shortest form: () -> None, ('a',) -> 'a'."""
    axes = tuple(axes)
    return axes if len(axes) > 1 else (axes[0] if axes else None)


def normalize_rules(rules: Sequence[Sequence[Any]]) -> tuple[Rule, ...]:
    """Validates the rules' shape (pairs of name and mesh axes) and freezes them into tuples."""
    out = []
    for i, rule in enumerate(rules):
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise RulesError(paragraph(
                f"Rule #{i} {rule!r} is malformed. Each rule is a pair",
                "(logical_name, mesh_axis | (mesh_axis, ...) | None), e.g. ('embed', 'fsdp').",
            ))
        axes = rule[1]
        if isinstance(axes, list):
            axes = tuple(axes)
        if axes is not None and not isinstance(axes, (str, tuple)):
            raise RulesError(f"Rule #{i} {rule!r}: mesh axes must be a name, a tuple or None.")
        out.append((rule[0], axes))
    return tuple(out)


def logical_to_mesh_axes(logical: Sequence[str | None], rules: Sequence[Rule]) -> list[MeshAxes]:
    """Pure flax-linen semantics: per dimension, the mesh axes (or None) of its first free rule."""
    names = [n for n in logical if n is not None]
    if len(set(names)) != len(names):
        raise RulesError(f"Logical axes {tuple(logical)} repeat a name; each must be unique.")
    result: list[Any] = ["?" if n is not None else None for n in logical]
    used: set[str] = set()
    for name, mesh_axes in rules:
        if name not in names:
            continue
        pos = list(logical).index(name)
        wanted = set(as_tuple(mesh_axes))
        if result[pos] == "?" and not (wanted & used):
            result[pos] = mesh_axes
            used |= wanted
    return [None if r == "?" else r for r in result]


@dataclass(frozen=True)
class AxisRules:
    """Rules plus the policies that apply them: strictness and indivisible dimensions."""

    rules: tuple[Rule, ...]
    strict: bool = False
    indivisible: str = "error"  # or "replicate"

    @classmethod
    def from_config(cls, config: Any) -> "AxisRules":
        mode = config.get("rules_indivisible", "error")
        if mode not in ("error", "replicate"):
            raise RulesError(paragraph(
                f"config.rules_indivisible={mode!r} is not valid; use 'error' (default) or",
                "'replicate' (drop mesh axes that do not divide a dimension, with a warning).",
            ))
        rules = config.rules
        preset = config.get("rules_preset", "")
        if preset:
            if preset not in PRESETS:
                raise RulesError(paragraph(
                    f"Unknown config.rules_preset={preset!r}. Valid presets: {', '.join(PRESETS)}",
                    "(see jaxscale/rules.py), or leave it empty to use config.rules.",
                ))
            rules = PRESETS[preset]
        return cls(normalize_rules(rules), bool(config.get("rules_strict", False)), mode)

    def spec(self, logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
             path: str = "<array>", warn: bool = True) -> PartitionSpec:
        """Resolves one array's logical axes to a PartitionSpec valid on `mesh`, or raises."""
        if len(logical) != len(shape):
            raise RulesError(paragraph(
                f"{path}: logical axes {tuple(logical)} have {len(logical)} names but the array",
                f"has shape {tuple(shape)}. Give exactly one logical name (or None) per dimension.",
            ))
        self._check_covered(logical, shape, path)
        resolved = logical_to_mesh_axes(logical, self.rules)
        dims = [self._fit(path, shape, logical, i, axes, mesh, warn)
                for i, axes in enumerate(resolved)]
        return PartitionSpec(*dims)

    def _check_covered(self, logical: Sequence[str | None], shape: Sequence[int], path: str):
        if not self.strict:
            return
        known = {name for name, _ in self.rules}
        missing = [n for n in logical if n is not None and n not in known]
        if missing:
            raise RulesError(paragraph(
                f"{path} (shape {tuple(shape)}, logical axes {tuple(logical)}): no rule covers",
                f"the logical name(s) {missing} and config.rules_strict=True.",
                f"Add a rule such as ('{missing[0]}', None) to replicate it, or a mesh axis to",
                "shard it, or set rules_strict=False to replicate unmatched names silently.",
            ))

    def _fit(self, path: str, shape: Sequence[int], logical: Sequence[str | None], dim: int,
             mesh_axes: MeshAxes, mesh: Mesh, warn: bool) -> MeshAxes:
        axes = as_tuple(mesh_axes)
        unknown = [a for a in axes if a not in mesh.shape]
        if unknown:
            raise RulesError(paragraph(
                f"{path} (shape {tuple(shape)}, logical axes {tuple(logical)}): the rule for",
                f"'{logical[dim]}' names mesh axis {unknown[0]!r}, which the mesh does not have",
                f"(mesh axes: {tuple(mesh.shape)}). Fix the rule to use one of those names.",
            ))
        size = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % size == 0:
            return mesh_axes if axes else None
        kept = tuple(a for a in axes if shape[dim] % mesh.shape[a] == 0 and mesh.shape[a] > 1)
        while kept and shape[dim] % math.prod(mesh.shape[a] for a in kept):
            kept = kept[:-1]
        if self.indivisible == "error":
            raise RulesError(paragraph(
                f"{path}: dimension {dim} ('{logical[dim]}') of shape {tuple(shape)} has size",
                f"{shape[dim]}, which is not divisible by {size}, the product of its mesh axes",
                f"{axes} ({', '.join(f'{a}={mesh.shape[a]}' for a in axes)}).",
                "Change the model dimension or the mesh, change the rule for",
                f"'{logical[dim]}', or set --config.rules_indivisible=replicate (those axes dropped",
                "for it, with a warning).",
            ))
        if warn:
            warnings.warn(paragraph(
                f"{path}: dimension {dim} ('{logical[dim]}', size {shape[dim]}) is not divisible",
                f"by mesh axes {axes}; sharding it over {kept or 'nothing'} instead",
                "(config.rules_indivisible='replicate').",
            ), stacklevel=2)
        return from_tuple(kept)

    def sharding(self, logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                 path: str = "<array>") -> NamedSharding:
        return NamedSharding(mesh, self.spec(logical, shape, mesh, path))

    def activation_spec(self, logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                        path: str = "<activation>") -> PartitionSpec:
        """`spec` as activations (and batches, and the specs of a shard_map's operands) are
        sharded: names without a rule replicated and mesh axes that do not divide a dimension
        dropped, silently, whatever `strict` and `indivisible` say. Why: an activation is
        transient and its shape is not the config's to fix (a smaller eval batch, a pipeline
        micro-batch, a kernel's blocks must not fail); only parameters are held to the rules'
        policies."""
        lenient = AxisRules(self.rules, strict=False, indivisible="replicate")
        return lenient.spec(logical, shape, mesh, path, warn=False)

    def without(self, axis: str) -> "AxisRules":
        """These rules with mesh `axis` taken out of every rule (e.g. inside a vmapped replica,
        where `data` is the mapped dimension and shards nothing)."""
        return replace(self, rules=tuple(
            (name, from_tuple(a for a in as_tuple(axes) if a != axis)) for name, axes in self.rules))

    def extended(self, name: str, axis: str) -> "AxisRules":
        """These rules with mesh `axis` appended to every rule for the logical `name` that does
        not name it yet (e.g. `batch` also split over `pipeline` after the stages)."""
        grow = lambda axes: from_tuple(as_tuple(axes) + (axis,))
        return replace(self, rules=tuple(
            (n, grow(axes) if n == name and axis not in as_tuple(axes) else axes)
            for n, axes in self.rules))


# ----------------------------------------------------------------------------- activations
_ACTIVE: contextvars.ContextVar[tuple[AxisRules, Mesh] | None] = contextvars.ContextVar(
    "jaxscale_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: AxisRules, mesh: Mesh) -> Iterator[None]:
    """Activates rules + mesh for `constrain` while a function is traced."""
    token = _ACTIVE.set((rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> tuple[AxisRules, Mesh] | None:
    return _ACTIVE.get()


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """Sharding constraint on an activation by logical names; identity when no rules are active.

    Mesh axes that do not divide a dimension are dropped (activations are transient: a smaller
    eval batch must not fail), so only parameters are held to `rules_indivisible`.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    rules, mesh = active
    spec = rules.activation_spec(logical, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def shard_counts(shape: Sequence[int], *logical: str | None) -> tuple[int, ...]:
    """How many shards `constrain(x, *logical)` splits each dimension of an activation of
    `shape` into under the active rules (all 1 when none are active)."""
    active = _ACTIVE.get()
    if active is None:
        return (1,) * len(shape)
    rules, mesh = active
    spec = rules.activation_spec(logical, shape, mesh)
    return tuple(math.prod(mesh.shape[a] for a in as_tuple(axes)) for axes in spec)
