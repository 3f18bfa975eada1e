"""The layout every pipeline schedule shares: stages over the `pipeline` mesh axis.

A stacked layer state (L, ...) is viewed as (repeats R, stages S, per-stage P, ...): natural
layer l = r*S*P + s*P + p runs on stage s in repeat r (`stage_layout`, `stage_layer_data`), so a
pipeline equals the plain scan over layers 0..L-1. Activations keep their batch rows sharded as
the rules shard `batch` (`constrain_batch`), and what runs after the stages may split its rows
over them (`batch_over_stages`). In lockstep, every iteration runs all stages at once, so a
pipeline of M microbatches and R repeats takes M*R + S - 1 iterations (`iterations`: the bubble
is the S - 1). `check_layers` / `check_batch` reject layer counts and batches that do not split
evenly. GPipe and circular (gpipe.py) and 1F1B (onef1b.py) all build on these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.nn.scan import layer_data
from jaxscale.rules import active_rules, use_rules


def iterations(stages: int, microbatches: int, repeats: int) -> int:
    """Lockstep iterations of a pipeline: M*R work items enter stage 0 one per iteration, and
    the last leaves stage S-1 S-1 iterations later."""
    return microbatches * repeats + stages - 1


def rules_axes(var: nnx.Variable, mesh: Mesh) -> list:
    """The mesh axes of each dimension of `var` under the active rules, `pipeline` dropped.

    Inside the schedule the stage dimension is the only one on `pipeline`, so a parameter's own
    spec (e.g. its `layers` dimension under the `pp` preset) must not claim that axis again.
    """
    shape = var[...].shape
    active = active_rules()
    logical = var.get_metadata().get("logical_axes")
    if active is None or logical is None:
        return [None] * len(shape)
    spec = active[0].activation_spec(tuple(logical), shape, mesh, "<pipeline weights>")
    return [None if ax == "pipeline" or (isinstance(ax, tuple) and "pipeline" in ax) else ax
            for ax in tuple(spec)]


def stage_layout(state: nnx.State, mesh: Mesh, repeats: int, stages: int) -> nnx.State:
    """(L, ...) leaves -> (R, S, P, ...) with S on `pipeline` and the rest as the rules say."""

    def one(var: nnx.Variable) -> nnx.Variable:
        value = var[...]
        shape = value.shape
        inner = rules_axes(var, mesh)[1:]
        value = value.reshape(repeats, stages, shape[0] // (repeats * stages), *shape[1:])
        sharding = NamedSharding(mesh, PartitionSpec(None, "pipeline", None, *inner))
        return var.replace(jax.lax.with_sharding_constraint(value, sharding))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def stage_layer_data(block: nnx.Module, repeats: int, stages: int) -> dict[str, jax.Array]:
    """The block's per-layer data (`scan.layer_data`: Gemma's local/global flag), (L,) ->
    (R, S, P) as `stage_layout` lays out the weights, so each stage scans its own layers'."""
    return {k: v.reshape(repeats, stages, -1, *v.shape[1:])
            for k, v in layer_data(block).items()}


def _batch_spec(mesh: Mesh, shape: tuple[int, ...], lead: tuple) -> PartitionSpec:
    """Spec for (lead..., batch, rest...) activations: batch on the rules' batch axes."""
    active = active_rules()
    if active is None:
        return PartitionSpec(*lead)
    rest = shape[len(lead):]
    spec = active[0].activation_spec(("batch",) + (None,) * (len(rest) - 1), rest, mesh)
    return PartitionSpec(*lead, *spec)


def constrain_batch(x: jax.Array, mesh: Mesh, *lead) -> jax.Array:
    """`x` (lead..., batch, ...) with its batch dimension sharded as the rules shard `batch`."""
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, _batch_spec(mesh, x.shape, tuple(lead))))


@contextlib.contextmanager
def batch_over_stages(mesh: Mesh) -> Iterator[None]:
    """Activation rules with `batch` also split over `pipeline`, for what runs after the stages.

    Why: the layers' output leaves the pipeline on the last stage's devices; computed under the
    ordinary rules (batch replicated over `pipeline`) the LM head, the biggest matmul of a step
    with its (B, T, V) logits, would run S times, once per stage on every row. Under these rules
    each stage computes the head and loss for 1/S of the rows (only its share of the logits
    exists), and the pipeline output is scattered to them instead of broadcast."""
    active = active_rules()
    if active is None or mesh.shape.get("pipeline", 1) == 1:
        yield
        return
    with use_rules(active[0].extended("batch", "pipeline"), mesh):
        yield


def check_layers(num_layers: int, stages: int, repeats: int) -> None:
    if num_layers % (stages * repeats):
        raise ConfigError(paragraph(
            f"model.num_layers={num_layers} is not divisible by mesh.pipeline={stages} x",
            f"pipeline.repeats={repeats} = {stages * repeats}: every stage must hold the same",
            "number of layers in every repeat. Change num_layers, the pipeline mesh size or",
            "the repeats."))


def check_batch(batch: int, microbatches: int) -> None:
    if batch % microbatches:
        raise ConfigError(paragraph(
            f"The pipeline received a batch of {batch} rows, which is not divisible by",
            f"pipeline.microbatches={microbatches} (rows = data.batch_size / train.grad_accum).",
            "Choose microbatches dividing the batch, e.g. a power of two for a power-of-two",
            "batch."))
