"""The training loop: build everything from the config, run steps, call hooks, log metrics.

`Trainer.build(config, workdir)` performs the visible set-up (mesh, rules, policy, model
definition, optimizer, sharded state, jitted steps, data); `Trainer.run()` loops. Periodic work
(evaluation, checkpoints, Lo-Fi pushes) are `Hook`s called after each step; a hook may return a
replacement state (e.g. after loading an average). Only process 0 logs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import ml_collections as mlc
import numpy as np

from jaxscale import config as config_lib
from jaxscale import storage
from jaxscale.data import build_data
from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.mesh import make_mesh, mesh_summary
from jaxscale.metrics import MetricsWriter, ProgressBar, llama_flops_per_token, mfu
from jaxscale.models import lora
from jaxscale.parallel.pipeline import make_layer_runner
from jaxscale.precision import DynamicLossScale, get_policy
from jaxscale.rules import AxisRules
from jaxscale.train.optim import make_optimizer
from jaxscale.train.state import ModelDef, TrainState, flatten, init_state, unflatten
from jaxscale.train.step import StepContext, batch_sharding, jit_steps


class Hook(Protocol):
    def after_step(self, trainer: "Trainer", state: TrainState, step: int) -> TrainState | None:
        """Called after every step with the host-side step number."""

    def at_end(self, trainer: "Trainer", state: TrainState) -> None:
        """Called once after the last step."""


class NonFiniteError(JaxscaleError):
    """Training produced a non-finite loss or gradient norm."""


@dataclass
class Trainer:
    config: mlc.ConfigDict
    workdir: str
    ctx: StepContext
    state: TrainState
    shardings: TrainState
    train_fn: Any
    eval_fn: Any
    batches: Any
    eval_data: list[dict[str, np.ndarray]]
    hooks: list[Hook] = field(default_factory=list)
    data_state: dict | None = None

    @classmethod
    def build(cls, config: mlc.ConfigDict, workdir: str,
              devices: Sequence[Any] | None = None) -> "Trainer":
        config_lib.validate(config)
        storage.configure(config.get("storage"))  # S3 endpoint/region for every location
        if workdir and jax.process_index() == 0:
            config_lib.save_config(config, workdir)
        mesh = make_mesh(config.mesh, devices)
        rules = AxisRules.from_config(config)
        policy = get_policy(config.precision)
        model_def = lora.with_adapters(ModelDef.build(config.model, policy), config.lora)
        optimizer, lr = make_optimizer(config.optim, config.train.steps)
        scaler = DynamicLossScale.from_config(config.loss_scale) if policy.loss_scaling else None
        state, shardings = init_state(model_def, optimizer, rules, mesh, config.seed,
                                      lora.trainable(config.lora), scaler.init if scaler else dict)
        if config.init_from:
            state = _init_from(config.init_from, state, shardings, config.model)
        ctx = StepContext(model_def, optimizer, lr, policy, rules, mesh,
                          config.train.grad_accum, config.train.skip_nonfinite,
                          run_layers=make_layer_runner(config.pipeline, mesh, config.model.remat,
                                                       config.model.get("num_layers")),
                          task=config.model.get("task", "lm"), loss_scale=scaler)
        lofi = config.lofi
        shard = (lofi.worker_id, lofi.num_workers) if lofi.enabled else (0, 1)
        batches, evals = build_data(config, jax.process_index(), jax.process_count(), *shard)
        shapes = {k: (config.data.batch_size,) + v.shape[1:] for k, v in evals[0].items()}
        train_fn, eval_fn = jit_steps(ctx, shardings, shapes)
        return cls(config, workdir, ctx, state, shardings, train_fn, eval_fn, batches, evals)

    @property
    def is_primary(self) -> bool:
        return jax.process_index() == 0

    def to_global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Assembles the global batch from this host's rows."""
        shapes = {k: (self.config.data.batch_size,) + v.shape[1:] for k, v in local.items()}
        sharding = batch_sharding(self.ctx.rules, self.ctx.mesh, shapes)
        return {k: jax.make_array_from_process_local_data(sharding[k], v, shapes[k])
                for k, v in local.items()}

    def evaluate(self, state: TrainState) -> float:
        losses = [self.eval_fn(state, self.to_global(b)) for b in self.eval_data]
        return float(np.mean(jax.device_get(losses)))

    def flops_per_token(self) -> float | None:
        m, d = self.config.model, self.config.data
        if m.get("name", "llama") != "llama":  # the FLOP count below is the Llama's
            return None
        return llama_flops_per_token(m.num_layers, m.embed, m.num_heads, m.num_kv_heads,
                                     m.head_dim, m.mlp, m.vocab_size, d.seq_len)

    def run(self) -> TrainState:
        cfg, state = self.config.train, self.state
        start = int(jax.device_get(state.step))
        it = self.batches.iterator(self.data_state)
        writer = MetricsWriter(self.workdir, enabled=self.is_primary)
        writer.truncate_after(start)  # a resumed run re-logs the steps after its checkpoint
        bar = ProgressBar(cfg.steps, initial=start, enabled=self.is_primary)
        if self.is_primary:
            print(f"jaxscale: mesh {mesh_summary(self.ctx.mesh)}, "
                  f"{self.ctx.model_def.num_params():,} parameters, steps {start}->{cfg.steps}")
        tokens = self.config.data.batch_size * self.config.data.seq_len
        last_time, last_step = time.perf_counter(), start
        for step in range(start + 1, cfg.steps + 1):
            state, metrics = self.train_fn(state, self.to_global(next(it)))
            self.data_state = it.get_state()
            if step % cfg.log_every == 0 or step == cfg.steps:
                host = {k: float(v) for k, v in jax.device_get(metrics).items()}
                self.check_finite(state)
                if self.ctx.loss_scale is not None:
                    self.ctx.loss_scale.check(state.extra)
                now = time.perf_counter()
                host["step_time_s"] = (now - last_time) / (step - last_step)
                host["tokens_per_s"] = tokens / host["step_time_s"]
                fpt = self.flops_per_token()
                util = fpt and mfu(fpt, host["tokens_per_s"], jax.device_count(),
                                   jax.devices()[0].device_kind)
                if util is not None:
                    host["mfu"] = util
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    host["eval_loss"] = self.evaluate(state)
                writer.write(step, host)
                bar.update(step, host)
                last_time, last_step = time.perf_counter(), step
            for hook in self.hooks:
                state = hook.after_step(self, state, step) or state
        for hook in self.hooks:
            hook.at_end(self, state)
        bar.close()
        writer.close()
        self.state = state
        return state

    def check_finite(self, state: TrainState) -> None:
        """Raises if any step so far was non-finite (unless such steps are skipped)."""
        first = int(jax.device_get(state.extra["first_nonfinite"]))
        if first >= 0 and not self.config.train.skip_nonfinite:
            raise NonFiniteError(paragraph(
                f"Non-finite loss or gradient norm at step {first}. Training stopped",
                "before saving anything from that step; the last good checkpoint was kept. Lower",
                "optim.lr, use a float32 / bf16-mixed precision policy, or set",
                "config.train.skip_nonfinite=True to skip such updates and count them.",
            ))


