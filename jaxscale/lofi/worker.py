"""The Lo-Fi worker: an ordinary training run that pushes its weights and reloads averages.

A worker trains on its own mesh and its own data shard (`shard_index = worker_id`) with no
collective that crosses workers. This hook, hung on the training loop, pushes the weights (or an
exponential moving average of them) to the shared store every `push_every` steps or minutes, and
at sync points (`periodic` / `diloco`) waits for the averager's round and continues from the
average. `end` is pure Lo-Fi: the only exchange is the final push.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.lofi import averager as averager_lib
from jaxscale.lofi import store as store_lib
from jaxscale.train.state import TrainState, flatten, unflatten


class SyncTimeoutError(JaxscaleError):
    """No average appeared in time at a sync point."""


def parse_push_every(text: str) -> tuple[int | None, float | None]:
    """'100' -> (100 steps, None); '30m' -> (None, 1800 seconds)."""
    text = str(text)
    if text.endswith("m"):
        return None, float(text[:-1]) * 60.0
    return int(text), None


@jax.jit
def _ema_update(ema: Any, params: Any, decay: float) -> Any:
    return jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p.astype(e.dtype), ema, params)


def _host_tree(tree: Any) -> dict[str, np.ndarray]:
    """Flat {path: numpy array} gathered to this host (each worker owns its whole mesh)."""
    return {k: np.asarray(jax.device_get(v)) for k, v in flatten(tree).items()}


def place_flat(flat: dict[str, np.ndarray], shardings: Any, like: Any) -> Any:
    """Puts host arrays onto the worker's mesh with the run's shardings and dtypes."""
    flat_sh, flat_like = flatten(shardings), flatten(like)
    placed = {}
    for k, sh in flat_sh.items():
        arr = np.asarray(flat[k]).astype(flat_like[k].dtype)
        placed[k] = jax.make_array_from_callback(arr.shape, sh, lambda idx, a=arr: a[idx])
    return unflatten(placed)


@dataclass
class LofiWorker:
    """Loop hook implementing the worker side of Lo-Fi (see module docstring)."""

    lofi: Any                     # config.lofi
    total_steps: int
    batch_size: int
    ema: Any = None
    last_push_step: int = -1
    last_push_time: float = field(default_factory=time.monotonic)
    loaded_round: int = -1
    bytes_written: int = 0
    bytes_read: int = 0

    @property
    def periodic(self) -> bool:
        return self.lofi.sync in ("periodic", "diloco")

    def start(self, trainer: Any, state: TrainState) -> TrainState:
        """At launch: publish the initial weights as round 0 if nobody has, then continue from
        whichever is newest: the run's own state, its own last complete push, or the newest
        complete average (a restarted worker loses at most the steps since its last push)."""
        store = store_lib.Store(self.lofi.store)
        step = int(jax.device_get(state.step))
        if store_lib.latest_average_checkpoint(store) is None and jax.process_index() == 0:
            averager_lib.publish_initial(store, _host_tree(state.params))
        own = store_lib.worker_checkpoints(store).get(self.lofi.worker_id, [])
        latest = averager_lib.latest_average(store)
        if own and own[-1] > max(step, latest.step if latest else -1):
            ckpt = store_lib.load_checkpoint(store, store_lib.worker_prefix(self.lofi.worker_id,
                                                                             own[-1]))
            latest = averager_lib.Average(-1, own[-1], store_lib.read_params(store, ckpt))
        if latest is not None and latest.step > step:
            state = self._load(trainer, state, latest)
            state = state.replace(step=jnp.asarray(latest.step, jnp.int32))
            trainer.data_state = {"next_index": latest.step}
        if self.lofi.push_ema:
            self.ema = jax.tree.map(lambda p: p.astype(jnp.float32), state.params)
        return state

    def after_step(self, trainer: Any, state: TrainState, step: int) -> TrainState | None:
        if self.ema is not None:
            self.ema = _ema_update(self.ema, state.params, float(self.lofi.push_ema))
        every_steps, every_s = parse_push_every(self.lofi.push_every)
        due = (every_steps and step % every_steps == 0) or \
              (every_s and time.monotonic() - self.last_push_time >= every_s)
        sync = self.periodic and step % self.lofi.sync_every == 0 and step < self.total_steps
        if due or sync:
            self.push(trainer, state, step)
        if sync:
            return self._load(trainer, state, self._wait_for_round_after(step))
        return None

    def at_end(self, trainer: Any, state: TrainState) -> None:
        step = int(jax.device_get(state.step))
        if self.last_push_step != step:
            self.push(trainer, state, step)

    def push(self, trainer: Any, state: TrainState, step: int) -> None:
        if jax.process_index() != 0:
            return
        weights = self.ema if self.ema is not None else state.params
        report = store_lib.push(self.lofi.store, self.lofi.worker_id, step, _host_tree(weights),
                                samples_seen=step * self.batch_size,
                                compress=bool(self.lofi.compress))
        self.bytes_written += int(getattr(report, "bytes_written", 0) or 0)
        self.last_push_step, self.last_push_time = step, time.monotonic()

    def _wait_for_round_after(self, step: int) -> Any:
        deadline = time.monotonic() + float(self.lofi.sync_timeout_s)
        while time.monotonic() < deadline:
            latest = averager_lib.latest_average(self.lofi.store)
            if latest is not None and latest.step >= step and latest.round > self.loaded_round:
                return latest
            time.sleep(0.2)
        raise SyncTimeoutError(paragraph(
            f"Lo-Fi worker {self.lofi.worker_id} pushed step {step} and waited",
            f"{self.lofi.sync_timeout_s:.0f}s for an average covering it in {self.lofi.store},",
            "but none appeared. Is `python -m launch.lofi_average --store=... --watch` running,",
            "and are at least lofi.min_workers workers pushing? Raise lofi.sync_timeout_s for",
            "slow workers.",
        ))

    def _load(self, trainer: Any, state: TrainState, average: Any) -> TrainState:
        params = place_flat(average.params, trainer.shardings.params, state.params)
        self.bytes_read += sum(a.nbytes for a in average.params.values())
        self.loaded_round = max(self.loaded_round, average.round)
        state = state.replace(params=params)
        if self.lofi.reset_optimizer_on_sync:
            opt_state = jax.jit(trainer.ctx.optimizer.init,
                                out_shardings=trainer.shardings.opt_state)(params)
            state = state.replace(opt_state=opt_state)
        if self.ema is not None:
            self.ema = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        return state
