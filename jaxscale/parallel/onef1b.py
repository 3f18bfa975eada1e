"""The 1F1B pipeline schedule in one SPMD program: each stage interleaves forwards and backwards.

Why: under GPipe (gpipe.py) every stage runs all M microbatches forward and autodiff then
runs them all backward, so a stage holds the activations of all M microbatches at once: stored
activations grow with M. Under 1F1B a stage starts a microbatch's backward as soon as its
cotangent arrives, so at most 2S-1 microbatches are ever in flight on a stage, whatever M.

How, still in lockstep with every stage vmapped over `pipeline` (`spmd_axis_name`) as in
gpipe.py: stage s runs the forward of microbatch m at iteration t = m + s and its backward at
t = m + 2S-2-s. In one iteration the last stage runs the forward, then the head + loss and
their vjp (split by positions over all stages, so computed once: `_head_step`), then the backward
of the same microbatch; every other stage gets its cotangent one iteration after
the stage behind it produced it (`jnp.roll` by -1, the mirror of the forward's roll by +1). A
stage stashes only its *input* for microbatches in flight, in a ring of K = 2S-1 slots (slot
m mod K: stage 0 has 2S-2 microbatches between forward and backward, plus the one written this
iteration), and its backward recomputes the stage forward from that input under `jax.vjp`:
rematerialisation per stage, as GPipe with remat='full' per layer. The iterations run as three
scans -- warmup (forward only, t < S-1), steady (forward + backward), cooldown (backward only) --
so each device computes M+S-1 forwards and M+S-1 backwards, as GPipe does: the same bubble.

Because the loss, where the backward starts, is inside the schedule, 1F1B cannot replace
`run_layers`: `OneFOneB.fused_loss` (`fuses_loss` is True) is "layers + head + loss" as one
`jax.custom_vjp` function whose forward rule runs the schedule, returns the loss and keeps every
gradient (layers, head, input) as residuals; the backward rule scales them by the incoming
cotangent. The embedding,
LoRA's frozen/trainable split, gradient accumulation and loss scaling stay ordinary autodiff in
train/step.py. Undifferentiated calls (evaluation) run the GPipe forward. What the layers sow
(the MoE router's statistics) each stage's forward returns and sums, and its backward seeds
with the cotangent of the caller's loss term on them (`sown_loss`, the router's losses): they
leave the schedule as GPipe's do, their gradient already inside the loss's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero, custom_vjp_primal_tree_values
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.runner import LossFn
from jaxscale.models.scan import layer_data, scan_layers
from jaxscale.parallel.gpipe import constrain_batch, pipeline_layers, rules_axes, stage_layout
from jaxscale.parallel.schedules import check_batch, check_layers

Leaves = list[Any]  # flat parameter leaves; None where a leaf gets no gradient
Rows = tuple[jax.Array, ...]  # per-row inputs of the layers: (positions[, segment ids])


@dataclasses.dataclass(frozen=True)
class _Plan:
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


# ----------------------------------------------------------------------------- small helpers
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


def _read_by(fn: Callable, *args: Any) -> list[bool]:
    """Which leaves of `args` the traced `fn` reads: an untied LM's head never reads the
    embedding, which must then get no (all-zero, vocabulary-sized) gradient buffer."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    jaxpr = jax.make_jaxpr(fn)(*shapes).jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return [id(v) in read for v in jaxpr.invars]


# ----------------------------------------------------------------------------- the schedule
def _stage_step(plan: _Plan, do_fwd: bool) -> Callable:
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


