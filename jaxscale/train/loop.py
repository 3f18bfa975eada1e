"""The training loop: build everything from the config, run steps, call hooks, log metrics.

`Trainer.build(config, workdir)` performs the visible set-up (mesh, rules, policy, model
definition, optimizer, sharded state, jitted steps, data); `prepare` checks the config
(`check_run`), takes the workdir's lock (`train.workdir_lock`, released when `run` ends)
before the build, and adds the resume and the checkpoint hooks (`train.resume`) and the
workdir's config.json; `Trainer.run()` compiles the train step ahead of time (timed as
`compile_s`), then loops. Periodic work (checkpoints, Lo-Fi pushes, loggers) are hooks
(`jaxscale.train.hooks`): each receives a `StepInfo` after every step, in their explicit
`order`, and may return a replacement state (e.g. after loading an average). Loggers
(`jaxscale.observe.loggers`, named by `config.train.loggers`) are hooks too: on logged steps
every hook with an `on_metrics` method receives the step's metrics. A profiler trace
(`config.train.profile`) and pre-emption (SIGTERM: save at the same step on every host, then
raise `Preempted`) hang off the same loop. Only process 0 logs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import ml_collections as mlc
import numpy as np

from jaxscale import config as config_lib
from jaxscale.data.registry import build_data
from jaxscale.errors import ConfigError, paragraph
from jaxscale.hardware import peak_flops_source
from jaxscale.mesh import make_mesh, mesh_summary
from jaxscale.observe.events import EventLog, GoodputHook
from jaxscale.observe.loggers import Logger, make_loggers
from jaxscale.observe.metrics import model_flops_per_token
from jaxscale.observe.profiling import Profiler
from jaxscale.observe.progress import ProgressBar
from jaxscale.observe.throughput import Stopwatch, Throughput
from jaxscale.runtime.preemption import Preempted, PreemptionWatch
from jaxscale.storage import locations
from jaxscale.storage.diskfull import DiskFullError, file_full_error, is_disk_full
from jaxscale.train.build import batch_spec, build_step
from jaxscale.train.heldout import HeldOut
from jaxscale.train.hooks import CheckpointHook, Hook, StepInfo, check_finite, in_order
from jaxscale.train.reference import set_reference
from jaxscale.train.resume import attach_checkpoints
from jaxscale.train.resume_config import check_resumed_model
from jaxscale.train.state import TrainState
from jaxscale.train.step import StepContext, global_batch, jit_train_step
from jaxscale.train.workdir_lock import WorkdirLock, hold
from jaxscale.weights.init_from import load_params
from jaxscale.weights.resolve import resolve
from jaxscale.weights.tree import merge_trees


@dataclass
class Trainer:
    config: mlc.ConfigDict
    workdir: str
    ctx: StepContext
    state: TrainState
    shardings: TrainState
    train_fn: Any
    heldout: HeldOut
    batches: Any
    eval_data: list[dict[str, np.ndarray]]
    hooks: list[Hook] = field(default_factory=list)
    data_state: dict | None = None
    # WORKDIR/events.jsonl (`jaxscale goodput`); `prepare` enables it for a workdir.
    events: EventLog = field(default_factory=lambda: EventLog(None))
    # The workdir's lock (`prepare` takes it), released when `run` ends, however it ends.
    lock: WorkdirLock = field(default_factory=lambda: WorkdirLock(None))

    @classmethod
    def build(cls, config: mlc.ConfigDict, workdir: str,
              devices: Sequence[Any] | None = None, checked: bool = False) -> "Trainer":
        """The run's parts, from the config (`checked`: `check_run` has passed already)."""
        if not checked:
            check_run(config, workdir)
        mesh = make_mesh(config.mesh, devices)
        setup = build_step(config, mesh)
        ctx = setup.ctx
        loaded = (load_params(config.init_from, *setup.abstract_state(), config.model)
                  if config.init_from else None)
        state, shardings = setup.init_state(config.seed, loaded)
        state = set_reference(config, state, shardings)  # before any checkpoint is restored
        lofi = config.lofi
        shard = (lofi.worker_id, lofi.num_workers) if lofi.enabled else (0, 1)
        batches, evals = build_data(config, jax.process_index(), jax.process_count(), *shard)
        # A run that never evaluates (train.eval_every=0) may have no held-out batch: the
        # shapes then come from the batch the config describes.
        template = evals[0] if evals else batch_spec(config)
        shapes = {k: (config.data.batch_size,) + v.shape[1:] for k, v in template.items()}
        train_fn = jit_train_step(ctx, shardings, shapes)
        heldout = HeldOut(ctx.model_def, ctx.rules, ctx.mesh, ctx.objective,
                          None if ctx.reference is None else ctx.reference.model_def)
        return cls(config, workdir, ctx, state, shardings, train_fn, heldout, batches, evals)

    @property
    def is_primary(self) -> bool:
        return jax.process_index() == 0

    def to_global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Assembles the global batch from this host's rows."""
        return global_batch(local, self.ctx.rules, self.ctx.mesh, self.config.data.batch_size)

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """The held-out metrics of `state` on the run's held-out batches: those of `jaxscale
        evaluate` (`HeldOut`), logged as `eval_loss`, `eval_accuracy` (and `eval_perplexity`),
        or a preference objective's `eval_reward_accuracy`, ... A batch source with held-out
        metrics of its own (`evaluate(state)`: a grpo run's rollouts, whose held-out prompts
        are decoded, not scored as rows) gives them instead, all of them logged."""
        if self._own_eval is not None:
            return self._own_eval(state)
        params = merge_trees(state.params, state.frozen) if state.frozen else state.params
        reference = self.ctx.bound_reference(state)
        return self.heldout.metrics(params, map(self.to_global, self.eval_data),
                                    None if reference is None else reference[1])

    @property
    def _own_eval(self) -> Any:
        return getattr(self.batches, "evaluate", None)

    def flops_per_token(self) -> float | None:
        return model_flops_per_token(self.config.model, self.config.data.seq_len)

    def run(self) -> TrainState:
        """Trains to `config.train.steps` from the state's step; raises `Preempted` after
        saving when the run is pre-empted (SIGTERM)."""
        try:
            return self._run()
        finally:
            self.lock.release()

    def _run(self) -> TrainState:
        cfg, state = self.config.train, self.state
        start = int(jax.device_get(state.step))
        it = self.batches.iterator(self.data_state)
        hooks = in_order([*make_loggers(self, start), *self.hooks,
                          GoodputHook(self.events, cfg.log_every, cfg.steps)])
        bar = ProgressBar(cfg.steps, initial=start, enabled=self.is_primary)
        meter = Throughput(self.config.data.batch_size * self.config.data.seq_len,
                           self.flops_per_token(), jax.device_count(),
                           jax.devices()[0].device_kind)
        profiler = Profiler(cfg.profile, self.workdir, jax.process_index())
        self._banner(start, meter)
        follow = getattr(self.batches, "follow", None)  # rollouts sample with the weights now
        if follow is not None:
            follow(state)
        batch = self.to_global(next(it)) if start < cfg.steps else None
        if batch is not None:
            meter.compiled(self._compile(state, batch))
            self.events.record("compile", seconds=round(meter.compile_s, 6))
        self.events.loop_started()
        try:
            state = self._steps(start, state, batch, it, hooks, bar, meter, profiler, follow)
            end = StepInfo(int(jax.device_get(state.step)), state, data_state=self.data_state)
            for hook in hooks:
                hook.at_end(end)
        except (DiskFullError, OSError) as e:
            if not (isinstance(e, DiskFullError) or is_disk_full(e)):
                raise
            _stop_for_full_disk(hooks, self.events, e, self.workdir)
        bar.close()
        self.state = state
        return state

    def _steps(self, start: int, state: TrainState, batch: Any, it: Any, hooks: list[Any],
               bar: ProgressBar, meter: Throughput, profiler: Profiler, follow: Any
               ) -> TrainState:
        """The step loop of `run`, from `start` + 1 to `config.train.steps`: the state trained."""
        cfg = self.config.train
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
                            self.events.record("first_step", step=step,
                                               seconds=round(timer.elapsed(), 6))
                    batch = None
                    info = StepInfo(step, state, data_state=self.data_state)
                    if step % cfg.log_every == 0 or step == cfg.steps:
                        info = self._log(info, metrics, meter, hooks, bar)
                    if profiler.after_step(step, metrics):  # writing the trace is not a step
                        meter.restart(step)
                    state = _after_step(hooks, info)
                    if follow is not None:
                        follow(state)
                    if preemption.reached(step):
                        self._stop_for_preemption(hooks, replace(info, state=state), bar,
                                                 preemption.signum)
        finally:
            profiler.stop()
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

    def _log(self, info: StepInfo, metrics: dict, meter: Throughput, hooks: Sequence[Any],
             bar: ProgressBar) -> StepInfo:
        """`info` with the step's host metrics, after handing them to the hooks."""
        step, state, cfg = info.step, info.state, self.config.train
        host = {k: float(v) for k, v in jax.device_get(metrics).items()}
        check_finite(state, cfg.skip_nonfinite)
        if self.ctx.loss_scale is not None:
            self.ctx.loss_scale.check(state.extra)
        host.update(meter.window(step))
        if skipped := getattr(self.batches, "skipped_records", 0):  # data.skip_bad_records
            host["skipped_records"] = skipped
        if hasattr(self.batches, "metrics"):  # a rollout source's rewards and time split
            host.update(self.batches.metrics())
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            held = self.evaluate(state)
            reported = held if self._own_eval is not None else self.heldout.reported
            host.update({f"eval_{k}": held[k] for k in reported if k in held})
        info = replace(info, metrics=host)
        for hook in hooks:
            if hasattr(hook, "on_metrics"):
                hook.on_metrics(info)
        bar.update(step, host)
        meter.restart(step)
        return info

    def _stop_for_preemption(self, hooks: Sequence[Any], info: StepInfo,
                             bar: ProgressBar, signum: int) -> None:
        saved = False
        for hook in hooks:
            if hasattr(hook, "at_preemption"):
                saved = bool(hook.at_preemption(info)) or saved
        bar.close()
        self.state = info.state
        raise Preempted(info.step, saved, signum)


