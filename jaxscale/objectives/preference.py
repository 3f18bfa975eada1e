"""Preference objectives on chosen / rejected pairs: DPO (conservative with label smoothing), IPO
and SimPO.

A batch holds B pairs (`data.chat_sources.PairRows`): `chosen_tokens`, `chosen_loss_mask`,
`rejected_tokens`, `rejected_loss_mask`, (B, T+1), each mask marking the response's tokens. The
two sides of pair i are run as rows 2i and 2i+1 of one (2B, T+1) batch, so a pair stays on the
device that holds it and the model runs once (a pipeline's microbatches may split a pair: the
loss is computed after the stages, on the whole batch). The model's task gives
each row's summed log-probability of its marked tokens, s (`Task.sequence_logps`), and n, their
count. With the policy's s_c, s_r and the frozen reference's r_c, r_r:

  dpo    h = beta * ((s_c - r_c) - (s_r - r_r));  loss = -(1 - eps) log sig(h) - eps log sig(-h)
         (eps: `label_smoothing`, conservative DPO: eps of the labels assumed flipped);
         rewards beta * (s - r).
  ipo    on mean log-probabilities m = s / n, as TRL computes it:
         h = (m_c - mr_c) - (m_r - mr_r);  loss = (h - 1 / (2 beta))^2;  rewards beta * (m - mr).
  simpo  reference-free, length-normalised:  h = beta * (m_c - m_r) - gamma;  loss as dpo's;
         rewards beta * m.

The loss is the mean over pairs, plus `sft_weight` times the chosen responses' NLL per token
(the batch's summed NLL over its count of chosen tokens, counted batch-wide before a step
splits the batch, as the masked LM loss is), plus the task's own extra terms (the MoE router's).
The step reports `rewards_chosen`, `rewards_rejected`, `reward_margin` and `reward_accuracy`
(chosen strictly above rejected), means over pairs; the held-out metrics are the same, summed
over every held-out pair and divided once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale.data.chat_sources import PAIR_KEYS
from jaxscale.models.runner import LayerRunner
from jaxscale.models.task import Task
from jaxscale.objectives.base import Batch, Settings

SIDES = ("chosen", "rejected")
METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


def pair_logps(task: Task, model: Any, batch: Batch, run_layers: LayerRunner | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(summed log-probabilities (B, 2), token counts (B, 2), the task's extra loss) of each
    pair's chosen (column 0) and rejected (column 1) response under `model`."""
    tokens = jnp.stack([batch[f"{s}_tokens"] for s in SIDES], axis=1)
    mask = jnp.stack([batch[f"{s}_loss_mask"] for s in SIDES], axis=1)
    B, _, T1 = tokens.shape
    logps, counts, extra = task.sequence_logps(
        model, {"tokens": tokens.reshape(2 * B, T1), "loss_mask": mask.reshape(2 * B, T1)},
        run_layers)
    return logps.reshape(B, 2), counts.reshape(B, 2), extra


def _log_sigmoid_loss(h_B: jax.Array, smoothing: float) -> jax.Array:
    return -(1.0 - smoothing) * jax.nn.log_sigmoid(h_B) - smoothing * jax.nn.log_sigmoid(-h_B)


def pair_losses(name: str, s: Settings, logps_B2: jax.Array, counts_B2: jax.Array,
                ref_B2: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(per-pair losses, chosen rewards, rejected rewards), each (B,), of objective `name`
    from the policy's (and the reference's) summed log-probabilities (see the docstring)."""
    means_B2 = logps_B2 / jnp.maximum(counts_B2, 1.0)
    if name == "simpo":
        rewards_B2 = s.beta * means_B2
        h_B = rewards_B2[:, 0] - rewards_B2[:, 1] - s.gamma
        return _log_sigmoid_loss(h_B, s.label_smoothing), rewards_B2[:, 0], rewards_B2[:, 1]
    if name == "ipo":
        ratio_B2 = means_B2 - ref_B2 / jnp.maximum(counts_B2, 1.0)
        h_B = ratio_B2[:, 0] - ratio_B2[:, 1]
        losses_B = (h_B - 1.0 / (2.0 * s.beta)) ** 2
    else:  # dpo
        ratio_B2 = logps_B2 - ref_B2
        losses_B = _log_sigmoid_loss(s.beta * (ratio_B2[:, 0] - ratio_B2[:, 1]),
                                     s.label_smoothing)
    rewards_B2 = s.beta * ratio_B2
    return losses_B, rewards_B2[:, 0], rewards_B2[:, 1]


def chosen_targets(batch: Batch) -> jax.Array:
    """The chosen responses' scored tokens, per row (B,)."""
    return jnp.sum(batch["chosen_loss_mask"][:, 1:] > 0, axis=1).astype(jnp.float32)