def _head_step(plan: _Plan, c: _Carry, t: jax.Array, head: Leaves, seed_mb: jax.Array,
               tgt_M: jax.Array) -> _Carry:
    """Head + loss and their vjp for the microbatch the last stage just finished, computed once.

    Why not inside the vmapped stage step: the stages run in lockstep, so a head there would
    be computed by every stage (S times the biggest matmul of the step) and discarded on all
    but the last. Here the last stage's output is split by positions over the stages (position
    p to stage p mod S, as `models.lm_task.head_losses` chunks them): each stage computes the
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


def _constrain_carry(plan: _Plan, c: _Carry) -> _Carry:
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


def _init_carry(plan: _Plan, w_SP: Leaves, head: Leaves, x_MbTE: jax.Array, rows_M: Rows
                ) -> _Carry:
    S, (M, b, T, E) = plan.stages, x_MbTE.shape
    zeros = lambda *shape: jnp.zeros(shape + (b, T, E), x_MbTE.dtype)
    sown_P = jax.eval_shape(plan.stage_fn, [a[0] for a in w_SP], x_MbTE[0],
                            *[a[0] for a in rows_M])[1]  # what one stage sows (P, ...)
    return _constrain_carry(plan, _Carry(
        zeros(S), zeros(S), zeros(S, plan.slots), zeros(S, M) if plan.want_dx else None,
        [jnp.zeros_like(w) if d else None for w, d in zip(w_SP, plan.layer_diff)],
        [jnp.zeros((S,) + h.shape, h.dtype) if d else None for h, d in zip(head, plan.head_diff)],
        jnp.zeros((S,), jnp.float32), [jnp.zeros((S,) + a.shape, a.dtype) for a in sown_P]))


def _run(plan: _Plan, w_SP: Leaves, head: Leaves, x_MbTE: jax.Array, rows_M: Rows,
         tgt_MbT: jax.Array, seed: jax.Array, ct_SP: Leaves) -> _Carry:
    """The three scans: warmup (forward only), steady (1F1B + head), cooldown (backward only);
    `ct_SP`: each stage's cotangent of what its layers sow, per microbatch."""
    S, M = plan.stages, plan.microbatches
    stage_ids = jnp.arange(S)
    phases = ((True, False, False, 0, S - 1), (True, True, True, S - 1, M + S - 1),
              (False, False, True, M + S - 1, M + 2 * S - 2))
    c = _init_carry(plan, w_SP, head, x_MbTE, rows_M)
    staged = lambda fwd: jax.vmap(_stage_step(plan, fwd), spmd_axis_name="pipeline",
                                  in_axes=(0, 0, 0, 0, None, None, None))
    forward, backward = staged(True), staged(False)
    for do_fwd, do_head, do_bwd, start, stop in phases:

        def body(c: _Carry, t: jax.Array, do_fwd=do_fwd, do_head=do_head, do_bwd=do_bwd):
            if do_fwd:
                c = forward(c, w_SP, ct_SP, stage_ids, t, x_MbTE, rows_M)
            if do_head:
                c = _head_step(plan, c, t, head, seed / M, tgt_MbT)
            if do_bwd:
                c = backward(c, w_SP, ct_SP, stage_ids, t, x_MbTE, rows_M)
            fwd = jnp.roll(c.fwd, 1, axis=0) if do_fwd else c.fwd  # to the next stage
            bwd = jnp.roll(c.bwd, -1, axis=0) if do_bwd else c.bwd  # to the previous stage
            return _constrain_carry(plan, c._replace(fwd=fwd, bwd=bwd)), None

        c, _ = jax.lax.scan(body, c, jnp.arange(start, stop))
    return c


