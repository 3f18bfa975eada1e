"""The GPipe and circular pipeline schedules over the `pipeline` mesh axis, in one SPMD program.

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

The layout helpers are stages.py's, shared with 1F1B (onef1b.py), which also runs this
module's forward (`pipeline_layers`) for undifferentiated calls. `PipelineRunner` is
the runner the schedule table (schedules.py) builds for `gpipe` and `circular`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxscale.models.nn.scan import scan_layers
from jaxscale.models.runner import HeadLoss
from jaxscale.parallel.stages import (
    batch_over_stages,
    check_batch,
    check_layers,
    constrain_batch,
    iterations,
    stage_layer_data,
    stage_layout,
)


def _add_sown(acc_SR: nnx.State, sown_S: nnx.State, work_S: jax.Array, M: int, R: int
              ) -> nnx.State:
    """`acc_SR` (S, R, P, ...) plus what each stage sowed (S, P, ...) at its repeat, where the
    stage's work item is real (a bubble's garbage never leaks in, not even as 0 * inf)."""
    ok_S = (work_S >= 0) & (work_S < M * R)
    at_SR = jax.nn.one_hot(jnp.where(ok_S, work_S // M, -1), R, dtype=bool)  # -1: no repeat

    def add(acc, new):
        at = at_SR.reshape(at_SR.shape + (1,) * (new.ndim - 1))
        return acc + jnp.where(at, new[:, None], jnp.zeros_like(acc))

    return jax.tree.map(add, acc_SR, sown_S)


def pipeline_layers(block: nnx.Module, h_BTE: jax.Array, positions_BT: jax.Array, *,
                    mesh: Mesh, stages: int, microbatches: int, repeats: int,
                    remat: str = "none", segments_BT: jax.Array | None = None) -> jax.Array:
    """Runs the stacked `block` over `h_BTE` as an S-stage, M-microbatch, R-repeat pipeline.
    Packed rows: `segments_BT` (document ids) travel with their microbatch, as positions do.
    What the layers sow (`nnx.Intermediate`: the MoE router's statistics) is left on `block`
    stacked (L, ...) as `scan_layers` leaves it, each layer's the mean over the microbatches."""
    S, M, R = stages, microbatches, repeats
    nnx.pop(block, nnx.Intermediate)  # a previous call's sown values are not layer inputs
    graphdef, state = nnx.split(block)
    num_layers = jax.tree.leaves(state)[0].shape[0]
    check_layers(num_layers, S, R)
    check_batch(h_BTE.shape[0], M)
    B, T, E = h_BTE.shape
    mb = B // M
    if positions_BT is None:  # a model without positions (ViT): a stand-in its blocks ignore
        positions_BT = jnp.zeros((B, T), jnp.int32)
    # Microbatch m takes rows m, m+M, m+2M, ...: every device keeps its own rows (no shuffle).
    x_MbTE = constrain_batch(h_BTE.reshape(mb, M, T, E).swapaxes(0, 1), mesh, None)
    pos_MbT = constrain_batch(positions_BT.reshape(mb, M, T).swapaxes(0, 1), mesh, None)
    seg_MbT = None if segments_BT is None else constrain_batch(
        segments_BT.reshape(mb, M, T).swapaxes(0, 1), mesh, None)
    # The per-layer data (Gemma's local/global flag) split over the stages like the weights.
    weights = (stage_layout(state, mesh, R, S), stage_layer_data(block, R, S))
    stage_ids = jnp.arange(S)

    def stage_fn(stage, x_bTE, pos_bT, seg_bT=None):
        stage_state, per_layer = stage
        module = nnx.merge(graphdef, stage_state)
        out = scan_layers(module, x_bTE, pos_bT, remat, segments_BT=seg_bT, per_layer=per_layer)
        return out, nnx.pop(module, nnx.Intermediate)  # what the layers sowed (MoE router stats)

    run_stages = jax.vmap(stage_fn, spmd_axis_name="pipeline")
    pick_repeat = jax.vmap(lambda w, r: jax.tree.map(lambda a: a[r], w), in_axes=(1, 0),
                           spmd_axis_name="pipeline")

    def iteration(carry, t):
        state_SbTE, io_SMbTE, sown_SR = carry
        first = (stage_ids == 0)[:, None, None, None]
        fresh_SbTE = jax.lax.dynamic_index_in_dim(io_SMbTE, t % M, axis=1, keepdims=False)
        in_SbTE = constrain_batch(jnp.where(first, fresh_SbTE, state_SbTE), mesh, "pipeline")
        work_S = t - stage_ids                    # work item k = r*M + m on each stage
        pos_SbT = constrain_batch(pos_MbT[work_S % M], mesh, "pipeline")
        rows = () if seg_MbT is None else (constrain_batch(seg_MbT[work_S % M], mesh, "pipeline"),)
        if R == 1:
            w_S = jax.tree.map(lambda a: a[0], weights)
        else:
            w_S = pick_repeat(weights, jnp.clip(work_S // M, 0, R - 1))
        out_SbTE, sown_S = run_stages(w_S, in_SbTE, pos_SbT, *rows)
        out_SbTE = constrain_batch(out_SbTE, mesh, "pipeline")
        sown_SR = _add_sown(sown_SR, sown_S, work_S, M, R)
        next_SbTE = constrain_batch(jnp.roll(out_SbTE, 1, axis=0), mesh, "pipeline")
        # Slot 0 of `next` is the last stage's output for microbatch (t-S+1) mod M.
        done = first & (t >= S - 1)
        slot = (t - (S - 1)) % M
        old_SbTE = jax.lax.dynamic_index_in_dim(io_SMbTE, slot, axis=1, keepdims=False)
        io_SMbTE = jax.lax.dynamic_update_index_in_dim(
            io_SMbTE, jnp.where(done, next_SbTE, old_SbTE), slot, axis=1)
        return (next_SbTE, constrain_batch(io_SMbTE, mesh, "pipeline", None), sown_SR), None

    io_SMbTE = constrain_batch(jnp.broadcast_to(x_MbTE, (S,) + x_MbTE.shape), mesh,
                               "pipeline", None)
    state_SbTE = constrain_batch(jnp.zeros((S, mb, T, E), h_BTE.dtype), mesh, "pipeline")
    first_rows = () if seg_MbT is None else (seg_MbT[0],)
    sown_P = jax.eval_shape(stage_fn, jax.tree.map(lambda a: a[0, 0], weights), x_MbTE[0],
                            pos_MbT[0], *first_rows)[1]  # what one stage sows (P, ...)
    sown_SR = jax.tree.map(lambda a: jnp.zeros((S, R) + a.shape, a.dtype), sown_P)
    (_, io_SMbTE, sown_SR), _ = jax.lax.scan(iteration, (state_SbTE, io_SMbTE, sown_SR),
                                             jnp.arange(iterations(S, M, R)))
    # (S, R, P, ...) sums over microbatches -> (L, ...) means in natural layer order, on `block`
    # as the plain scan leaves them (e.g. the MoE router's statistics for `moe.router_loss`).
    nnx.update(block, jax.tree.map(
        lambda a: (a.swapaxes(0, 1) / M).reshape((-1,) + a.shape[3:]), sown_SR))
    out_MbTE = constrain_batch(io_SMbTE[0], mesh, None)
    with batch_over_stages(mesh):  # rows leave for the head split over stages, not broadcast
        return constrain_batch(out_MbTE.swapaxes(0, 1).reshape(B, T, E), mesh)


@dataclass(frozen=True, eq=False)
class PipelineRunner:
    """GPipe (repeats = 1) or circular (repeats > 1) layers over the `pipeline` axis."""

    mesh: Mesh
    stages: int
    microbatches: int
    repeats: int = 1
    remat: str = "none"
    fuses_loss: bool = False

    def __call__(self, block: nnx.Module, h_BTE: jax.Array, positions_BT: jax.Array | None,
                 segments_BT: jax.Array | None = None) -> jax.Array:
        return pipeline_layers(block, h_BTE, positions_BT, mesh=self.mesh, stages=self.stages,
                               microbatches=self.microbatches, repeats=self.repeats,
                               remat=self.remat, segments_BT=segments_BT)

    def head_scope(self) -> contextlib.AbstractContextManager:
        """The model's head runs split over stages by batch rows (`stages.batch_over_stages`)."""
        return batch_over_stages(self.mesh)

    def scaled(self, loss_scale: jax.Array) -> "PipelineRunner":
        return self  # the loss scale reaches these layers through ordinary autodiff

    def fused_loss(self, model: Any, tokens_BT: jax.Array, targets_BT: jax.Array,
                   head_loss: HeadLoss, positions_BT: jax.Array | None = None,
                   segments_BT: jax.Array | None = None) -> jax.Array:
        raise NotImplementedError("GPipe / circular runners do not fuse the loss "
                                  "(fuses_loss is False): call the runner instead.")