def _stop_for_full_disk(hooks: Sequence[Any], events: EventLog, error: Exception,
                        workdir: str) -> None:
    """Ends a run whose workdir filled up, whichever write met it first, in one paragraph.

    The checkpoint whose background commit filled the disk reports that only at the next save,
    so under load metrics.jsonl, events.jsonl or TensorBoard (whose writer thread and exit hook
    then printed tracebacks) used to meet the full disk first and end the run in a raw OSError,
    its unfinished step left behind. Here the save in flight is waited for first: its own
    paragraph wins if it failed for the disk, and its unfinished step is removed either way,
    which frees space for the loggers to close (their buffered lines completed, the TensorBoard
    writer stopped). Then `error` (a `DiskFullError`, or a raw ENOSPC named here) is raised."""
    try:
        for hook in hooks:
            if isinstance(hook, CheckpointHook):
                hook.checkpointer.stop_for_full_disk()
    finally:
        for closing in [*(h.close for h in hooks if isinstance(h, Logger)), events.close]:
            try:
                closing()
            except (OSError, DiskFullError):  # still full: what is buffered is lost, no more
                pass
    if isinstance(error, DiskFullError):
        raise error
    raise file_full_error(getattr(error, "filename", None) or workdir) from None


def _after_step(hooks: Sequence[Any], info: StepInfo) -> TrainState:
    """Calls each hook's `after_step` in order; a returned state replaces the state the hooks
    after it see (and the run continues with)."""
    for hook in hooks:
        new = hook.after_step(info)
        if new is not None:
            info = replace(info, state=new)
    return info.state


