"""The 1F1B pipeline schedule in one SPMD program: each stage interleaves forwards and backwards.

Why: under GPipe (gpipe.py) every stage runs all M microbatches forward and autodiff then
runs them all backward, so a stage holds the activations of all M microbatches at once: stored
activations grow with M. Under 1F1B a stage starts a microbatch's backward as soon as its
cotangent arrives, so at most 2S-1 microbatches are ever in flight on a stage, whatever M.

How, still in lockstep with every stage vmapped over `pipeline` (`spmd_axis_name`) as in
gpipe.py: stage s runs the forward of microbatch m at iteration t = m + s and its backward at
t = m + 2S-2-s. In one iteration the last stage runs the forward, then the head + loss and
their vjp (split by positions over all stages, so computed once: `onef1b_steps.head_step`), then
the backward
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
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero, custom_vjp_primal_tree_values
from jax.sharding import Mesh, PartitionSpec

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.nn.scan import layer_data, scan_layers
from jaxscale.models.runner import HeadLoss
from jaxscale.parallel.gpipe import pipeline_layers
from jaxscale.parallel.onef1b_steps import Leaves, Plan, Rows, gradients
from jaxscale.parallel.stages import check_batch, check_layers, rules_axes, stage_layout


def _read_by(fn: Callable, *args: Any) -> list[bool]:
    """Which leaves of `args` the traced `fn` reads: an untied LM's head never reads the
    embedding, which must then get no (all-zero, vocabulary-sized) gradient buffer."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    jaxpr = jax.make_jaxpr(fn)(*shapes).jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return [id(v) in read for v in jaxpr.invars]



def _head_diff(plan: Plan, head: list[CustomVJPPrimal], h_BTE: jax.Array,
               tgt_BT: jax.Array) -> tuple[bool, ...]:
    """The head leaves to differentiate: those being differentiated that the head reads."""
    b = h_BTE.shape[0] // plan.microbatches
    read = _read_by(plan.head_loss, [x.value for x in head],
                    jax.ShapeDtypeStruct((b,) + h_BTE.shape[1:], h_BTE.dtype),
                    jax.ShapeDtypeStruct((b,) + tgt_BT.shape[1:], tgt_BT.dtype))
    return tuple(x.perturbed and r for x, r in zip(head, read))


def _fused(plan: Plan, primal: Callable[..., tuple[jax.Array, Leaves]]
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
        loss, gw, gh, dx, sown = gradients(p, v(layers), v(head), h_BTE.value,
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


@dataclasses.dataclass(frozen=True, eq=False)
class OneFOneB:
    """The 1F1B runner for `config.pipeline.schedule='1f1b'` (see the module docstring).

    `models/decoder/lm_task.lm_loss` calls `fused_loss` in place of the model's forward;
    `train/step.loss_and_metrics` calls `scaled` under float16 loss scaling, so the backward
    inside the schedule starts from the scaled loss and float16 cotangents do not underflow.
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
                   head_loss: HeadLoss, positions_BT: jax.Array | None = None,
                   segments_BT: jax.Array | None = None,
                   sown_loss: Callable[[nnx.State], Any] | None = None,
                   sown_weight: jax.Array | float = 1.0) -> jax.Array:
        """`head_loss(model, layers(model.embed(tokens)), targets)` with the layers run as
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
        plan, primal, layers, head = self._plan(model, head_loss)
        check_layers(layers[0].shape[0], self.stages, 1)
        seed = jnp.asarray(1.0 if self.seed is None else self.seed, jnp.float32)
        b = B // self.microbatches  # what the whole stack sows for one microbatch: (L, ...)
        sown = jax.eval_shape(functools.partial(plan.stage_fn, as_state=True), layers,
                              h_BTE[:b], *[r[:b] for r in rows])[1]
        ct = _sown_cotangent(sown_loss, sown, seed * sown_weight / self.microbatches)
        loss, sown_L = _fused(plan, primal)(layers, head, h_BTE, rows, targets_BT, seed, ct)
        nnx.update(model.layers, jax.tree.structure(sown).unflatten(sown_L))
        return loss

    def _plan(self, model: nnx.Module, head_loss: HeadLoss
              ) -> tuple[Plan, Callable[..., jax.Array], Leaves, Leaves]:
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

        def loss_of_head(head: Leaves, y_bTE: jax.Array, tgt_bT: jax.Array) -> jax.Array:
            m = nnx.merge(graphdef, abstract, head_tree.unflatten(head))
            return head_loss(m, y_bTE, tgt_bT)

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
            return loss_of_head(head, y_BTE, tgt_BT), sown

        plan = Plan(mesh, S, self.microbatches, stage_fn, loss_of_head, layout,
                     tuple(PartitionSpec("pipeline", None, *rules_axes(v, mesh)[1:])
                           for v in variables(layer_vars))
                     + (PartitionSpec("pipeline"),) * len(extra),
                     tuple(PartitionSpec("pipeline", *rules_axes(v, mesh))
                           for v in variables(rest)))
        layers = jax.tree.leaves(layer_vars) + list(extra.values())
        return plan, primal, layers, jax.tree.leaves(rest)
