"""The 1F1B schedule's iterations, on every stage at once (the runner is onef1b.py).

Stage s runs the forward of microbatch m at iteration t = m + s and its backward at
t = m + 2S-2-s (`stage_step`, vmapped over the stages with `spmd_axis_name='pipeline'`); the
last stage's output goes through the head and loss split by positions over all stages
(`head_step`). A stage stashes only its input for the microbatches in flight, in a ring of
K = 2S-1 slots, and its backward recomputes the stage forward from it under `jax.vjp`. `run`
scans the three phases (warmup: forwards; steady: forward + head + backward; cooldown:
backwards), and `gradients` lays the microbatches and the weights out for it and returns the
loss, the layers', head's and input's gradients and what the layers sowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.errors import ConfigError, paragraph
from jaxscale.parallel.stages import constrain_batch

Leaves = list[Any]  # flat parameter leaves; None where a leaf gets no gradient
Rows = tuple[jax.Array, ...]  # per-row inputs of the layers: (positions[, segment ids])


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the schedule needs that is fixed at trace time."""

    mesh: Mesh
    stages: int
    microbatches: int
    # (w (P, ...), x, pos[, segments]) -> (y, what the stage's layers sow (P, ...): MoE stats)
    stage_fn: Callable[..., tuple[jax.Array, Leaves]]
    head_loss: Callable[[Leaves, jax.Array, jax.Array], jax.Array]  # (head, y, targets) -> loss
    layout: Callable[[Leaves], Leaves]  # (L, ...) layer leaves -> (S, P, ...) on `pipeline`
    layer_specs: tuple[PartitionSpec, ...]  # of the (S, P, ...) weight-gradient accumulators
    head_specs: tuple[PartitionSpec, ...]  # of the (S, ...) per-stage head-gradient accumulators
    layer_diff: tuple[bool, ...] = ()  # which leaves get gradients (set by the forward rule)
    head_diff: tuple[bool, ...] = ()
    want_dx: bool = True

    @property
    def slots(self) -> int:
        return 2 * self.stages - 1


class _Carry(NamedTuple):
    """The scans' state; every array has a leading stage dimension on `pipeline`."""

    fwd: jax.Array  # (S, b, T, E) activation arriving at each stage
    bwd: jax.Array  # (S, b, T, E) cotangent arriving at each stage
    stash: jax.Array  # (S, K, b, T, E) inputs of the microbatches in flight
    dx: jax.Array | None  # (S, M, b, T, E) input gradients, written by stage 0 only
    gw: Leaves  # (S, P, ...) weight-gradient sums
    gh: Leaves  # (S, ...) head-gradient sums, each stage's over its share of the positions
    loss: jax.Array  # (S,) sums of the stages' shares of the microbatch losses
    sown: Leaves  # (S, P, ...) sums over the microbatches of what the layers sowed


def _pick(leaves: Leaves, mask: tuple[bool, ...]) -> Leaves:
    return [x if m else None for x, m in zip(leaves, mask)]


def _join(diff: Leaves, full: Leaves, mask: tuple[bool, ...]) -> Leaves:
    return [d if m else f for d, f, m in zip(diff, full, mask)]


def _accumulate(acc: Leaves, new: Leaves, ok: jax.Array) -> Leaves:
    """acc + new where this stage's work item is real; `where` so a bubble's garbage never
    leaks in (not even as 0 * inf)."""
    return [a if a is None else a + jnp.where(ok, g, jnp.zeros_like(g)).astype(a.dtype)
            for a, g in zip(acc, new)]


def _write(buf: jax.Array, i: jax.Array, value: jax.Array, ok: jax.Array) -> jax.Array:
    old = jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(ok, value, old), i, 0)