def check_run(config: mlc.ConfigDict, workdir: str) -> None:
    """The checks of a run's config and workdir that load and allocate nothing (and write
    nothing): a bad config or workdir is refused in seconds, before the workdir's lock."""
    resolve(config)  # a stand-in model becomes init_from's (the CLI passes its flags)
    config_lib.validate(config)
    locations.configure(config.get("storage"))  # S3 endpoint/region for every location
    if workdir:  # a bad scheme, dead endpoint, missing bucket or refused key: one paragraph
        locations.check(workdir)
        config_lib.check_workdir_path(workdir)
        check_resumed_model(config, workdir)  # a resume trains the model its checkpoints hold


def prepare(config: mlc.ConfigDict, workdir: str, hooks: Sequence[Hook] = (),
            devices: Sequence[Any] | None = None) -> Trainer:
    """The run `train` runs, built and not yet started: resumed from the newest complete
    checkpoint in `workdir` (whose config.json it then records), with its hooks. A Lo-Fi
    worker (`jaxscale.lofi.worker.train_worker`) adds its own hook to it before running it."""
    began = time.time()
    check_run(config, workdir)
    # The lock before the build: a second run on a workdir in use is refused before it loads
    # weights or takes device memory. A build that fails leaves a workdir it created unmade.
    lock = hold(workdir)
    try:
        trainer = Trainer.build(config, workdir, devices, checked=True)
    except BaseException:
        lock.abandon()
        raise
    trainer.lock = lock
    try:
        # The event log of `jaxscale goodput`: this process's start, from before the build.
        trainer.events = EventLog(workdir, enabled=trainer.is_primary)
        trainer.events.record("start", at=began, processes=jax.process_count(),
                              devices=jax.device_count())
        if workdir:  # with checkpoint.every=0 still: a pre-empted run saves, and resumes
            attach_checkpoints(trainer)
            if _check_steps_ahead(trainer) and trainer.is_primary:  # once all is accepted
                config_lib.save_config(config, workdir)
    except BaseException:
        lock.release()
        raise
    trainer.hooks.extend(hooks)
    return trainer