def _gradients(plan: _Plan, layers: Leaves, head: Leaves, h_BTE: jax.Array,
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
    c = _run(plan, plan.layout(layers), head, split(h_BTE), tuple(split(a) for a in rows),
             split(tgt_BT), seed, [a.reshape(S, -1, *a.shape[1:]) for a in ct_sown])
    to_layers = lambda g: g if g is None else g.reshape((-1,) + g.shape[2:])  # (S, P) -> L
    gw = [to_layers(g) for g in c.gw]
    gh = [g if g is None else jnp.sum(g, axis=0) for g in c.gh]  # one reduce over `pipeline`
    dx = None if c.dx is None else constrain_batch(c.dx[0].swapaxes(0, 1).reshape(B, T, E), mesh)
    return jnp.sum(c.loss) / M, gw, gh, dx, [to_layers(a) / M for a in c.sown]


def _head_diff(plan: _Plan, head: list[CustomVJPPrimal], h_BTE: jax.Array,
               tgt_BT: jax.Array) -> tuple[bool, ...]:
    """The head leaves to differentiate: those being differentiated that the head reads."""
    b = h_BTE.shape[0] // plan.microbatches
    read = _read_by(plan.head_loss, [x.value for x in head],
                    jax.ShapeDtypeStruct((b,) + h_BTE.shape[1:], h_BTE.dtype),
                    jax.ShapeDtypeStruct((b,) + tgt_BT.shape[1:], tgt_BT.dtype))
    return tuple(x.perturbed and r for x, r in zip(head, read))


def _fused(plan: _Plan, primal: Callable[..., tuple[jax.Array, Leaves]]
           ) -> Callable[..., tuple[jax.Array, Leaves]]:
    """(layers, head, h, rows, targets, seed, sown cotangent) -> (loss, sown (L, ...)),
    differentiated by the schedule; `rows` is (positions,) or, for packed rows, (positions,
    segment ids). The sown values' own cotangent is ignored: their loss term's gradient is
    in the loss's (`OneFOneB.fused_loss`)."""

    @jax.custom_vjp
    def fused(layers, head, h_BTE, rows, tgt_BT, seed, ct_sown):
        return primal(layers, head, h_BTE, rows, tgt_BT)

    def fwd(layers, head, h_BTE, rows, tgt_BT, seed, ct_sown):
        # Only differentiated leaves get gradients: LoRA's frozen base weights and a frozen
        # embedding's input gradient cost nothing; nor does a head parameter the head never reads.
        v = custom_vjp_primal_tree_values
        p = dataclasses.replace(
            plan, layer_diff=tuple(x.perturbed for x in layers), want_dx=h_BTE.perturbed,
            head_diff=_head_diff(plan, head, h_BTE.value, tgt_BT.value))
        loss, gw, gh, dx, sown = _gradients(p, v(layers), v(head), h_BTE.value,
                                            tuple(v(rows)), tgt_BT.value, seed.value,
                                            v(ct_sown))
        return (loss, sown), (gw, gh, dx, seed.value)

    def bwd(res, ct):
        gw, gh, dx, seed = res
        ct = ct[0]  # the loss's; the sown values' gradient is in it
        if isinstance(ct, SymbolicZero):
            return None, None, None, None, None, None, None
        k = ct / seed  # 1 under loss scaling (the seed was the scale), else the cotangent
        scale = lambda g: g if g is None else g * k.astype(g.dtype)
        return [scale(g) for g in gw], [scale(g) for g in gh], scale(dx), None, None, None, None

    fused.defvjp(fwd, bwd, symbolic_zeros=True)
    return fused


def _sown_cotangent(sown_loss: Callable[[nnx.State], Any] | None, sown: nnx.State,
                    scale: jax.Array) -> Leaves:
    """d sown_loss / d (what the layers sow, (L, ...)) times `scale`, as flat leaves: a
    constant, the loss being linear in them (the router's losses are means of the layers'
    statistics)."""
    zeros = [jnp.zeros(a.shape, a.dtype) for a in jax.tree.leaves(sown)]
    if sown_loss is None or not zeros:
        return zeros
    tree = jax.tree.structure(sown)
    grad = jax.grad(lambda leaves: jnp.asarray(sown_loss(tree.unflatten(leaves)),
                                               jnp.float32))(zeros)
    return [g * scale.astype(g.dtype) for g in grad]


# ----------------------------------------------------------------------------- the runner
@dataclasses.dataclass(frozen=True, eq=False)
class OneFOneB:
    """The 1F1B runner for `config.pipeline.schedule='1f1b'` (see the module docstring).

    `models.lm_task.lm_loss` calls `fused_loss` in place of the model's forward; `loss_fn` calls
    `scaled` under float16 loss scaling, so the backward inside the schedule starts from the
    scaled loss and float16 cotangents do not underflow.
    """

    mesh: Mesh
    stages: int
    microbatches: int
    remat: str = "none"
    seed: jax.Array | None = None  # the loss scale, set per trace by `scaled`
    fuses_loss: bool = True

    def scaled(self, loss_scale: jax.Array) -> "OneFOneB":
        return dataclasses.replace(self, seed=loss_scale)

    def __call__(self, block: nnx.Module, h_BTE: jax.Array, positions_BT: jax.Array,
                 segments_BT: jax.Array | None = None):
        raise ConfigError(paragraph(
            "pipeline.schedule='1f1b' runs the loss inside the pipeline schedule, which only the",
            "language-model loss (model.task='lm') supports. Use --config.pipeline.schedule=gpipe",
            "(with --config.model.remat=full to save activation memory) for this model."))

    def fused_loss(self, model: nnx.Module, tokens_BT: jax.Array, targets_BT: jax.Array,
                   loss_fn: LossFn, positions_BT: jax.Array | None = None,
                   segments_BT: jax.Array | None = None,
                   sown_loss: Callable[[nnx.State], Any] | None = None,
                   sown_weight: jax.Array | float = 1.0) -> jax.Array:
        """`loss_fn(model, layers(model.embed(tokens)), targets)` with the layers run as
        a 1F1B pipeline, averaged over microbatches. The model must expose `embed`, `layers`
        (a stacked block) and `head`. Packed rows pass their positions and segment ids.

        What the layers sow (the MoE router's statistics) is left on `model.layers`, (L, ...)
        means over the microbatches, as GPipe leaves it. The backward runs inside the schedule,
        so a loss term the caller computes from them, `sown_loss` (linear in the sown values,
        as `moe.router_objective`; weighing `sown_weight` times this loss in the caller's
        total), is differentiated here: its gradient is in this loss's, and the sown values
        carry none of their own.
        """
        B, T = tokens_BT.shape
        check_batch(B, self.microbatches)
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
        rows = (positions_BT,) if segments_BT is None else (positions_BT, segments_BT)
        nnx.pop(model.layers, nnx.Intermediate)  # a previous call's sown values are no weights
        h_BTE = model.embed(tokens_BT)
        plan, primal, layers, head = self._plan(model, loss_fn)
        check_layers(layers[0].shape[0], self.stages, 1)
        seed = jnp.asarray(1.0 if self.seed is None else self.seed, jnp.float32)
        b = B // self.microbatches  # what the whole stack sows for one microbatch: (L, ...)
        sown = jax.eval_shape(functools.partial(plan.stage_fn, as_state=True), layers,
                              h_BTE[:b], *[r[:b] for r in rows])[1]
        ct = _sown_cotangent(sown_loss, sown, seed * sown_weight / self.microbatches)
        loss, sown_L = _fused(plan, primal)(layers, head, h_BTE, rows, targets_BT, seed, ct)
        nnx.update(model.layers, jax.tree.structure(sown).unflatten(sown_L))
        return loss

    def _plan(self, model: nnx.Module, loss_fn: LossFn
              ) -> tuple[_Plan, Callable[..., jax.Array], Leaves, Leaves]:
        """The static plan, the undifferentiated (GPipe) loss, and the flat parameter leaves."""
        S, mesh = self.stages, self.mesh
        graphdef, layers, rest = nnx.split(model, nnx.PathContains("layers"), ...)
        block_def, layer_vars = nnx.graphdef(model.layers), layers["layers"]
        layer_tree, head_tree = jax.tree.structure(layer_vars), jax.tree.structure(rest)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), layers)
        variables = lambda s: jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, nnx.Variable))
        # The per-layer data (Gemma's local/global flag) ride behind the layer leaves, laid out
        # over the stages as they are and never differentiated: each stage scans its own slice.
        extra = layer_data(model.layers)
        n = layer_tree.num_leaves

        def stage_fn(w: Leaves, x_bTE: jax.Array, pos_bT: jax.Array,
                     seg_bT: jax.Array | None = None, as_state: bool = False
                     ) -> tuple[jax.Array, Leaves | nnx.State]:
            block = nnx.merge(block_def, layer_tree.unflatten(w[:n]))
            y = scan_layers(block, x_bTE, pos_bT, self.remat, segments_BT=seg_bT,
                            per_layer=dict(zip(extra, w[n:])))
            sown = nnx.pop(block, nnx.Intermediate)  # what the layers sowed: MoE router stats
            return y, sown if as_state else jax.tree.leaves(sown)

        def head_loss(head: Leaves, y_bTE: jax.Array, tgt_bT: jax.Array) -> jax.Array:
            m = nnx.merge(graphdef, abstract, head_tree.unflatten(head))
            return loss_fn(m, y_bTE, tgt_bT)

        def layout(w: Leaves) -> Leaves:
            laid_out = stage_layout(layer_tree.unflatten(w[:n]), mesh, 1, S)
            return ([a[0] for a in jax.tree.leaves(laid_out)]
                    + [e.reshape(S, -1, *e.shape[1:]) for e in w[n:]])

        def primal(w: Leaves, head: Leaves, h_BTE, rows: Rows, tgt_BT
                   ) -> tuple[jax.Array, Leaves]:
            block = nnx.merge(block_def, layer_tree.unflatten(w[:n]))
            y_BTE = pipeline_layers(block, h_BTE, rows[0], mesh=mesh, stages=S,
                                    microbatches=self.microbatches, repeats=1, remat=self.remat,
                                    segments_BT=rows[1] if len(rows) > 1 else None)
            sown = jax.tree.leaves(nnx.pop(block, nnx.Intermediate))
            return head_loss(head, y_BTE, tgt_BT), sown

        plan = _Plan(mesh, S, self.microbatches, stage_fn, head_loss, layout,
                     tuple(PartitionSpec("pipeline", None, *rules_axes(v, mesh)[1:])
                           for v in variables(layer_vars))
                     + (PartitionSpec("pipeline"),) * len(extra),
                     tuple(PartitionSpec("pipeline", *rules_axes(v, mesh))
                           for v in variables(rest)))
        layers = jax.tree.leaves(layer_vars) + list(extra.values())
        return plan, primal, layers, jax.tree.leaves(rest)
