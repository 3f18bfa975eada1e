"""Loop hooks: the periodic work hung on the training loop (loggers, checkpoints, Lo-Fi pushes).

A hook never sees the trainer. After every step the loop hands each hook a `StepInfo` (the
step number, the state after it, that step's metrics on logged steps, and the data iterator's
state to resume after it); anything else a hook needs (a checkpointer, shardings, config
fields) it is given when it is built. Hooks run in ascending `order` (`ORDER`; ties keep the
order they were added), which is explicit rather than inferred from their classes.

A hook defines `after_step(info)` (may return a replacement state, e.g. after loading a Lo-Fi
average; the hooks after it then see that state) and `at_end(info)`, and optionally
`on_metrics(info)` (logged steps: `info.metrics` is what metrics.jsonl gets) and
`at_preemption(info)` (instead of `at_end` when the run stops for a pre-emption; returns
whether it saved the state).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.train.state import TrainState

if TYPE_CHECKING:  # not at run time: orbax is imported only by runs that checkpoint
    from jaxscale.observe.events import EventLog
    from jaxscale.train.checkpoint import Checkpointer

# When each kind of hook runs (ascending). Checkpoints last: they save what the run continues
# with (after a Lo-Fi sync), or a run resumed from a sync step's checkpoint would miss that
# step's average. A hook without an `order` attribute runs at ORDER["default"].
ORDER = {"logger": 0, "default": 100, "lofi": 200, "checkpoint": 300, "goodput": 400}


@dataclass(frozen=True)
class StepInfo:
    """What a hook is told about the step just taken."""

    step: int                               # host-side step number (1 after the first step)
    state: TrainState                       # the state after that step
    metrics: Mapping[str, Any] | None = None  # host metrics on logged steps, else None
    data_state: dict | None = None          # the data iterator's state to resume after `step`


class Hook(Protocol):
    """Periodic work after the steps (see the module docstring for the optional methods)."""

    def after_step(self, info: StepInfo) -> TrainState | None:
        """Called after every step."""

    def at_end(self, info: StepInfo) -> None:
        """Called once after the last step."""


def order_of(hook: Any) -> int:
    return getattr(hook, "order", ORDER["default"])


def in_order(hooks: list[Any]) -> list[Any]:
    """`hooks` sorted by `order` (stable: equal orders keep the order they were added)."""
    return sorted(hooks, key=order_of)


class NonFiniteError(JaxscaleError):
    """Training produced a non-finite loss or gradient norm."""


def check_finite(state: TrainState, skip_nonfinite: bool) -> None:
    """Raises if any step so far was non-finite (unless such steps are skipped)."""
    first = int(jax.device_get(state.extra["first_nonfinite"]))
    if first >= 0 and not skip_nonfinite:
        raise NonFiniteError(paragraph(
            f"Non-finite loss or gradient norm at step {first}. Training stopped",
            "before saving anything from that step; the last good checkpoint was kept. Lower",
            "optim.lr, use a float32 / bf16-mixed precision policy, or set",
            "config.train.skip_nonfinite=True to skip such updates and count them.",
        ))


class Interval:
    """When a tier saves: every `every` steps (0: never) or after `every_minutes` minutes of
    training (0: never), whichever comes first; the timer starts at the first step (compiling
    and restoring are not training) and restarts at every save. `clock` (seconds;
    `time.monotonic`) is injectable so that tests decide the elapsed time. Every host must save
    at the same step, and hosts' clocks differ, so with several processes process 0's decision
    is broadcast to all at every step (one scalar); a single process decides alone."""

    def __init__(self, every: int, every_minutes: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.every, self.every_minutes, self.clock = every, every_minutes, clock
        self._last: float | None = None  # the clock at the last save (or the first step)

    def due(self, step: int) -> bool:
        due = bool(self.every and step % self.every == 0)
        if self.every_minutes:
            now = self.clock()
            if self._last is None:
                self._last = now
            due = _agreed(due or now - self._last >= 60.0 * self.every_minutes)
            if due:
                self._last = now
        return due


class CheckpointHook:
    """Saves every `checkpointer.every` steps and after every `every_minutes` minutes of
    training, at the end and at a pre-emption, after checking finiteness (good checkpoints are
    never overwritten with NaNs). `adapters_only` (LoRA with `lora.save_adapters_only`): the
    frozen base is saved as its fingerprint only.

    When: `Interval` (`interval.clock` is the timer's clock)."""

    order = ORDER["checkpoint"]

    def __init__(self, checkpointer: Checkpointer, skip_nonfinite: bool = False,
                 adapters_only: bool = False, every_minutes: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, events: EventLog | None = None):
        self.checkpointer = checkpointer
        self.skip_nonfinite = skip_nonfinite
        self.adapters_only = adapters_only
        self.interval = Interval(checkpointer.every if checkpointer else 0, every_minutes,
                                 clock)
        self.events = events  # the run's event log (`jaxscale goodput`): each save, timed

    def _save(self, info: StepInfo) -> None:
        check_finite(info.state, self.skip_nonfinite)
        began = time.monotonic()
        self.checkpointer.save(info.step, info.state, info.data_state, self.adapters_only)
        self._record(info.step, began)

    def _record(self, step: int, began: float) -> None:
        """The save in the event log: the seconds the loop was held (an async save's commit
        continues in the background and is waited for by the next save)."""
        if self.events is not None:
            self.events.timed("save", time.monotonic() - began, step=step, tier="persistent")

    def after_step(self, info: StepInfo) -> None:
        if self.interval.due(info.step):
            self._save(info)

    def at_end(self, info: StepInfo) -> None:
        self._finish(info, save=bool(self.interval.every or self.interval.every_minutes))

    def at_preemption(self, info: StepInfo) -> bool:
        """Saves at `info.step` (every host calls this at the same step) unless the periodic
        save just did, and waits until the write is complete: the process exits next."""
        self._finish(info, save=True)
        return True

    def _finish(self, info: StepInfo, save: bool) -> None:
        """Saves `info.step` if asked (and not saved yet), waits until the last save is
        committed (redoing one an outage failed, from `info.state`), and closes."""
        fresh = save and self.checkpointer.latest_step() != info.step
        if fresh:
            check_finite(info.state, self.skip_nonfinite)
        began = time.monotonic()
        self.checkpointer.finish(info.step, info.state, info.data_state, self.adapters_only,
                                 save)
        if fresh:
            self._record(info.step, began)


def _agreed(decision: bool) -> bool:
    """Process 0's `decision`, on every process (a time-based save must happen at the same step
    on all hosts); the local decision when there is one process."""
    if jax.process_count() == 1:
        return decision
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.int32(decision)))
