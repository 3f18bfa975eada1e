"""The pure train step: `train_step(state, batch) -> (state, metrics)`.

Built once per run by `jit_train_step`, which closes over the static pieces (model definition,
objective, reference model, optimizer, schedule, policy, rules and mesh) and returns a jitted
function with explicit in/out shardings and a donated state. Gradient accumulation scans over
microbatches inside the step; the objective prepares the whole batch first (batch-wide counts),
so that every split normalises as the unsplit batch does.
Periodic work is not here: held-out metrics are `train/heldout.py`'s, checkpoints and Lo-Fi
pushes hang off the loop as hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models import ModelDef
from jaxscale.models.adapters.lora_matmul import adapter_dropout
from jaxscale.models.runner import LayerRunner
from jaxscale.models.task import step_metrics
from jaxscale.objectives import Objective
from jaxscale.optim import on_device
from jaxscale.parallel.accumulate import accumulate_per_replica
from jaxscale.precision import DynamicLossScale, Policy
from jaxscale.rules import AxisRules, as_tuple, logical_to_mesh_axes, use_rules
from jaxscale.train.reference import Reference
from jaxscale.train.state import TrainState, merge_trees

# A batch is a dict of arrays sharing the leading `batch` dimension, e.g. {'tokens': (B, T+1)}
# int32 for language models (inputs [:, :-1], targets [:, 1:]) or {'images', 'labels'}.
Batch = dict[str, jax.Array]
RunLayers = LayerRunner | None


# The reference model a step scores against: (its definition, its weights), or None.
BoundReference = tuple[ModelDef, Any] | None


def loss_and_metrics(params: Any, frozen: Any, batch: Batch, model_def: ModelDef,
                     run_layers: RunLayers = None, loss_scale: jax.Array | None = None,
                     objective: Objective | None = None, reference: BoundReference = None
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss of the run's objective (None: the model's own task, `model_def.task`) of the
    model bound to params + frozen, scored against `reference` where the objective uses one,
    and the metrics it reports with those the loss recorded (`task.step_metrics`: the MoE
    router's; {} for most models)."""
    model = model_def.module(merge_trees(params, frozen) if frozen else params)
    if loss_scale is not None and run_layers is not None:
        run_layers = run_layers.scaled(loss_scale)  # 1F1B starts its backward from the scale
    if objective is None:
        loss, metrics = model_def.task.loss(model, batch, run_layers), {}
    else:
        ref = None if reference is None else reference[0].module(reference[1])
        loss, metrics = objective.loss(model, ref, batch, run_layers)
    loss = loss if loss_scale is None else loss * loss_scale  # float16: see DynamicLossScale
    return loss, {**metrics, **step_metrics(model)}


def accumulate_grads(params: Any, frozen: Any, batch: Batch, model_def: ModelDef,
                     grad_accum: int, run_layers: RunLayers = None,
                     loss_scale: jax.Array | None = None, objective: Objective | None = None,
                     reference: BoundReference = None) -> tuple[jax.Array, Any]:
    """Mean loss and gradients over `grad_accum` microbatches (equal to the large batch)."""
    loss, grads, _ = accumulate(params, frozen, batch, model_def, grad_accum, run_layers,
                                loss_scale, objective, reference)
    return loss, grads


def accumulate(params: Any, frozen: Any, batch: Batch, model_def: ModelDef, grad_accum: int,
               run_layers: RunLayers = None, loss_scale: jax.Array | None = None,
               objective: Objective | None = None, reference: BoundReference = None
               ) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """Mean loss, gradients and extra metrics (`loss_and_metrics`) over `grad_accum`
    microbatches; the metrics are the microbatches' mean (each holds as many rows)."""
    value_and_grad = jax.value_and_grad(loss_and_metrics, has_aux=True)
    grad_fn = lambda *a: value_and_grad(*a, loss_scale=loss_scale, objective=objective,
                                        reference=reference)
    prepare = model_def.task.prepare if objective is None else objective.prepare
    batch = dict(prepare(batch))  # e.g. masked rows: the split parts share a batch-wide count
    if grad_accum > 1 or run_layers is not None:  # microbatch loops: reduce over data once
        once = accumulate_per_replica(
            lambda mb: grad_fn(params, frozen, mb, model_def, run_layers), params, batch,
            grad_accum, 1 if run_layers is None else run_layers.microbatches)
        if once is not None:
            return once
    if grad_accum == 1:
        (loss, metrics), grads = grad_fn(params, frozen, batch, model_def, run_layers)
        return loss, grads, metrics
    micro = jax.tree.map(
        lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

    def body(carry, mb):
        (loss, metrics), grads = grad_fn(params, frozen, mb, model_def, run_layers)
        return jax.tree.map(jnp.add, carry, (loss, grads)), metrics

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), metrics = jax.lax.scan(body, zeros, micro)
    loss, grads = jax.tree.map(lambda x: x / grad_accum, (loss, grads))
    return loss, grads, jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)


