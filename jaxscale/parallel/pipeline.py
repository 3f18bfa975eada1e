"""Pipeline parallelism over the `pipeline` mesh axis, in one SPMD program (MaxText-style).

The stacked layer state (L, ...) is viewed as (repeats R, stages S, per-stage P, ...): natural
layer l = r*S*P + s*P + p runs on stage s in repeat r, so the result equals the plain scan over
layers 0..L-1. Every iteration all stages run at once: `jax.vmap` over the stage dimension with
`spmd_axis_name='pipeline'` (the stage dimension of weights, activations and of every sharding
constraint inside the block lands on the `pipeline` axis), then the per-stage activations move
one stage forward with `jnp.roll` (a collective-permute). Stage 0 reads microbatch `t mod M` from
an I/O buffer that also receives the last stage's outputs, so a microbatch leaving stage S-1 in
repeat r re-enters stage 0 for repeat r+1 (the circular / interleaved schedule) and the buffer
holds the final outputs at the end. Total iterations: M*R + S - 1.

GPipe is R=1 (each device holds one contiguous block of layers). With R>1 each device holds R
non-contiguous groups; since parameters are stored in natural layer order (sharded contiguously
by the rule ('layers', 'pipeline')), the step re-lays the layer dimension out as (R, S, P) with
one all-to-all of the block weights per step (and back for the gradients): the price of keeping
checkpoints and the 1-device model identical whatever the schedule.

The 1F1B schedule (`schedule='1f1b'`, onef1b.py) reuses this module's layout and stage vmap but
runs each stage's backward inside the schedule, so it fuses the head and loss and is returned
by `make_layer_runner` as a runner with `fused_loss` (see `train/step.py::lm_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.llama import REMAT_POLICIES, scan_layers
from jaxscale.rules import AxisRules, active_rules

RunLayers = Callable[[nnx.Module, jax.Array, jax.Array], jax.Array]


# ----------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: how many iterations it takes and which repeats it accepts."""

    name: str
    circular: bool
    note: str = ""  # why a non-circular schedule has no repeats, for the error message

    def iterations(self, stages: int, microbatches: int, repeats: int) -> int:
        return microbatches * repeats + stages - 1

    def bubble_fraction(self, stages: int, microbatches: int, repeats: int) -> float:
        """Idle fraction of each device: (S-1) of M*R+S-1 iterations (each 1/R of a stage)."""
        return (stages - 1) / self.iterations(stages, microbatches, repeats)

    def check(self, stages: int, microbatches: int, repeats: int) -> None:
        if repeats < 1 or microbatches < 1:
            raise ConfigError(paragraph(
                f"pipeline.microbatches={microbatches} and pipeline.repeats={repeats} must both",
                "be at least 1."))
        if repeats > 1 and not self.circular:
            raise ConfigError(paragraph(
                f"pipeline.schedule={self.name!r} runs each stage's layers once{self.note}, but",
                f"pipeline.repeats={repeats}. Use --config.pipeline.schedule=circular for",
                "several non-contiguous layer groups per stage, or set pipeline.repeats=1."))
        if repeats > 1 and microbatches < stages:
            raise ConfigError(paragraph(
                "The circular schedule needs pipeline.microbatches >= the number of stages",
                f"(mesh.pipeline={stages}), got microbatches={microbatches}: a microbatch must",
                "leave the last stage before it re-enters the first for its next repeat.",
                f"Set --config.pipeline.microbatches={stages} (or a larger value dividing the",
                "batch)."))


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule("gpipe", circular=False),
    "circular": Schedule("circular", circular=True),
    # Same bubble as GPipe, counted in forward+backward units: the steady phase runs one forward
    # and one backward per iteration (jaxscale/parallel/onef1b.py).
    "1f1b": Schedule("1f1b", circular=False, note=" (an interleaved 1F1B is not implemented)"),
}


def get_schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ConfigError(paragraph(
            f"Unknown pipeline.schedule={name!r}. Valid schedules: {', '.join(SCHEDULES)}",
            "('gpipe': one contiguous layer block per stage; 'circular': pipeline.repeats",
            "non-contiguous blocks per stage, a smaller bubble; '1f1b': GPipe's stages with",
            "each stage's backward interleaved, activations bounded by the stages)."))
    return SCHEDULES[name]


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


# ----------------------------------------------------------------------------- the runner
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
    rules = AxisRules(active[0].rules, indivisible="replicate")
    spec = rules.spec(tuple(logical), shape, mesh, "<pipeline weights>", warn=False)
    return [None if ax == "pipeline" or (isinstance(ax, tuple) and "pipeline" in ax) else ax
            for ax in tuple(spec)]


def _layout(state: nnx.State, mesh: Mesh, repeats: int, stages: int) -> nnx.State:
    """(L, ...) leaves -> (R, S, P, ...) with S on `pipeline` and the rest as the rules say."""

    def one(var: nnx.Variable) -> nnx.Variable:
        value = var[...]
        shape = value.shape
        inner = rules_axes(var, mesh)[1:]
        value = value.reshape(repeats, stages, shape[0] // (repeats * stages), *shape[1:])
        sharding = NamedSharding(mesh, PartitionSpec(None, "pipeline", None, *inner))
        return var.replace(jax.lax.with_sharding_constraint(value, sharding))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _batch_spec(mesh: Mesh, shape: tuple[int, ...], lead: tuple) -> PartitionSpec:
    """Spec for (lead..., batch, rest...) activations: batch on the rules' batch axes."""
    active = active_rules()
    if active is None:
        return PartitionSpec(*lead)
    lenient = AxisRules(active[0].rules, indivisible="replicate")
    rest = shape[len(lead):]
    spec = lenient.spec(("batch",) + (None,) * (len(rest) - 1), rest, mesh, warn=False)
    return PartitionSpec(*lead, *spec)


def _constrain(x: jax.Array, mesh: Mesh, *lead) -> jax.Array:
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, _batch_spec(mesh, x.shape, tuple(lead))))