def _init_from(path: str, state: TrainState, shardings: TrainState,
               model_cfg: Any = None) -> TrainState:
    """Replaces the freshly initialised parameters with saved ones, placed by the rules.

    Leaves are read and placed one at a time (`init_from.LeafSource`), so a converted model
    never sits whole on the host.
    """
    from jaxscale.init_from import LeafSource, check_matches, check_model_config, place_leaves

    check_model_config(path, model_cfg)
    source = LeafSource(path)
    shapes = source.shapes
    if state.frozen:  # LoRA: the saved weights are the frozen base; adapters start fresh
        shapes = {k: v for k, v in shapes.items() if not lora.is_adapter(k)}
        check_matches(shapes, flatten(state.frozen), path, model_cfg)
        placed = place_leaves(source, flatten(shardings.frozen), flatten(state.frozen))
        return state.replace(frozen=unflatten(placed))
    check_matches(shapes, flatten(state.params), path, model_cfg)
    placed = place_leaves(source, flatten(shardings.params), flatten(state.params))
    return state.replace(params=unflatten(placed))


def _attach_checkpoints(trainer: Trainer) -> None:
    """Resumes from the newest complete checkpoint in the workdir and saves periodically."""
    from jaxscale.checkpoint import CheckpointHook, Checkpointer

    c = trainer.config.checkpoint
    checkpointer = Checkpointer(trainer.workdir, c.every, c.keep)
    if checkpointer.latest_step() is not None:
        trainer.state, trainer.data_state = checkpointer.restore(trainer.state, trainer.shardings)
        if trainer.is_primary:
            print(f"jaxscale: resumed from {checkpointer.directory}/{checkpointer.latest_step()}")
    trainer.hooks.append(CheckpointHook(checkpointer))


def train(config: mlc.ConfigDict, workdir: str, hooks: Sequence[Hook] = ()) -> TrainState:
    trainer = Trainer.build(config, workdir)
    if workdir and config.checkpoint.every:
        _attach_checkpoints(trainer)
    trainer.hooks.extend(hooks)
    if config.lofi.enabled:
        from jaxscale.lofi.worker import LofiWorker
        worker = LofiWorker(config.lofi, config.train.steps, config.data.batch_size)
        trainer.state = worker.start(trainer, trainer.state)
        trainer.hooks.append(worker)
    # Checkpoints last: they save what the run continues with (after a Lo-Fi sync), or a run
    # resumed from a sync step's checkpoint would miss that step's average.
    from jaxscale.checkpoint import CheckpointHook
    trainer.hooks.sort(key=lambda hook: isinstance(hook, CheckpointHook))
    return trainer.run()
