"""The policy-gradient loss of GRPO and its variants (DAPO, Dr. GRPO, GSPO), on a rollout batch.

A rollout batch holds P prompts x G completions as B = P * G rows, grouped by prompt (rows
g*G .. g*G+G-1 answer prompt g). Each row has its completion's per-token log-probabilities under
the policy now (`logp`), under the policy that sampled it (`old_logp`, the same values on the
first update of a rollout, but not differentiated), and optionally under the frozen reference
(`ref_logp`), with `mask` marking the completion's tokens (not the prompt, not what follows a
stop). With advantages A (one per row, `group_advantages`):

  token ratio     r_t = exp(logp_t - old_logp_t)
  sequence ratio  r   = exp(mean over the row's tokens of (logp - old_logp))  (GSPO)
  clipped term    l_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
                  (epsilon_high > epsilon: DAPO's clip-higher)
  KL to the ref   k_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (the k3 estimator; beta = 0
                  drops it and needs no reference)
  per token       l_t + beta k_t

and the loss sums the per-token terms times a weight per row that `loss_norm` sets:

  token      1 / (tokens in the whole batch)           (DAPO: every token weighs the same)
  sequence   1 / (B * tokens of the row)               (GRPO: every sequence weighs the same)
  constant   1 / (B * max_new_tokens)                  (Dr. GRPO: no length bias)

The weights are computed on the whole rollout batch before a step splits it (`row_weights`),
so accumulation, data replicas and pipeline microbatches sum to exactly the whole batch's loss.
On the first update of a rollout (r = 1, inside the clip) with beta = 0, the gradient is
REINFORCE's with the group-mean baseline: -sum_i w_i A_i sum_t grad logp_t.

`GRPOObjective` is this loss as the objective `grpo` (`config.objective`), on the rollout
batches `jaxscale/rl/rollout.py` samples: `tokens` (B, T+1) (each row its prompt, then its
completion, right-padded), `loss_mask` (B, T+1) on the completion's tokens, `old_logp` and, with
beta > 0, `ref_logp` (B, T), aligned with the targets `tokens[:, 1:]`, and `advantages` (B,).
The objective knows nothing of sampling: the rollout side scores the old and reference
log-probabilities and the rewards; the objective only weighs the rows and takes the loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.runner import LayerRunner
from jaxscale.models.task import Task
from jaxscale.objectives.base import Batch, LMObjective, Settings

LossNorm = Literal["token", "sequence", "constant"]
ScaleRewards = Literal["group", "batch", "none"]
LOSS_NORMS = ("token", "sequence", "constant")
SCALE_REWARDS = ("group", "batch", "none")
RATIO_LEVELS = ("token", "sequence")
EPS = 1e-4  # added to a standard deviation before dividing by it


def group_advantages(rewards_B: jax.Array, group: int, scale: ScaleRewards = "group"
                     ) -> tuple[jax.Array, jax.Array]:
    """(advantages (B,), per-group reward std (B // group,)): each reward minus its group's mean,
    divided by the group's std (`group`), the batch's (`batch`) or nothing (`none`, Dr. GRPO).
    A group whose rewards are all equal has zero advantage: it teaches nothing."""
    r_PG = rewards_B.astype(jnp.float32).reshape(-1, group)
    centred_PG = r_PG - r_PG.mean(axis=1, keepdims=True)
    std_P = r_PG.std(axis=1)
    if scale == "group":
        centred_PG = centred_PG / (std_P[:, None] + EPS)
    elif scale == "batch":
        centred_PG = centred_PG / (r_PG.std() + EPS)
    return centred_PG.reshape(-1), std_P


def row_weights(mask_BT: jax.Array, loss_norm: LossNorm, max_new_tokens: int) -> jax.Array:
    """Each row's weight (B,) in the loss sum, from the whole rollout batch (see the module)."""
    tokens_B = mask_BT.astype(jnp.float32).sum(axis=1)
    rows = mask_BT.shape[0]
    if loss_norm == "token":
        return jnp.full((rows,), 1.0) / jnp.maximum(tokens_B.sum(), 1.0)
    if loss_norm == "sequence":
        return 1.0 / (rows * jnp.maximum(tokens_B, 1.0))
    return jnp.full((rows,), 1.0 / (rows * max_new_tokens))


def ratios(logp_BT: jax.Array, old_logp_BT: jax.Array, mask_BT: jax.Array,
           level: str) -> jax.Array:
    """The importance ratios (B, T): per token, or one per row (GSPO) broadcast over its
    tokens, from the mean log-ratio over the row's completion tokens."""
    log_ratio_BT = jnp.where(mask_BT, logp_BT - jax.lax.stop_gradient(old_logp_BT), 0.0)
    if level == "token":
        return jnp.exp(log_ratio_BT)
    mean_B = log_ratio_BT.sum(axis=1) / jnp.maximum(mask_BT.sum(axis=1), 1)
    return jnp.broadcast_to(jnp.exp(mean_B)[:, None], logp_BT.shape)


def policy_loss(logp_BT: jax.Array, old_logp_BT: jax.Array, ref_logp_BT: jax.Array | None,
                advantages_B: jax.Array, mask_BT: jax.Array, weights_B: jax.Array, *,
                epsilon: float, epsilon_high: float, beta: float, ratio_level: str = "token"
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the weighted sum of per-token terms, {'kl', 'clip_fraction'} as weighted sums too):
    summed over a part of the rollout batch, with `weights_B` from the whole batch, the parts
    add up to the whole batch's values."""
    mask = mask_BT.astype(jnp.float32)
    ratio_BT = ratios(logp_BT, old_logp_BT, mask_BT > 0, ratio_level)
    adv_B1 = advantages_B[:, None]
    clipped_BT = jnp.clip(ratio_BT, 1.0 - epsilon, 1.0 + epsilon_high)
    term_BT = -jnp.minimum(ratio_BT * adv_B1, clipped_BT * adv_B1)
    was_clipped = ((ratio_BT < 1.0 - epsilon) & (adv_B1 < 0)) | (
        (ratio_BT > 1.0 + epsilon_high) & (adv_B1 > 0))
    w_BT = mask * weights_B[:, None]
    metrics = {"clip_fraction": (was_clipped * w_BT).sum()}
    if beta:
        if ref_logp_BT is None:
            raise ValueError("beta > 0 needs the reference model's log-probabilities")
        delta_BT = jax.lax.stop_gradient(ref_logp_BT) - logp_BT
        kl_BT = jnp.exp(delta_BT) - delta_BT - 1.0
        term_BT = term_BT + beta * kl_BT
        metrics["kl"] = (kl_BT * w_BT).sum()
    return (term_BT * w_BT).sum(), metrics


ROW_WEIGHT = "row_weight"  # (B,): each row's weight times the whole batch's rows (`prepare`)


def reward_specs(text: str) -> list[tuple[str, str, float]]:
    """(module, function, weight) of each entry of `objective.rewards`
    (`module:function[@weight],...`), checked for form only (importing is the rollout's)."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        target, _, weight = entry.partition("@")
        module, sep, function = target.strip().rpartition(":")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = float("nan")
        if not sep or not module or not function.isidentifier() or not math.isfinite(w):
            raise ConfigError(paragraph(
                f"objective.rewards entry {entry!r} is not module:function[@weight]: name a",
                "function of an importable module (a file beside the run, or on PYTHONPATH),",
                "with an optional finite weight, e.g. 'my_rewards:correct@1.0,my_rewards:short@0.1'."))
        if w == 0:
            raise ConfigError(paragraph(
                f"objective.rewards entry {entry!r} weighs its reward by 0: it would count for",
                "nothing (and, alone, leave every advantage 0, so nothing trains). Give it a",
                "nonzero weight (negative for a penalty), or leave the entry out."))
        out.append((module, function, w))
    return out


def check_grpo(s: Settings, batch_size: int, seq_len: int) -> None:
    """The settings of `grpo` against themselves and the batch (`data.batch_size` rows of
    `data.seq_len` + 1 tokens): one paragraph for the first problem."""
    problems = []
    if not reward_specs(s.rewards):
        problems.append("objective.rewards is empty: name at least one reward function "
                        "(module:function[@weight],...)")
    if s.num_generations < 2:
        problems.append(f"objective.num_generations={s.num_generations}: a group needs at least "
                        "2 completions to compare (8 is usual)")
    elif batch_size % s.num_generations:
        problems.append(f"data.batch_size={batch_size} is not a multiple of "
                        f"objective.num_generations={s.num_generations} (the batch is prompts x "
                        "completions)")
    if not 1 <= s.max_new_tokens < seq_len:
        problems.append(f"objective.max_new_tokens={s.max_new_tokens} must be in [1, "
                        f"data.seq_len={seq_len}) (a row holds the prompt and the completion)")
    if not (math.isfinite(s.temperature) and s.temperature > 0):
        problems.append(f"objective.temperature={s.temperature} must be > 0 (greedy completions "
                        "of a prompt are all alike and teach nothing)")
    if not 0 < s.top_p <= 1 or s.top_k < 0:
        problems.append(f"objective.top_p={s.top_p} must be in (0, 1] and objective.top_k="
                        f"{s.top_k} >= 0 (1.0 and 0 switch them off)")
    if not (math.isfinite(s.beta) and s.beta >= 0):
        problems.append(f"objective.beta={s.beta} must be >= 0 (the KL weight; 0 turns it off)")
    if not (0 <= s.epsilon < 1 and 0 <= s.epsilon_high < 10):
        problems.append(f"objective.epsilon={s.epsilon} must be in [0, 1) and "
                        f"objective.epsilon_high={s.epsilon_high} >= 0 (0.2 and 0.28: DAPO)")
    if s.updates_per_rollout < 1:
        problems.append(f"objective.updates_per_rollout={s.updates_per_rollout} must be >= 1")
    for name, value, allowed in (("loss_norm", s.loss_norm, LOSS_NORMS),
                                 ("scale_rewards", s.scale_rewards, SCALE_REWARDS),
                                 ("ratio_level", s.ratio_level, RATIO_LEVELS)):
        if value not in allowed:
            problems.append(f"objective.{name}={value!r} is not one of {', '.join(allowed)}")
    if problems:
        raise ConfigError(paragraph(
            f"objective.name='grpo': {'; '.join(problems)}. Fix the settings (docs/rl.md lists",
            "each)."))


@dataclass(frozen=True)
class GRPOObjective:
    """`grpo` (GRPO, and DAPO / Dr. GRPO / GSPO by its settings) on the model's `task`."""

    task: Task
    settings: Settings
    name: str = "grpo"
    reported: tuple[str, ...] = ()  # no held-out sums: a rollout's rewards are its metrics

    @property
    def uses_reference(self) -> bool:
        """The run holds a reference only for the KL term (its log-probabilities are scored
        with the rollout, so the step itself never runs it)."""
        return self.settings.beta > 0

    def loss(self, model: Any, reference: Any, batch: Batch, run_layers: LayerRunner | None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`policy_loss` of these rows, with the whole batch's row weights: the parts a step
        splits the batch into are averaged, so each part's sum is scaled by its share."""
        s = self.settings
        logp_BT, mask_BT, extra = self.task.token_logps(
            model, {"tokens": batch["tokens"], "loss_mask": batch["loss_mask"]}, run_layers)
        weights_B = batch[ROW_WEIGHT] / batch["tokens"].shape[0]
        loss, metrics = policy_loss(
            logp_BT, batch["old_logp"], batch.get("ref_logp"), batch["advantages"], mask_BT,
            weights_B, epsilon=s.epsilon, epsilon_high=s.epsilon_high, beta=s.beta,
            ratio_level=s.ratio_level)
        return loss + extra, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}

    def prepare(self, batch: Batch) -> Batch:
        """`row_weight` (B,): `row_weights` of the whole batch times its rows."""
        mask_BT = batch["loss_mask"][:, 1:] > 0
        weights_B = row_weights(mask_BT, self.settings.loss_norm, self.settings.max_new_tokens)
        return dict(batch, **{ROW_WEIGHT: weights_B * mask_BT.shape[0]})

    def eval_sums(self, model: Any, reference: Any, batch: Batch) -> dict[str, jax.Array]:
        """Held-out text (`jaxscale evaluate --eval_sources=text=...`) is scored by the model's
        own task: the policy's next-token loss, accuracy and perplexity, which show what RL did
        to its language modelling. The loop's held-out metrics are rollouts' rewards instead
        (`rl/rollout.py`), so nothing here is logged during training (`reported`)."""
        return LMObjective(self.task).eval_sums(model, reference, batch)

    def finish(self, totals: Mapping[str, float]) -> dict[str, float]:
        return LMObjective(self.task).finish(totals) if totals else {}

    def batch_spec(self, model_cfg: Mapping[str, Any], batch_size: int, seq_len: int,
                   segments: bool, masked: bool) -> dict[str, jax.ShapeDtypeStruct]:
        """The rollout batch (see the module docstring)."""
        row = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32)
        per_target = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32)
        spec = {"tokens": row, "loss_mask": row, "old_logp": per_target,
                "advantages": jax.ShapeDtypeStruct((batch_size,), jnp.float32)}
        return spec | ({"ref_logp": per_target} if self.settings.beta > 0 else {})
