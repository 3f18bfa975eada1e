"""Honest throughput: compilation and the first step timed apart from the steady-state steps.

A run's first step pays for tracing, compiling and (on accelerators) autotuning and the first
allocations; counted into the first logged window it makes tokens/s and MFU of short runs
meaningless (21.6 tokens/s at step 2, then 7,709 at step 4). So the loop compiles the train
step ahead of time and reports that as `compile_s`, times the first step on its own
(`first_step_s`, compiled already, so it is the step's own first-run cost), and `Throughput`
computes `step_time_s`, `tokens_per_s` and `mfu` only over the steps after it. A logged window
that holds no such step (the first step's own record when `train.log_every=1`) carries null
for those three rather than a number that includes the first step.
"""

from __future__ import annotations

import time

from jaxscale.observe.metrics import mfu


class Throughput:
    """Step timing by logging window, starting after the first step of this process."""

    def __init__(self, tokens_per_step: int, flops_per_token: float | None, num_devices: int,
                 device_kind: str):
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.num_devices, self.device_kind = num_devices, device_kind
        self.compile_s: float | None = None
        self.first_step_s: float | None = None
        self._once: dict[str, float] = {}  # compile_s / first_step_s, for the next record only
        self._since: float | None = None   # when the current window started (None: not yet)
        self._since_step = 0

    def compiled(self, seconds: float) -> None:
        self.compile_s = seconds
        self._once["compile_s"] = seconds

    def first_step_done(self, step: int, seconds: float) -> None:
        """The first step of this process finished (its outputs are ready): windows start."""
        self.first_step_s = seconds
        self._once["first_step_s"] = seconds
        self.restart(step)

    def restart(self, step: int) -> None:
        """The next window starts now, after `step` (evaluation and logging are left out)."""
        self._since, self._since_step = time.perf_counter(), step

    def window(self, step: int) -> dict[str, float | None]:
        """Metrics of the window ending at `step` (whose outputs must be ready), plus
        `compile_s` and `first_step_s` in the first record after they were measured."""
        steps = step - self._since_step if self._since is not None else 0
        out: dict[str, float | None] = {"step_time_s": None, "tokens_per_s": None}
        if steps > 0:
            out["step_time_s"] = (time.perf_counter() - self._since) / steps
            out["tokens_per_s"] = self.tokens_per_step / out["step_time_s"]
            util = (mfu(self.flops_per_token, out["tokens_per_s"], self.num_devices,
                        self.device_kind) if self.flops_per_token else None)
            if util is not None:
                out["mfu"] = util
        out.update(self._once)
        self._once = {}
        return out


class Stopwatch:
    """`with Stopwatch() as t: ...` then `t.seconds`."""

    def __enter__(self) -> "Stopwatch":
        self._start = time.perf_counter()
        self.seconds = 0.0
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def __exit__(self, *exc: object) -> None:
        self.seconds = self.elapsed()
