"""What an objective is (`Objective`), its settings (`config.objective`), and the `lm` objective.

An objective is what a run minimises and reports, on top of the model's task (`models/task.py`:
the model's own loss, its batch preparation, its held-out sums and, for a decoder,
`sequence_logps`): its loss of a batch, given the model and, for objectives that compare with a
frozen reference model, that model too; the metrics the step reports beside the loss; the
batch layout it trains on (what ahead-of-time compilation builds without reading data); its
held-out sums, summed over every held-out batch and turned into metrics once (`finish`), which
is the one definition of the loop's `eval_*` and `jaxscale evaluate`. The training side decides
where the reference's weights live (`jaxscale/train/reference.py`); an objective only uses the
reference model it is handed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxscale.models.runner import LayerRunner
from jaxscale.models.task import Task

Batch = Mapping[str, jax.Array]


@dataclass(frozen=True)
class Settings:
    """`config.objective`: which objective and its constants (see `jaxscale/config.py`)."""

    name: str = "lm"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    sft_weight: float = 0.0
    reference: str = "init"
    # GRPO and its variants (`objectives/grpo.py`, rollouts in `jaxscale/rl/`)
    rewards: str = ""
    num_generations: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    updates_per_rollout: int = 1
    loss_norm: str = "sequence"
    scale_rewards: str = "group"
    ratio_level: str = "token"

    @classmethod
    def from_config(cls, objective_cfg: Mapping[str, Any] | None) -> "Settings":
        """From a `config.objective` section; a config written before objectives existed (an
        older workdir's config.json) has none and trains `lm`."""
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in dict(objective_cfg or {}).items() if k in fields})


class Objective(Protocol):
    """What the step, the held-out metrics and ahead-of-time compilation ask of an objective."""

    name: str
    uses_reference: bool  # the loss runs a frozen reference model (`train/reference.py`)
    reported: tuple[str, ...]  # held-out metrics the loop logs as `eval_<name>`

    def loss(self, model: Any, reference: Any, batch: Batch, run_layers: LayerRunner | None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(scalar loss, step metrics) of `batch` (the step's part of it: a microbatch, a data
        replica's rows); `reference` is None unless `uses_reference`."""

    def prepare(self, batch: Batch) -> Batch:
        """The whole batch before a step splits it (batch-wide counts for normalising)."""

    def eval_sums(self, model: Any, reference: Any, batch: Batch) -> dict[str, jax.Array]:
        """Sums over the batch's counted examples, added up over batches by `finish`'s caller."""

    def finish(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Held-out metrics from the summed `eval_sums` of every held-out batch."""

    def batch_spec(self, model_cfg: Mapping[str, Any], batch_size: int, seq_len: int,
                   segments: bool, masked: bool) -> dict[str, jax.ShapeDtypeStruct]:
        """The arrays of a global training batch, for compiling without reading data."""


@dataclass(frozen=True)
class LMObjective:
    """`lm`: the model's own task (next token for a decoder, over the targets that packed rows
    and chat loss masks count; classification for the ViT), reported as it always was."""

    task: Task
    name: str = "lm"
    uses_reference: bool = False
    reported: tuple[str, ...] = ("loss", "accuracy", "perplexity")

    def loss(self, model: Any, reference: Any, batch: Batch, run_layers: LayerRunner | None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        return self.task.loss(model, batch, run_layers), {}

    def prepare(self, batch: Batch) -> Batch:
        return self.task.prepare(batch)

    def eval_sums(self, model: Any, reference: Any, batch: Batch) -> dict[str, jax.Array]:
        return self.task.eval_sums(model, batch)

    def finish(self, totals: Mapping[str, float]) -> dict[str, float]:
        """{'loss', 'accuracy', the task's unit (the count), and 'perplexity' for a task that
        reports it}: sums over every counted target, divided once."""
        loss = totals["loss"] / totals["count"]
        perplexity = {"perplexity": math.exp(loss)} if self.task.perplexity else {}
        return {"loss": loss, **perplexity, "accuracy": totals["correct"] / totals["count"],
                self.task.unit: int(totals["count"])}

    def batch_spec(self, model_cfg: Mapping[str, Any], batch_size: int, seq_len: int,
                   segments: bool, masked: bool) -> dict[str, jax.ShapeDtypeStruct]:
        """The task's batch, plus a `loss_mask` like `tokens` where the data carries one."""
        spec = self.task.batch_spec(model_cfg, batch_size, seq_len, segments)
        if masked and "tokens" in spec:
            spec["loss_mask"] = jax.ShapeDtypeStruct(spec["tokens"].shape, jnp.int32)
        return spec
