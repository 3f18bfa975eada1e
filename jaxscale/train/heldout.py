"""The held-out metrics of a run's objective: one definition for the loop's `eval_*` metrics and
`jaxscale evaluate`.

Why one: a training loss averaged per batch is not a held-out loss. It carries the MoE router's
aux / z losses, counts the padding and document boundaries of packed rows, and weighs a batch
with few real targets as much as a full one. Both readers therefore sum the objective's
`eval_sums` (the model's task's for `lm`: loss, correct predictions and count of the counted
targets only, a chat loss mask included; a preference objective's: losses, rewards and correct
orderings of the held-out pairs) over every batch and divide once (`finish`), so `eval_loss` in
`metrics.jsonl` is what `jaxscale evaluate` says of the same weights and batches, whatever the
batch split or the mesh.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from jaxscale.models import ModelDef
from jaxscale.objectives import Objective
from jaxscale.objectives.base import LMObjective
from jaxscale.rules import AxisRules, use_rules

Batch = Mapping[str, jax.Array]


class HeldOut:
    """The held-out metrics of `objective` (default: the model's own task) of `model_def`
    under `rules` on `mesh`, scored against the reference model `reference_def` where the
    objective uses one; the per-batch sums are jitted once, so the loop's periodic evaluations
    compile once."""

    def __init__(self, model_def: ModelDef, rules: AxisRules, mesh: Mesh,
                 objective: Objective | None = None,
                 reference_def: ModelDef | None = None) -> None:
        self.objective = objective or LMObjective(model_def.task)
        objective = self.objective

        @jax.jit
        def sums(params: Any, reference: Any, batch: Batch) -> dict[str, jax.Array]:
            with use_rules(rules, mesh):
                ref = None if reference_def is None else reference_def.module(reference)
                return objective.eval_sums(model_def.module(params), ref, batch)

        self._sums = sums

    @property
    def reported(self) -> tuple[str, ...]:
        """The metrics the loop logs as `eval_<name>`."""
        return self.objective.reported

    def metrics(self, params: Any, batches: Iterable[Batch], reference: Any = None
                ) -> dict[str, float]:
        """The objective's held-out metrics (`lm`: loss, accuracy, the task's unit count and,
        for a language model, perplexity) of `params` (the whole tree: a LoRA run's frozen base
        merged in) over the global `batches`, against the `reference` weights where the
        objective uses them: sums over every counted target or pair, divided once."""
        total: dict[str, float] = {}
        for batch in batches:
            for k, v in jax.device_get(self._sums(params, reference, batch)).items():
                total[k] = total.get(k, 0.0) + float(v)
        return self.objective.finish(total)