@dataclass(frozen=True)
class PreferenceObjective:
    """`dpo`, `ipo` or `simpo` (`name`) of `settings` on the model's `task`."""

    task: Task
    settings: Settings
    name: str = "dpo"
    reported: tuple[str, ...] = ("loss", *METRICS)

    @property
    def uses_reference(self) -> bool:
        return self.name != "simpo"

    def scores(self, model: Any, reference: Any, batch: Batch,
                run_layers: LayerRunner | None
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
        """(pair losses, chosen rewards, rejected rewards, policy log-probs (B, 2), extra)."""
        logps_B2, counts_B2, extra = pair_logps(self.task, model, batch, run_layers)
        ref_B2 = None
        if self.uses_reference:
            if reference is None:
                raise ValueError(f"objective {self.name!r} needs its reference model")
            ref_B2 = jax.lax.stop_gradient(pair_logps(self.task, reference, batch,
                                                      run_layers)[0])
        losses_B, chosen_B, rejected_B = pair_losses(self.name, self.settings, logps_B2,
                                                     counts_B2, ref_B2)
        return losses_B, chosen_B, rejected_B, logps_B2, extra

    def loss(self, model: Any, reference: Any, batch: Batch, run_layers: LayerRunner | None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        losses_B, chosen_B, rejected_B, logps_B2, extra = self.scores(model, reference, batch,
                                                                       run_layers)
        loss = jnp.mean(losses_B) + extra
        if self.settings.sft_weight:
            count = (jnp.sum(batch["chosen_per_row"]) if "chosen_per_row" in batch
                     else jnp.sum(chosen_targets(batch)))
            loss = loss - self.settings.sft_weight * jnp.sum(logps_B2[:, 0]) / jnp.maximum(
                count, 1.0)
        margin_B = chosen_B - rejected_B
        metrics = dict(zip(METRICS, (chosen_B, rejected_B, margin_B,
                                     (margin_B > 0).astype(jnp.float32))))
        return loss, {k: jax.lax.stop_gradient(jnp.mean(v)) for k, v in metrics.items()}

    def prepare(self, batch: Batch) -> Batch:
        """`chosen_per_row` (B,): the batch's chosen tokens / B, so that every part a step
        splits the batch into divides the NLL by the batch-wide count."""
        if not self.settings.sft_weight:
            return batch
        count = jax.lax.stop_gradient(jnp.sum(chosen_targets(batch)))
        B = batch["chosen_tokens"].shape[0]
        return dict(batch, chosen_per_row=jnp.full((B,), count / B, jnp.float32))

    def eval_sums(self, model: Any, reference: Any, batch: Batch) -> dict[str, jax.Array]:
        """Sums over the pairs the per-row `mask` keeps (a last held-out batch's padding rows
        have mask 0)."""
        losses_B, chosen_B, rejected_B, logps_B2, _ = self.scores(model, reference, batch,
                                                                   None)
        w_B = batch["mask"].astype(jnp.float32) if "mask" in batch else jnp.ones_like(losses_B)
        return {"loss": jnp.sum(w_B * losses_B), "rewards_chosen": jnp.sum(w_B * chosen_B),
                "rewards_rejected": jnp.sum(w_B * rejected_B),
                "correct": jnp.sum(w_B * (chosen_B > rejected_B)), "count": jnp.sum(w_B),
                "nll": -jnp.sum(w_B * logps_B2[:, 0]),
                "tokens": jnp.sum(w_B * chosen_targets(batch))}

    def finish(self, totals: Mapping[str, float]) -> dict[str, float]:
        n = totals["count"]
        loss = totals["loss"] / n
        if self.settings.sft_weight:
            loss += self.settings.sft_weight * totals["nll"] / max(totals["tokens"], 1.0)
        chosen, rejected = totals["rewards_chosen"] / n, totals["rewards_rejected"] / n
        return {"loss": loss, "rewards_chosen": chosen, "rewards_rejected": rejected,
                "reward_margin": chosen - rejected, "reward_accuracy": totals["correct"] / n,
                "pairs": int(n)}

    def batch_spec(self, model_cfg: Mapping[str, Any], batch_size: int, seq_len: int,
                   segments: bool, masked: bool) -> dict[str, jax.ShapeDtypeStruct]:
        """The rows of `data.chat_sources.PairRows`: each side's tokens and loss mask."""
        row = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32)
        return dict.fromkeys(PAIR_KEYS, row)