def stage_step(plan: Plan, do_fwd: bool) -> Callable:
    """One iteration's forward (`do_fwd`) or backward on one stage (vmapped over stages by the
    caller)."""
    S, M, K = plan.stages, plan.microbatches, plan.slots

    def step(c: _Carry, w: Leaves, ct_sown: Leaves, s: jax.Array, t: jax.Array, x_M: jax.Array,
             rows_M: Rows) -> _Carry:
        m_f, m_b = t - s, t - (2 * S - 2) + s  # microbatches of this stage's forward, backward
        ok_f, ok_b = (m_f >= 0) & (m_f < M), (m_b >= 0) & (m_b < M)
        if do_fwd:
            x = jnp.where(s == 0, x_M[m_f % M], c.fwd)
            y, sown = plan.stage_fn(w, x, *[a[m_f % M] for a in rows_M])
            return c._replace(fwd=y, stash=_write(c.stash, m_f % K, x, ok_f),
                              sown=_accumulate(c.sown, sown, ok_f))
        x_b = jax.lax.dynamic_index_in_dim(c.stash, m_b % K, 0, keepdims=False)
        f = lambda d, x: plan.stage_fn(_join(d, w, plan.layer_diff), x,
                                       *[a[m_b % M] for a in rows_M])
        _, pull = jax.vjp(f, _pick(w, plan.layer_diff), x_b)
        # The sown values' cotangent: the router losses' gradient flows through the router
        # into this stage's weights and, by dx, into the stages before it.
        d_w, dx = pull((c.bwd, ct_sown))
        buf = c.dx if c.dx is None else _write(c.dx, m_b % M, dx, (s == 0) & ok_b)
        return c._replace(bwd=dx, dx=buf, gw=_accumulate(c.gw, d_w, ok_b))

    return step


def head_step(plan: Plan, c: _Carry, t: jax.Array, head: Leaves, seed_mb: jax.Array,
               tgt_M: jax.Array) -> _Carry:
    """Head + loss and their vjp for the microbatch the last stage just finished, computed once.

    Why not inside the vmapped stage step: the stages run in lockstep, so a head there would
    be computed by every stage (S times the biggest matmul of the step) and discarded on all
    but the last. Here the last stage's output is split by positions over the stages (position
    p to stage p mod S, as `models/decoder/lm_task.head_losses` chunks them): each stage computes the
    head, loss and gradients of 1/S of the positions against its own head-gradient sum (one
    reduce over `pipeline` at the end, as before), and the cotangent goes back to the last
    stage. The loss is a mean over positions, so the mean of the S equal parts' losses is the
    microbatch's loss."""
    S, mesh = plan.stages, plan.mesh
    y_bTE = c.fwd[S - 1]
    b, T = y_bTE.shape[:2]
    if T % S:
        raise ConfigError(paragraph(
            f"pipeline.schedule='1f1b' splits the LM head's {T} positions over the {S}",
            "pipeline stages (so that the head is computed once, not once per stage), which",
            "needs a sequence length divisible by mesh.pipeline. Use a data.seq_len that",
            f"is a multiple of {S}, or --config.pipeline.schedule=gpipe."))
    split = lambda x: constrain_batch(
        jnp.moveaxis(x.reshape(b, T // S, S, *x.shape[2:]), 2, 0), mesh, "pipeline")
    tgt_bT = jax.lax.dynamic_index_in_dim(tgt_M, t - (S - 1), 0, keepdims=False)
    on_stages = lambda h, spec: h if h is None else jax.lax.with_sharding_constraint(
        jnp.broadcast_to(h, (S,) + h.shape), NamedSharding(mesh, spec))
    head_S = [on_stages(h, spec) for h, spec in zip(_pick(head, plan.head_diff), plan.head_specs)]
    part = lambda d, y, tgt: plan.head_loss(_join(d, head, plan.head_diff), y, tgt)
    loss_S, pull = jax.vjp(
        lambda d, y: jax.vmap(part, spmd_axis_name="pipeline")(d, y, split(tgt_bT)),
        head_S, split(y_bTE))
    d_head, d_y = pull(jnp.full((S,), seed_mb / S, loss_S.dtype))
    d_y = jnp.moveaxis(d_y, 0, 2).reshape(y_bTE.shape)
    gh = [a if a is None else a + g.astype(a.dtype) for a, g in zip(c.gh, d_head)]
    return c._replace(bwd=c.bwd.at[S - 1].set(d_y.astype(c.bwd.dtype)), gh=gh,
                      loss=c.loss + (loss_S / S).astype(c.loss.dtype))


def constrain_carry(plan: Plan, c: _Carry) -> _Carry:
    mesh = plan.mesh
    on = lambda specs, leaves: [x if x is None else jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, spec)) for x, spec in zip(leaves, specs)]
    return _Carry(constrain_batch(c.fwd, mesh, "pipeline"),
                  constrain_batch(c.bwd, mesh, "pipeline"),
                  constrain_batch(c.stash, mesh, "pipeline", None),
                  c.dx if c.dx is None else constrain_batch(c.dx, mesh, "pipeline", None),
                  on(plan.layer_specs, c.gw), on(plan.head_specs, c.gh),
                  jax.lax.with_sharding_constraint(
                      c.loss, NamedSharding(mesh, PartitionSpec("pipeline"))),
                  [jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(
                      "pipeline"))) for x in c.sown])


