"""The Lo-Fi worker: an ordinary training run that pushes its weights and reloads averages.

A worker trains on its own mesh and its own data shard (`shard_index = worker_id`) with no
collective that crosses workers. This hook, hung on the training loop, pushes the weights (or an
exponential moving average of them) to the shared store every `push_every` steps or minutes, and
at sync points (`periodic` / `diloco`) waits for the averager's round and continues from the
average. `end` is pure Lo-Fi: the only exchange is the final push.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.lofi import averager as averager_lib
from jaxscale.lofi import fallback
from jaxscale.lofi import store as store_lib
from jaxscale.lofi.jobcheck import check_same_job, check_same_model
from jaxscale.lofi.trust import MAX_STEP
from jaxscale.train.hooks import ORDER, StepInfo
from jaxscale.train.state import TrainState
from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import StoreError
from jaxscale.weights.place import place
from jaxscale.weights.snapshot import (
    average_prefix,
    average_rounds,
    latest_average_snapshot,
    load_snapshot,
    read_params,
)
from jaxscale.weights.tree import flatten, unflatten

log = logging.getLogger("jaxscale.lofi")


class SyncTimeoutError(JaxscaleError):
    """No average appeared in time at a sync point."""


def parse_push_every(text: str) -> tuple[int | None, float | None]:
    """'100' -> (100 steps, None); '30m' -> (None, 1800 seconds)."""
    text = str(text)
    if text.endswith("m"):
        return None, float(text[:-1]) * 60.0
    return int(text), None


def _f32_copy(tree: Any) -> Any:
    """A float32 copy that owns its buffers: the train step donates (deletes) the params."""
    return jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), tree)


@jax.jit
def _ema_update(ema: Any, params: Any, decay: float) -> Any:
    return jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p.astype(e.dtype), ema, params)


def _host_tree(tree: Any) -> dict[str, np.ndarray]:
    """Flat {path: numpy array} gathered to this host (each worker owns its whole mesh)."""
    return {k: np.asarray(jax.device_get(v)) for k, v in flatten(tree).items()}


def export_config(config: Any) -> bytes:
    """The run's resolved config as a plain (non-Lo-Fi) run, stored once per job so the final
    export is a workdir that evaluation and conversion can rebuild the model from."""
    plain = config.to_dict()
    plain["lofi"] = {**plain["lofi"], "enabled": False}
    plain["init_from"] = ""
    return json.dumps(plain, indent=2, sort_keys=True, default=str).encode()


@dataclass
class LofiWorker:
    """Loop hook implementing the worker side of Lo-Fi (see module docstring). Built by
    `for_run` with what it needs of the run: where loaded averages are placed (`shardings`),
    a fresh optimizer state for `reset_optimizer_on_sync`, and the config recorded in the
    store."""

    order = ORDER["lofi"]         # before checkpoints: they save the average a sync loaded

    lofi: Any                     # config.lofi
    total_steps: int
    batch_size: int
    shardings: Any = None         # the run's TrainState of shardings
    init_opt_state: Callable[[Any], Any] | None = None   # params -> fresh optimizer state
    config_json: bytes = b""      # export_config(config)
    ema: Any = None
    last_push_step: int = -1
    last_push_time: float = field(default_factory=time.monotonic)
    loaded_round: int = -1
    store: Store | None = None
    raw_push_bytes: int = 0

    @classmethod
    def for_run(cls, config: Any, shardings: TrainState, optimizer: Any) -> "LofiWorker":
        init = jax.jit(optimizer.init, out_shardings=shardings.opt_state)
        return cls(config.lofi, config.train.steps, config.data.batch_size, shardings, init,
                   export_config(config))

    @property
    def periodic(self) -> bool:
        return self.lofi.sync in ("periodic", "diloco")

    @property
    def bytes_written(self) -> int:
        return self.store.bytes_written if self.store else 0

    @property
    def bytes_read(self) -> int:
        return self.store.bytes_read if self.store else 0

    def job(self) -> dict:
        """The quorum settings and sync mode recorded with round 0, the averager's defaults
        (a `diloco` job gets the outer optimizer without the averager being told)."""
        return job_of(self.lofi, self.total_steps, self.batch_size)

    def start(self, state: TrainState) -> tuple[TrainState, dict | None]:
        """At launch: publish the initial weights as round 0 if nobody has, then continue from
        whichever is newest: the run's own state, its own last complete push, or the newest
        complete average (a restarted worker loses at most the steps since its last push).
        Returns the state to continue from and, when that is an average, the data state to
        resume the data at (else None: the run's own)."""
        self.store = store = Store(self.lofi.store)
        config_json, data_state = self.config_json, None
        check_same_model(store, config_json, {k: (tuple(v.shape), str(v.dtype)) for k, v in
                                              flatten(state.params).items()}, self.lofi.worker_id)
        step = int(jax.device_get(state.step))
        if jax.process_index() == 0:
            store.write("config.json", config_json, if_absent=True)
        if latest_average_snapshot(store) is None and jax.process_index() == 0:
            averager_lib.publish_initial(store, _host_tree(state.params), job=self.job())
        own = store_lib.worker_pushes(store).get(self.lofi.worker_id, [])
        latest = averager_lib.latest_average(store)
        if latest is not None and latest.step > MAX_STEP:  # never an int32 overflow
            latest = None
        self.loaded_round = self._resumed_round(store, step, own) if step else (
            latest.round if latest else -1)
        pushed = fallback.own_push(store, self.lofi.worker_id, own,
                                   max(step, latest.step if latest else -1), self.total_steps)
        if pushed is not None:  # its own newest push that verifies, newer than the rest
            ckpt, params = pushed
            self.loaded_round = int(ckpt.manifest.get("synced_round") or 0)
            latest = averager_lib.Average(self.loaded_round, ckpt.step, params)
        if latest is not None and latest.step > step:
            self.loaded_round = latest.round
            state = self._load(state, latest)
            state = state.replace(step=jnp.asarray(latest.step, jnp.int32))
            data_state = {"next_index": latest.step}
        if self.lofi.push_ema:
            self.ema = _f32_copy(state.params)
        return state, data_state

    def _resumed_round(self, store: Store, step: int, own: list[int]) -> int:
        """The average a run's own state at `step` (resumed from its workdir) continued from.

        Periodic modes load the round covering each sync point right after pushing for it
        (before the checkpoint of that step is saved), so it is the newest round published at
        or before `step`. `end` loads none mid-run (a watching averager's rounds are not
        loaded), so it is what the newest push at or before `step` recorded."""
        if not self.periodic:
            pushes = [s for s in own if s <= step]
            try:
                push = load_snapshot(store, store_lib.worker_prefix(
                    self.lofi.worker_id, pushes[-1])) if pushes else None
            except StoreError:
                push = None
            return int(push.manifest.get("synced_round") or 0) if push else 0
        for round_ in reversed(average_rounds(store)):
            try:
                if load_snapshot(store, average_prefix(round_)).step <= step:
                    return round_
            except StoreError:
                continue
        return 0

    def push_due(self, step: int, now: float) -> bool:
        """`push_every` steps ('100': every 100th step) or minutes ('30m': the first step at
        least 30 minutes after the previous push, or after the worker started)."""
        every_steps, every_s = parse_push_every(self.lofi.push_every)
        if every_steps:
            return step % every_steps == 0
        return now - self.last_push_time >= every_s

    def after_step(self, info: StepInfo) -> TrainState | None:
        state, step = info.state, info.step
        if self.ema is not None:
            self.ema = _ema_update(self.ema, state.params, float(self.lofi.push_ema))
        sync = self.periodic and step % self.lofi.sync_every == 0 and step < self.total_steps
        if self.push_due(step, time.monotonic()) or sync:
            self.push(state, step)
        if sync:
            return self._load(state, self._wait_for_round_after(step))
        return None

    def at_end(self, info: StepInfo) -> None:
        step = info.step
        if self.last_push_step != step:
            self.push(info.state, step)
        if jax.process_index() == 0:
            self.record_io(step)

    def record_io(self, step: int) -> None:
        """Prints and stores (STORE/stats/workers/<id>.json) this worker's store traffic."""
        stats = {"worker_id": int(self.lofi.worker_id), "step": step,
                 "bytes_written": self.bytes_written, "bytes_read": self.bytes_read,
                 "raw_push_bytes": self.raw_push_bytes}
        self.store.write(f"stats/workers/{int(self.lofi.worker_id)}.json",
                         json.dumps(stats).encode())
        print(f"lofi worker {self.lofi.worker_id}: wrote {self.bytes_written / 2**20:.2f} MiB, "
              f"read {self.bytes_read / 2**20:.2f} MiB (store {self.lofi.store})", flush=True)

    def push(self, state: TrainState, step: int) -> None:
        if jax.process_index() != 0:
            return
        weights = self.ema if self.ema is not None else state.params
        report = store_lib.push(self.store, self.lofi.worker_id, step, _host_tree(weights),
                                samples_seen=step * self.batch_size,
                                compress=bool(self.lofi.compress),
                                synced_round=self.loaded_round)
        self.raw_push_bytes += 0 if report.skipped else report.raw_bytes
        self.last_push_step, self.last_push_time = step, time.monotonic()

    def _wait_for_round_after(self, step: int) -> Any:
        deadline = time.monotonic() + float(self.lofi.sync_timeout_s)
        damaged: set[int] = set()  # rounds that did not verify: the averager replaces them
        while time.monotonic() < deadline:
            ckpt = latest_average_snapshot(self.store)
            round_ = int(ckpt.manifest["round"]) if ckpt is not None else -1
            if (ckpt is not None and ckpt.step >= step and round_ > self.loaded_round
                    and round_ not in damaged):
                try:
                    return averager_lib.Average(round_, ckpt.step,
                                                read_params(self.store, ckpt))
                except StoreError as e:
                    damaged.add(round_)
                    log.warning("average/%d does not verify (%s); waiting for the averager to "
                                "publish the next round in its place", round_, e)
            time.sleep(0.2)
        raise SyncTimeoutError(paragraph(
            f"Lo-Fi worker {self.lofi.worker_id} pushed step {step} and waited",
            f"{self.lofi.sync_timeout_s:.0f}s for an average covering it in {self.lofi.store},",
            "but none appeared. Is `jaxscale lofi-average --store=... --watch` running,",
            "and are at least lofi.min_workers workers pushing? Raise lofi.sync_timeout_s for",
            "slow workers.",
        ))

    def _load(self, state: TrainState, average: Any) -> TrainState:
        params = unflatten(place(average.params, flatten(self.shardings.params),
                                 flatten(state.params)))
        self.loaded_round = max(self.loaded_round, average.round)
        state = state.replace(params=params)
        if self.lofi.reset_optimizer_on_sync:
            state = state.replace(opt_state=self.init_opt_state(params))
        if self.ema is not None:
            self.ema = _f32_copy(params)
        return state


def job_of(lofi: Any, total_steps: int, batch_size: int) -> dict:
    """The job settings recorded with round 0: the quorum, the sync mode, the steps and the
    batch (what the averager judges pushes by)."""
    allowed = averager_lib.parse_allowed(lofi.allowed_workers, lofi.num_workers)
    return {"allowed_workers": list(allowed), "min_workers": int(lofi.min_workers),
            "max_staleness": int(lofi.max_staleness), "sync": str(lofi.sync),
            "total_steps": int(total_steps), "batch_size": int(batch_size)}


def train_worker(config: Any, workdir: str, hooks: Sequence[Any] = ()) -> TrainState:
    """Trains one Lo-Fi worker: the run `train.loop.train` would (resumed from its own newest
    checkpoint), continued from the newest average or its own newer push, with the worker's
    hook pushing and loading on schedule. Returns the final state."""
    from jaxscale.storage import locations
    from jaxscale.train.loop import prepare

    locations.configure(config.get("storage"))  # the store may be on S3
    store_lib.claim_store(config.lofi.store, "--config.lofi.store")  # never a training workdir
    check_same_job(Store(config.lofi.store), job_of(config.lofi, config.train.steps,
                                                    config.data.batch_size),
                   config.lofi.worker_id)  # before its workdir records anything
    trainer = prepare(config, workdir, hooks)
    try:
        worker = LofiWorker.for_run(config, trainer.shardings, trainer.ctx.optimizer)
        trainer.state, data_state = worker.start(trainer.state)
    except BaseException:
        trainer.lock.release()  # `run` would have at its end
        raise
    trainer.data_state = data_state or trainer.data_state
    trainer.hooks.append(worker)
    return trainer.run()  # the hooks run in their `order` (train.hooks.ORDER)
