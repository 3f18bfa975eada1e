"""The terminal progress line of a run: a tqdm bar on a TTY, a plain line every N steps in logs."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

# A console warning once the MoE capacity buffers drop more than this share of the token ->
# expert assignments (`moe_dropped`): the run trains, but most tokens skip their experts.
DROPPED_WARN = 0.10


def dropped_warning(step: int, dropped: float) -> str:
    """The one-line warning of a step whose MoE buffers dropped `dropped` of the assignments."""
    return (f"jaxscale: warning: step {step} dropped {dropped:.0%} of the MoE token -> expert "
            f"assignments (moe_dropped > {DROPPED_WARN:.0%}): model.moe.capacity_factor is too "
            "small for this routing, so those tokens skip their experts. Raise it (1.25-2 is "
            "common) or set 0 for dropless experts. (Shown once; moe_dropped is in "
            "metrics.jsonl.)")


class ProgressBar:
    """A tqdm bar on a terminal; without a TTY (CI logs) a plain line every `print_every` steps.

    Shows step/total, loss, tokens/s, a preference objective's reward accuracy (`acc`, the
    share of pairs whose chosen response the model rewards above the rejected one), an RL
    run's mean reward and KL (`reward`, `kl`), an MoE
    model's expert load (busiest/idlest expert relative to a balanced load, `load=1.40/0.60`)
    and the latest eval loss (and eval reward accuracy, or an RL run's held-out reward
    `eval_reward`) once one is known.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True,
                 print_every: int | None = None, stream: TextIO | None = None):
        self.enabled, self.total = enabled, total
        self._stream = stream or sys.stdout
        self._bar: Any = None
        self._last = initial
        self._printed = initial
        self._print_every = print_every or max(1, total // 20)
        self._eval_loss: float | None = None
        self._eval_accuracy: float | None = None
        self._eval_reward: float | None = None
        self._start = time.perf_counter()
        self._warned_dropped = False
        if enabled and self._stream.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                             file=self._stream)

    def _fields(self, metrics: Mapping[str, Any]) -> dict[str, str]:
        shown = {}
        if metrics.get("loss") is not None:
            shown["loss"] = f"{float(metrics['loss']):.4f}"
        if metrics.get("reward_accuracy") is not None:
            shown["acc"] = f"{float(metrics['reward_accuracy']):.2f}"
        if metrics.get("reward_mean") is not None:  # an RL run's rollouts (and its KL)
            shown["reward"] = f"{float(metrics['reward_mean']):.3f}"
        if metrics.get("kl") is not None:
            shown["kl"] = f"{float(metrics['kl']):.4f}"
        if metrics.get("tokens_per_s") is not None:
            shown["tok/s"] = f"{float(metrics['tokens_per_s']):,.0f}"
        if metrics.get("moe_load_max") is not None:  # MoE: busiest / idlest expert vs balanced
            shown["load"] = (f"{float(metrics['moe_load_max']):.2f}/"
                             f"{float(metrics['moe_load_min']):.2f}")
        if metrics.get("eval_loss") is not None:
            self._eval_loss = float(metrics["eval_loss"])
        if self._eval_loss is not None:
            shown["eval"] = f"{self._eval_loss:.4f}"
        if metrics.get("eval_reward_accuracy") is not None:
            self._eval_accuracy = float(metrics["eval_reward_accuracy"])
        if self._eval_accuracy is not None:
            shown["eval_acc"] = f"{self._eval_accuracy:.2f}"
        if metrics.get("eval_reward_mean") is not None:  # an RL run's held-out prompts
            self._eval_reward = float(metrics["eval_reward_mean"])
        if self._eval_reward is not None:
            shown["eval_reward"] = f"{self._eval_reward:.3f}"
        return shown

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Advances to `step` (absolute, not a delta) and shows `metrics`."""
        if not self.enabled:
            return
        shown = self._fields(metrics)
        dropped = metrics.get("moe_dropped")
        if dropped is not None and float(dropped) > DROPPED_WARN and not self._warned_dropped:
            self._warned_dropped = True
            message = dropped_warning(step, float(dropped))
            if self._bar is not None:
                self._bar.write(message, file=self._stream)
            else:
                print(message, file=self._stream, flush=True)
        if self._bar is not None:
            self._bar.update(step - self._last)
            self._bar.set_postfix(shown)
        elif (step - self._printed >= self._print_every or step >= self.total
              or "eval_loss" in metrics or "eval_reward_mean" in metrics):
            elapsed = time.perf_counter() - self._start
            text = " ".join(f"{k}={v}" for k, v in shown.items())
            print(f"step {step}/{self.total} {text} ({elapsed:.0f}s)", file=self._stream,
                  flush=True)
            self._printed = step
        self._last = step

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