def _check_steps_ahead(trainer: Trainer) -> bool:
    """Whether the run has steps to train. A resumed run whose `train.steps` is at or below
    the step it resumed at trains nothing: below it is refused (the flag most likely meant
    something else), at it one line says so (and config.json keeps what the steps ran with)."""
    start, steps = int(jax.device_get(trainer.state.step)), trainer.config.train.steps
    if steps < start:
        raise ConfigError(paragraph(
            f"train.steps={steps}, but {trainer.workdir} resumed at step {start}, so nothing",
            f"would be trained. Give train.steps above {start} to continue (e.g.",
            f"--config.train.steps={start + steps}), or a new --workdir to train from scratch.",
            "config.json and the checkpoints are as they were.",
        ))
    if steps == start and trainer.is_primary:
        print(f"jaxscale: {trainer.workdir} is already at step {start} = train.steps; nothing "
              f"to train (a larger --config.train.steps continues it)", flush=True)
    return steps > start


def train(config: mlc.ConfigDict, workdir: str, hooks: Sequence[Hook] = ()) -> TrainState:
    """Trains `config` in `workdir` (resuming from its newest checkpoint) and returns the final
    state; the hooks run in their `order` (train.hooks.ORDER)."""
    if config.lofi.enabled:
        raise ConfigError(paragraph(
            "config.lofi.enabled=True: a Lo-Fi worker also pushes to and loads from its store,",
            "which `train` does not do. Run it with `jaxscale.lofi.worker.train_worker(config,",
            "workdir)` (what `launch.train` calls for such a config), or set",
            "lofi.enabled=False."))
    return prepare(config, workdir, hooks).run()