def init_carry(plan: Plan, w_SP: Leaves, head: Leaves, x_MbTE: jax.Array, rows_M: Rows
                ) -> _Carry:
    S, (M, b, T, E) = plan.stages, x_MbTE.shape
    zeros = lambda *shape: jnp.zeros(shape + (b, T, E), x_MbTE.dtype)
    sown_P = jax.eval_shape(plan.stage_fn, [a[0] for a in w_SP], x_MbTE[0],
                            *[a[0] for a in rows_M])[1]  # what one stage sows (P, ...)
    return constrain_carry(plan, _Carry(
        zeros(S), zeros(S), zeros(S, plan.slots), zeros(S, M) if plan.want_dx else None,
        [jnp.zeros_like(w) if d else None for w, d in zip(w_SP, plan.layer_diff)],
        [jnp.zeros((S,) + h.shape, h.dtype) if d else None for h, d in zip(head, plan.head_diff)],
        jnp.zeros((S,), jnp.float32), [jnp.zeros((S,) + a.shape, a.dtype) for a in sown_P]))


def run(plan: Plan, w_SP: Leaves, head: Leaves, x_MbTE: jax.Array, rows_M: Rows,
         tgt_MbT: jax.Array, seed: jax.Array, ct_SP: Leaves) -> _Carry:
    """The three scans: warmup (forward only), steady (1F1B + head), cooldown (backward only);
    `ct_SP`: each stage's cotangent of what its layers sow, per microbatch."""
    S, M = plan.stages, plan.microbatches
    stage_ids = jnp.arange(S)
    phases = ((True, False, False, 0, S - 1), (True, True, True, S - 1, M + S - 1),
              (False, False, True, M + S - 1, M + 2 * S - 2))
    c = init_carry(plan, w_SP, head, x_MbTE, rows_M)
    staged = lambda fwd: jax.vmap(stage_step(plan, fwd), spmd_axis_name="pipeline",
                                  in_axes=(0, 0, 0, 0, None, None, None))
    forward, backward = staged(True), staged(False)
    for do_fwd, do_head, do_bwd, start, stop in phases:

        def body(c: _Carry, t: jax.Array, do_fwd=do_fwd, do_head=do_head, do_bwd=do_bwd):
            if do_fwd:
                c = forward(c, w_SP, ct_SP, stage_ids, t, x_MbTE, rows_M)
            if do_head:
                c = head_step(plan, c, t, head, seed / M, tgt_MbT)
            if do_bwd:
                c = backward(c, w_SP, ct_SP, stage_ids, t, x_MbTE, rows_M)
            fwd = jnp.roll(c.fwd, 1, axis=0) if do_fwd else c.fwd  # to the next stage
            bwd = jnp.roll(c.bwd, -1, axis=0) if do_bwd else c.bwd  # to the previous stage
            return constrain_carry(plan, c._replace(fwd=fwd, bwd=bwd)), None

        c, _ = jax.lax.scan(body, c, jnp.arange(start, stop))
    return c


def gradients(plan: Plan, layers: Leaves, head: Leaves, h_BTE: jax.Array,
               rows: Rows, tgt_BT: jax.Array, seed: jax.Array, ct_sown: Leaves
               ) -> tuple[jax.Array, Leaves, Leaves, jax.Array | None, Leaves]:
    """(loss, layer grads, head grads, input grad, sown (L, ...) means over microbatches), the
    gradients scaled by `seed`; None: no gradient. `ct_sown`: the sown values' cotangent per
    microbatch, (L, ...)."""
    M, mesh, S = plan.microbatches, plan.mesh, plan.stages
    B, T, E = h_BTE.shape
    b = B // M
    # Microbatch m takes rows m, m+M, ... (as in gpipe.py): every device keeps its rows.
    split = lambda x: constrain_batch(x.reshape(b, M, *x.shape[1:]).swapaxes(0, 1), mesh, None)
    c = run(plan, plan.layout(layers), head, split(h_BTE), tuple(split(a) for a in rows),
             split(tgt_BT), seed, [a.reshape(S, -1, *a.shape[1:]) for a in ct_sown])
    to_layers = lambda g: g if g is None else g.reshape((-1,) + g.shape[2:])  # (S, P) -> L
    gw = [to_layers(g) for g in c.gw]
    gh = [g if g is None else jnp.sum(g, axis=0) for g in c.gh]  # one reduce over `pipeline`
    dx = None if c.dx is None else constrain_batch(c.dx[0].swapaxes(0, 1).reshape(B, T, E), mesh)
    return jnp.sum(c.loss) / M, gw, gh, dx, [to_layers(a) / M for a in c.sown]