def pipeline_layers(block: nnx.Module, h_BTE: jax.Array, positions_BT: jax.Array, *,
                    mesh: Mesh, stages: int, microbatches: int, repeats: int,
                    remat: str = "none") -> jax.Array:
    """Runs the stacked `block` over `h_BTE` as an S-stage, M-microbatch, R-repeat pipeline."""
    S, M, R = stages, microbatches, repeats
    graphdef, state = nnx.split(block)
    num_layers = jax.tree.leaves(state)[0].shape[0]
    check_layers(num_layers, S, R)
    check_batch(h_BTE.shape[0], M)
    B, T, E = h_BTE.shape
    mb = B // M
    if positions_BT is None:  # a model without positions (ViT): a stand-in its blocks ignore
        positions_BT = jnp.zeros((B, T), jnp.int32)
    # Microbatch m takes rows m, m+M, m+2M, ...: every device keeps its own rows (no shuffle).
    x_MbTE = _constrain(h_BTE.reshape(mb, M, T, E).swapaxes(0, 1), mesh, None)
    pos_MbT = _constrain(positions_BT.reshape(mb, M, T).swapaxes(0, 1), mesh, None)
    weights = _layout(state, mesh, R, S)
    stage_ids = jnp.arange(S)

    def stage_fn(stage_state, x_bTE, pos_bT):
        return scan_layers(nnx.merge(graphdef, stage_state), x_bTE, pos_bT, remat)

    run_stages = jax.vmap(stage_fn, spmd_axis_name="pipeline")
    pick_repeat = jax.vmap(lambda w, r: jax.tree.map(lambda a: a[r], w), in_axes=(1, 0),
                           spmd_axis_name="pipeline")

    def iteration(carry, t):
        state_SbTE, io_SMbTE = carry
        first = (stage_ids == 0)[:, None, None, None]
        fresh_SbTE = jax.lax.dynamic_index_in_dim(io_SMbTE, t % M, axis=1, keepdims=False)
        in_SbTE = _constrain(jnp.where(first, fresh_SbTE, state_SbTE), mesh, "pipeline")
        work_S = t - stage_ids                    # work item k = r*M + m on each stage
        pos_SbT = _constrain(pos_MbT[work_S % M], mesh, "pipeline")
        if R == 1:
            w_S = jax.tree.map(lambda a: a[0], weights)
        else:
            w_S = pick_repeat(weights, jnp.clip(work_S // M, 0, R - 1))
        out_SbTE = _constrain(run_stages(w_S, in_SbTE, pos_SbT), mesh, "pipeline")
        next_SbTE = _constrain(jnp.roll(out_SbTE, 1, axis=0), mesh, "pipeline")
        # Slot 0 of `next` is the last stage's output for microbatch (t-S+1) mod M.
        done = first & (t >= S - 1)
        slot = (t - (S - 1)) % M
        old_SbTE = jax.lax.dynamic_index_in_dim(io_SMbTE, slot, axis=1, keepdims=False)
        io_SMbTE = jax.lax.dynamic_update_index_in_dim(
            io_SMbTE, jnp.where(done, next_SbTE, old_SbTE), slot, axis=1)
        return (next_SbTE, _constrain(io_SMbTE, mesh, "pipeline", None)), None

    io_SMbTE = _constrain(jnp.broadcast_to(x_MbTE, (S,) + x_MbTE.shape), mesh, "pipeline", None)
    state_SbTE = _constrain(jnp.zeros((S, mb, T, E), h_BTE.dtype), mesh, "pipeline")
    iterations = get_schedule("circular").iterations(S, M, R)
    (_, io_SMbTE), _ = jax.lax.scan(iteration, (state_SbTE, io_SMbTE), jnp.arange(iterations))
    out_MbTE = _constrain(io_SMbTE[0], mesh, None)
    return _constrain(out_MbTE.swapaxes(0, 1).reshape(B, T, E), mesh)


def make_layer_runner(pipeline_cfg: Mapping[str, Any], mesh: Mesh, remat: str = "none",
                      num_layers: int | None = None) -> RunLayers | None:
    """`run_layers(block, h_BTE, positions_BT)` for `Llama`, or None when mesh.pipeline == 1.

    Validates the schedule, repeats and (when given) the layer count up front so a bad config
    fails before anything compiles; the batch is checked when the step is traced.
    """
    stages = int(mesh.shape.get("pipeline", 1))
    schedule = get_schedule(pipeline_cfg.get("schedule", "gpipe"))
    microbatches = int(pipeline_cfg.get("microbatches", 1))
    repeats = int(pipeline_cfg.get("repeats", 1))
    if remat not in REMAT_POLICIES:
        raise ConfigError(f"Unknown remat policy {remat!r}; use one of {list(REMAT_POLICIES)}.")
    if stages == 1:
        return None
    schedule.check(stages, microbatches, repeats)
    if num_layers is not None:
        check_layers(num_layers, stages, repeats)
    if schedule.name == "1f1b":  # the loss runs inside the schedule: see onef1b.py
        from jaxscale.parallel.onef1b import OneFOneB  # onef1b imports this module
        return OneFOneB(mesh, stages, microbatches, remat)

    def run_layers(block: nnx.Module, h_BTE: jax.Array, positions_BT: jax.Array) -> jax.Array:
        return pipeline_layers(block, h_BTE, positions_BT, mesh=mesh, stages=stages,
                               microbatches=microbatches, repeats=repeats, remat=remat)

    run_layers.microbatches = microbatches  # lets gradient accumulation keep rows divisible
    return run_layers
