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
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

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
