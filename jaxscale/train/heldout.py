"""The held-out metrics of a model's task: one definition for the loop's `eval_*` metrics and
`jaxscale evaluate`.

Why one: a training loss averaged per batch is not a held-out loss. It carries the MoE router's
aux / z losses, counts the padding and document boundaries of packed rows, and weighs a batch
with few real targets as much as a full one. Both readers therefore sum the task's
`eval_sums` (loss, correct predictions and count of the counted targets only) over every batch
and divide once, so `eval_loss` in `metrics.jsonl` is what `jaxscale evaluate` says of the same
weights and batches, whatever the batch split or the mesh.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from jaxscale.models import ModelDef
from jaxscale.rules import AxisRules, use_rules

Batch = Mapping[str, jax.Array]


class HeldOut:
    """The held-out metrics of `model_def`'s task under `rules` on `mesh`; the per-batch sums
    are jitted once, so the loop's periodic evaluations compile once."""

    def __init__(self, model_def: ModelDef, rules: AxisRules, mesh: Mesh) -> None:
        self.task = model_def.task

        @jax.jit
        def sums(params: Any, batch: Batch) -> dict[str, jax.Array]:
            with use_rules(rules, mesh):
                return model_def.task.eval_sums(model_def.module(params), batch)

        self._sums = sums

    def metrics(self, params: Any, batches: Iterable[Batch]) -> dict[str, float]:
        """{'loss', 'accuracy', the task's unit (the count), and 'perplexity' for a task that
        reports it} of `params` (the whole tree: a LoRA run's frozen base merged in) over the
        global `batches`: sums over every counted target, divided once."""
        total = {"loss": 0.0, "correct": 0.0, "count": 0.0}
        for batch in batches:
            for k, v in jax.device_get(self._sums(params, batch)).items():
                total[k] += float(v)
        loss = total["loss"] / total["count"]
        perplexity = {"perplexity": math.exp(loss)} if self.task.perplexity else {}
        return {"loss": loss, **perplexity, "accuracy": total["correct"] / total["count"],
                self.task.unit: int(total["count"])}
