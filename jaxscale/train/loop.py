"""The training loop: build everything from the config, run steps, call hooks, log metrics.

`Trainer.build(config, workdir)` performs the visible set-up (mesh, rules, policy, model
definition, optimizer, sharded state, jitted steps, data); `Trainer.run()` compiles the train
step ahead of time (timed as `compile_s`), then loops. Periodic work (evaluation, checkpoints,
Lo-Fi pushes) are `Hook`s called after each step; a hook may return a replacement state (e.g.
after loading an average). Loggers (`jaxscale.observe.loggers`, named by `config.train.loggers`) are
hooks too: on logged steps every hook with an `on_metrics` method receives the step's metrics.
A profiler trace (`config.train.profile`) and pre-emption (SIGTERM: save at the same step on
every host, then raise `Preempted`) hang off the same loop. Only process 0 logs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import ml_collections as mlc
import numpy as np

from jaxscale import config as config_lib
from jaxscale.storage import locations
from jaxscale.data.registry import build_data
from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.mesh import make_mesh, mesh_summary
from jaxscale.observe.loggers import make_loggers
from jaxscale.hardware import peak_flops_source
from jaxscale.observe.metrics import model_flops_per_token
from jaxscale.observe.progress import ProgressBar
from jaxscale.models import lora
from jaxscale.runtime.preemption import Preempted, PreemptionWatch
from jaxscale.observe.profiling import Profiler
from jaxscale.train.build import build_step
from jaxscale.train.state import TrainState, init_state
from jaxscale.observe.throughput import Stopwatch, Throughput
from jaxscale.weights.tree import flatten, unflatten
from jaxscale.train.step import StepContext, batch_sharding, jit_steps


class Hook(Protocol):
    """Periodic work around the steps. Besides these two methods a hook may define
    `on_metrics(trainer, step, metrics)`, called on logged steps with that step's metrics (what
    metrics.jsonl gets), and `at_preemption(trainer, state, step)`, called instead of `at_end`
    when the run stops for a pre-emption (the checkpoint hook saves there)."""

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
        locations.configure(config.get("storage"))  # S3 endpoint/region for every location
        if workdir:  # a bad scheme, dead endpoint, missing bucket or refused key: one paragraph
            locations.check(workdir)
        if workdir and jax.process_index() == 0:
            config_lib.save_config(config, workdir)
        mesh = make_mesh(config.mesh, devices)
        setup = build_step(config, mesh)
        ctx = setup.ctx
        state, shardings = init_state(ctx.model_def, ctx.optimizer, ctx.rules, mesh,
                                      config.seed, setup.trainable, setup.init_extra)
        if config.init_from:
            state = _init_from(config.init_from, state, shardings, config.model)
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
        return model_flops_per_token(self.config.model, self.config.data.seq_len)

    def run(self) -> TrainState:
        """Trains to `config.train.steps` from the state's step; raises `Preempted` after
        saving when the run is pre-empted (SIGTERM)."""
        cfg, state = self.config.train, self.state
        start = int(jax.device_get(state.step))
        it = self.batches.iterator(self.data_state)
        hooks = [*make_loggers(self, start), *self.hooks]
        bar = ProgressBar(cfg.steps, initial=start, enabled=self.is_primary)
        meter = Throughput(self.config.data.batch_size * self.config.data.seq_len,
                           self.flops_per_token(), jax.device_count(),
                           jax.devices()[0].device_kind)
        profiler = Profiler(cfg.profile, self.workdir, jax.process_index())
        self._banner(start, meter)
        batch = self.to_global(next(it)) if start < cfg.steps else None
        if batch is not None:
            meter.compiled(self._compile(state, batch))
        try:
            with PreemptionWatch() as preemption:
                for step in range(start + 1, cfg.steps + 1):
                    batch = self.to_global(next(it)) if batch is None else batch
                    self.data_state = it.get_state()
                    profiler.before_step(step)
                    with Stopwatch() as timer:
                        state, metrics = self.train_fn(state, batch)
                        if step == start + 1:  # timed to completion, apart from the rest
                            jax.block_until_ready(metrics)
                            meter.first_step_done(step, timer.elapsed())
                    batch = None
                    if step % cfg.log_every == 0 or step == cfg.steps:
                        self._log(step, state, metrics, meter, hooks, bar)
                    if profiler.after_step(step, metrics):  # writing the trace is not a step
                        meter.restart(step)
                    for hook in self.hooks:
                        state = hook.after_step(self, state, step) or state
                    if preemption.reached(step):
                        self._stop_for_preemption(hooks, state, step, bar)
        finally:
            profiler.stop()
        for hook in hooks:
            hook.at_end(self, state)
        bar.close()
        self.state = state
        return state

    def _banner(self, start: int, meter: Throughput) -> None:
        if self.is_primary:
            print(f"jaxscale: mesh {mesh_summary(self.ctx.mesh)}, "
                  f"{self.ctx.model_def.num_params():,} parameters, "
                  f"steps {start}->{self.config.train.steps}", flush=True)
            source = peak_flops_source(meter.device_kind)
            if source and meter.flops_per_token:
                print(f"jaxscale: MFU against the peak of {source}", flush=True)

    def _compile(self, state: TrainState, batch: dict[str, jax.Array]) -> float:
        """Compiles the train step ahead of time; jit's cache then serves the first call."""
        with Stopwatch() as t:
            self.train_fn.lower(state, batch).compile()
        if self.is_primary:
            print(f"jaxscale: compiled the train step in {t.seconds:.1f}s (compile_s in "
                  "metrics.jsonl; tokens/s, step time and MFU leave it and the first step out)",
                  flush=True)
        return t.seconds

    def _log(self, step: int, state: TrainState, metrics: dict, meter: Throughput,
             hooks: Sequence[Any], bar: ProgressBar) -> None:
        host = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.check_finite(state)
        if self.ctx.loss_scale is not None:
            self.ctx.loss_scale.check(state.extra)
        host.update(meter.window(step))
        cfg = self.config.train
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            host["eval_loss"] = self.evaluate(state)
        for hook in hooks:
            if hasattr(hook, "on_metrics"):
                hook.on_metrics(self, step, host)
        bar.update(step, host)
        meter.restart(step)

    def _stop_for_preemption(self, hooks: Sequence[Any], state: TrainState, step: int,
                             bar: ProgressBar) -> None:
        saved = False
        for hook in hooks:
            if hasattr(hook, "at_preemption"):
                saved = bool(hook.at_preemption(self, state, step)) or saved
        bar.close()
        self.state = state
        raise Preempted(step, saved)

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

    Leaves are read and placed one at a time (`weights.sources.open_weights` +
    `weights.place`), so a converted model never sits whole on the host.
    """
    from jaxscale.weights.init_from import InitFromError, check_matches, check_model_config
    from jaxscale.weights.place import place
    from jaxscale.weights.sources import WeightsError, open_weights

    check_model_config(path, model_cfg)
    try:
        leaves = open_weights(path).leaves
    except WeightsError as e:
        raise InitFromError(f"config.init_from: {e}") from None
    if state.frozen:  # LoRA: the saved weights are the frozen base; adapters start fresh
        leaves = {k: v for k, v in leaves.items() if not lora.is_adapter(k)}
        check_matches({k: v.shape for k, v in leaves.items()}, flatten(state.frozen), path,
                      model_cfg)
        placed = place(leaves, flatten(shardings.frozen), flatten(state.frozen))
        return state.replace(frozen=unflatten(placed))
    check_matches({k: v.shape for k, v in leaves.items()}, flatten(state.params), path,
                  model_cfg)
    placed = place(leaves, flatten(shardings.params), flatten(state.params))
    return state.replace(params=unflatten(placed))


def _attach_checkpoints(trainer: Trainer) -> None:
    """Resumes from the newest complete checkpoint in the workdir and saves periodically
    (every `checkpoint.every` steps; 0: only when pre-empted)."""
    from jaxscale.checkpoint import CheckpointHook, Checkpointer

    c = trainer.config.checkpoint
    checkpointer = Checkpointer(trainer.workdir, c.every, c.keep)
    if checkpointer.latest_step() is not None:
        trainer.state, trainer.data_state = checkpointer.restore(trainer.state, trainer.shardings)
        if trainer.is_primary:  # the newest step that restored (a broken newer one is skipped)
            step = int(jax.device_get(trainer.state.step))
            print(f"jaxscale: resumed from {checkpointer.directory}/{step}")
    trainer.hooks.append(CheckpointHook(checkpointer))


def train(config: mlc.ConfigDict, workdir: str, hooks: Sequence[Hook] = ()) -> TrainState:
    trainer = Trainer.build(config, workdir)
    if workdir:  # with checkpoint.every=0 still: a pre-empted run saves, and resumes from that
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