@dataclass(frozen=True)
class StepContext:
    """Everything static a step needs; built once per run."""

    model_def: ModelDef
    optimizer: optax.GradientTransformation
    lr_schedule: optax.Schedule
    policy: Policy
    rules: AxisRules
    mesh: Mesh
    grad_accum: int = 1
    skip_nonfinite: bool = False
    run_layers: RunLayers = None
    loss_scale: DynamicLossScale | None = None  # set when the policy asks for loss scaling
    offload_state: bool = False  # optimizer state in pinned host memory (`optim.offload_state`)
    objective: Objective | None = None  # `config.objective` (None: the model's own task)
    reference: Reference | None = None  # the objective's reference model (`train/reference.py`)

    def bound_reference(self, state: TrainState) -> BoundReference:
        """(definition, weights) of the reference model in `state`, or None."""
        if self.reference is None:
            return None
        return self.reference.model_def, self.reference.params(state.frozen, state.reference)


def train_step(ctx: StepContext, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    """One optimizer step. Non-finite loss/gradients skip the update when configured."""
    scaler = ctx.loss_scale
    dropout_key = jax.random.fold_in(state.rng, state.step)  # LoRA dropout: training only
    with use_rules(ctx.rules, ctx.mesh), adapter_dropout(dropout_key):
        loss, grads, task_metrics = accumulate(
            state.params, state.frozen, batch, ctx.model_def, ctx.grad_accum, ctx.run_layers,
            None if scaler is None else state.extra["loss_scale"], ctx.objective,
            ctx.bound_reference(state))
    if scaler is not None:
        loss, grads = scaler.unscale(state.extra, (loss, grads))
    grad_norm = optax.global_norm(grads)
    if ctx.offload_state:  # onto the device for the update; out_shardings take it back
        state = state.replace(opt_state=on_device(state.opt_state))
    updates, opt_state = ctx.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = applied = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if scaler is not None:  # an overflowed gradient is expected now and then: skip, not fail
        state = state.replace(extra={**state.extra, **scaler.update(state.extra, applied)})
        finite = jnp.isfinite(loss)  # only a non-finite loss counts as a real divergence
    step = state.step + 1
    bad = (~finite).astype(jnp.int32)
    extra = {**state.extra, "nonfinite_steps": state.extra["nonfinite_steps"] + bad,
             "first_nonfinite": jnp.where((state.extra["first_nonfinite"] < 0) & ~finite,
                                          step, state.extra["first_nonfinite"])}
    new = state.replace(step=step, params=params, opt_state=opt_state, extra=extra)
    if ctx.skip_nonfinite or scaler is not None:
        keep = lambda n, o: jnp.where(applied, n, o)
        new = new.replace(params=jax.tree.map(keep, params, state.params),
                          opt_state=jax.tree.map(keep, opt_state, state.opt_state))
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": ctx.lr_schedule(state.step),
               "nonfinite_steps": extra["nonfinite_steps"], **task_metrics}
    if scaler is not None:
        metrics.update(loss_scale=extra["loss_scale"], skipped_steps=extra["skipped_steps"])
    return new, metrics


def batch_sharding(rules: AxisRules, mesh: Mesh, shapes: dict[str, tuple[int, ...]]
                   ) -> dict[str, NamedSharding]:
    """Every batch array is sharded along its leading dimension by the rule for `batch`."""
    return {k: NamedSharding(mesh, rules.activation_spec(("batch",) + (None,) * (len(s) - 1), s,
                                                         mesh, f"<batch:{k}>"))
            for k, s in shapes.items()}


def check_batch_divides(rules: AxisRules, mesh: Mesh, rows: int) -> None:
    """Refuses a global batch that the batch axes do not divide: sharded over fewer devices,
    the rest would repeat their rows' work, silently wasting a share of every step."""
    axes = tuple(a for a in as_tuple(logical_to_mesh_axes(("batch",), rules.rules)[0])
                 if mesh.shape.get(a, 1) > 1)
    devices = math.prod(mesh.shape[a] for a in axes)
    if rows % devices == 0:
        return
    spec = rules.activation_spec(("batch",), (rows,), mesh, "<batch>")
    used = math.prod(mesh.shape[a] for a in as_tuple(spec[0]))
    raise ConfigError(paragraph(
        f"data.batch_size={rows} is not divisible by the {devices} devices of the batch axes",
        f"({', '.join(f'{a}={mesh.shape[a]}' for a in axes)}): it would be split over {used} of",
        f"them and the others would repeat that work, wasting {1 - used / devices:.0%} of the",
        f"batch compute. Set data.batch_size to a multiple of {devices} (e.g.",
        f"{-(-rows // devices) * devices}), or change the mesh.",
    ))


def global_batch(local: dict[str, np.ndarray], rules: AxisRules, mesh: Mesh, rows: int
                 ) -> dict[str, jax.Array]:
    """The global batch of `rows` rows assembled from this host's rows `local`, sharded as
    `batch_sharding` says."""
    shapes = {k: (rows,) + v.shape[1:] for k, v in local.items()}
    sharding = batch_sharding(rules, mesh, shapes)
    return {k: jax.make_array_from_process_local_data(sharding[k], v, shapes[k])
            for k, v in local.items()}


def jit_train_step(ctx: StepContext, shardings: TrainState,
                   batch_shapes: dict[str, tuple[int, ...]]) -> Callable:
    """The jitted train step with explicit shardings and a donated state. (Held-out metrics are
    not a step: `jaxscale.train.heldout`.)"""
    for shape in batch_shapes.values():
        check_batch_divides(ctx.rules, ctx.mesh, shape[0])
    batch_sh = batch_sharding(ctx.rules, ctx.mesh, batch_shapes)
    return jax.jit(lambda s, b: train_step(ctx, s, b), in_shardings=(shardings, batch_sh),
                   out_shardings=(shardings, None), donate_argnums=0)
