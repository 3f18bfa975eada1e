"""How tokens pick their experts: the routers by `model.moe.router` (`ROUTERS`), and the
router's statistics and losses.

Every router starts from the same float32 logits (x @ router) and returns each token's top-k
expert ids and their combine weights, plus the per-expert probabilities the Switch load-balancing
loss averages; what differs between families is the choice: softmax then top-k (Mixtral,
Qwen3-MoE), top k of the logits then a softmax over those k (GPT-OSS), DeepSeek-V3's sigmoid
scores with group-limited top-k (`sigmoid_group`), or DeepSeek-V2's softmax with group-limited
top-k (`softmax_group`). Every router's combine weights are scaled by
`routed_scaling_factor` (`route`). A new router is one function and one line in `ROUTERS`.

Auxiliary-loss-free balancing (DeepSeek-V3, `sigmoid_group`): a per-expert bias is added to the
scores for the choice only (the combine weights are the unbiased scores). It is not trained: the
MoE block keeps it as `balance_bias`, which the train state holds with the frozen parameters
(`is_balance_bias`: no gradient, no optimizer state, saved in checkpoints), and the train step
moves it by `moe.bias_update_rate` against the sign of each expert's load error
(`balance_biases`), from the per-expert loads the block sows (`EXPERT_LOAD`). (GPT-OSS's
`router_bias` is another thing: a trained bias on the logits, `route`'s `bias_X`.)

The statistics (aux and z losses, load) are *sown* by the block as an `nnx.Intermediate`
(`ROUTER_STATS`): `scan_layers` stacks them over the layers, and `router_loss` (called by the LM
task) turns them into the loss term and the step's `moe_*` metrics.
Shape suffixes: N tokens (any leading dimensions), K choices per token, X experts, E embed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.moe.config import BIASED_ROUTERS, MoEConfig

# The routers that limit a token's choice to its best groups of experts (`model.moe.n_group`).
GROUPED_ROUTERS = ("sigmoid_group", "softmax_group")
# The per-call router statistics, in the order of the sown vector (all float32 scalars):
# aux: Switch load-balancing loss E * sum_e f_e * P_e (f_e: share of the token-expert
#   assignments routed to e, P_e: mean router probability of e); 1.0 when perfectly balanced.
#   (Hugging Face Mixtral's `load_balancing_loss_func` is experts_per_token times this.)
# z: mean over tokens of logsumexp(router logits)^2 (ST-MoE), keeps the logits small.
# dropped: share of the assignments dropped by full expert buffers (0 when dropless).
# load_max / load_min: the busiest / idlest expert's assignments relative to a balanced load.
STATS = ("aux", "z", "dropped", "load_max", "load_min")
ROUTER_STATS = "router_stats"  # the name of the sown Intermediate
# The per-expert load (assignments relative to an even share, (X,) per layer) a biased router's
# block sows, and the step metric that carries them {bias path: (layers, X)} to the train step.
EXPERT_LOAD = "expert_load"
LOAD_METRIC = "moe_expert_load"
BIAS = "balance_bias"  # the MoE block's selection bias (biased routers only)
METRICS = {"aux": "moe_aux_loss", "z": "moe_z_loss", "dropped": "moe_dropped",
           "load_max": "moe_load_max", "load_min": "moe_load_min"}


@dataclass(frozen=True)
class Router:
    """One way of routing. `choose(logits_NX, moe, balance_X)` -> (combine weights (N, K) float32,
    expert ids (N, K), per-expert probabilities (N, X) whose mean over tokens the aux loss
    uses); `balance_X` is the block's selection bias (None for a router without one)."""

    choose: Callable[[jax.Array, MoEConfig, jax.Array | None],
                     tuple[jax.Array, jax.Array, jax.Array]]


def softmax_topk(logits_NX: jax.Array, moe: MoEConfig, balance_X: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax over all experts, then the top k (Mixtral, Qwen3-MoE); the k weights renormalised
    to sum to one with `norm_topk_prob`."""
    probs_NX = jax.nn.softmax(logits_NX, axis=-1)
    weights_NK, experts_NK = jax.lax.top_k(probs_NX, moe.experts_per_token)
    if moe.norm_topk_prob:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return weights_NK, experts_NK, probs_NX


def topk_softmax(logits_NX: jax.Array, moe: MoEConfig, balance_X: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The top k logits, then a softmax over those k alone (GPT-OSS): the same weights as
    softmax_topk renormalised, computed as transformers does. The aux loss averages the
    softmax over all experts, as transformers' load-balancing loss does."""
    top_NK, experts_NK = jax.lax.top_k(logits_NX, moe.experts_per_token)
    return jax.nn.softmax(top_NK, axis=-1), experts_NK, jax.nn.softmax(logits_NX, axis=-1)


def sigmoid_group(logits_NX: jax.Array, moe: MoEConfig, balance_X: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """DeepSeek-V3: sigmoid scores; the experts in `n_group` groups, each group scored by the
    sum of its two best biased scores, a token choosing its top k among the experts of its
    `topk_group` best groups (the others' never chosen); the weights are the chosen experts'
    unbiased scores, renormalised with `norm_topk_prob` (times `routed_scaling_factor`, as
    every router's: `route`). Why groups: with the groups on different devices, a token's
    experts live on at most topk_group of them, which bounds the all-to-all."""
    scores_NX = jax.nn.sigmoid(logits_NX)
    choice_NX = scores_NX
    if balance_X is not None:
        choice_NX = scores_NX + balance_X.astype(jnp.float32).reshape(
            (1,) * (scores_NX.ndim - 1) + balance_X.shape)
    if moe.n_group > 1:  # a group scored by the sum of its two best
        choice_NX = _best_groups(choice_NX, moe, lambda g: jnp.sum(jax.lax.top_k(g, 2)[0], -1))
    _, experts_NK = jax.lax.top_k(choice_NX, moe.experts_per_token)
    weights_NK = jnp.take_along_axis(scores_NX, experts_NK, axis=-1)
    if moe.norm_topk_prob:
        weights_NK = weights_NK / (jnp.sum(weights_NK, axis=-1, keepdims=True) + 1e-20)
    probs_NX = scores_NX / jnp.sum(scores_NX, axis=-1, keepdims=True)
    return weights_NK, experts_NK, probs_NX


def softmax_group(logits_NX: jax.Array, moe: MoEConfig, balance_X: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """DeepSeek-V2's `group_limited_greedy`: softmax over all experts; the experts in `n_group`
    groups, each scored by its best expert, a token choosing its top k among the experts of
    its `topk_group` best groups; the weights are those softmax probabilities (renormalised
    with `norm_topk_prob`). With n_group 1 it is `softmax_topk` (V2's `greedy`)."""
    probs_NX = jax.nn.softmax(logits_NX, axis=-1)
    choice_NX = probs_NX
    if moe.n_group > 1:
        choice_NX = _best_groups(probs_NX, moe, lambda g: jnp.max(g, axis=-1))
    _, experts_NK = jax.lax.top_k(choice_NX, moe.experts_per_token)
    weights_NK = jnp.take_along_axis(probs_NX, experts_NK, axis=-1)
    if moe.norm_topk_prob:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return weights_NK, experts_NK, probs_NX


def _best_groups(choice_NX: jax.Array, moe: MoEConfig,
                 score: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`choice_NX` with the experts outside each token's `topk_group` best of `n_group` groups
    (each scored by `score` over its experts' choice values) set to -inf."""
    *lead, x = choice_NX.shape
    group_NG = score(choice_NX.reshape(*lead, moe.n_group, x // moe.n_group))
    _, best_NJ = jax.lax.top_k(group_NG, moe.topk_group)
    keep_NG = jnp.sum(jax.nn.one_hot(best_NJ, moe.n_group, dtype=jnp.bool_), axis=-2)
    keep_NX = jnp.repeat(keep_NG, x // moe.n_group, axis=-1)
    return jnp.where(keep_NX, choice_NX, -jnp.inf)


ROUTERS: dict[str, Router] = {
    "softmax_topk": Router(softmax_topk),
    "topk_softmax": Router(topk_softmax),  # GPT-OSS
    "sigmoid_group": Router(sigmoid_group),  # DeepSeek-V3; keeps a bias (BIASED_ROUTERS)
    "softmax_group": Router(softmax_group),  # DeepSeek-V2's group_limited_greedy
}


def check_router(moe: MoEConfig, num_layers: int) -> None:
    """The group-limited routing, balancing and dense-first fields of `config.model.moe`
    (ConfigError paragraphs); `check_moe` has checked the router's name."""
    n, g, k = moe.num_experts, moe.n_group, moe.experts_per_token
    size = n // g if g >= 1 and n % g == 0 else 0
    if not (size and (g == 1 or size >= 2) and 1 <= moe.topk_group <= g
            and k <= moe.topk_group * size):
        raise ConfigError(paragraph(
            f"model.moe.n_group={g} and topk_group={moe.topk_group} do not fit",
            f"num_experts={n} and experts_per_token={k}: n_group must divide the experts into",
            "groups of at least two (a group is scored by its two best experts), topk_group be",
            "between 1 and n_group, and the chosen groups hold at least experts_per_token",
            "experts (DeepSeek-V3: 256 experts, n_group 8, topk_group 4, 8 per token)."))
    if g > 1 and moe.router not in GROUPED_ROUTERS:
        raise ConfigError(paragraph(
            f"model.moe.n_group={g} limits the choice to groups only in the",
            f"{', '.join(GROUPED_ROUTERS)} routers, not {moe.router!r}: set",
            "model.moe.router=sigmoid_group (DeepSeek-V3's), softmax_group (DeepSeek-V2's) or",
            "n_group=1."))
    if moe.routed_scaling_factor <= 0 or moe.bias_update_rate < 0 or (
            moe.bias_update_rate and moe.router not in BIASED_ROUTERS):
        raise ConfigError(paragraph(
            f"model.moe.routed_scaling_factor={moe.routed_scaling_factor} must be positive and",
            f"model.moe.bias_update_rate={moe.bias_update_rate} non-negative, the latter only",
            f"with a router that keeps a selection bias ({', '.join(BIASED_ROUTERS)}): the",
            "bias moves by that much per step against each expert's load error (DeepSeek-V3:",
            "0.001; 0 keeps it fixed, as when fine-tuning)."))
    dense = moe.first_k_dense_replace
    if not (isinstance(dense, int) and 0 <= dense < num_layers
            and (num_layers - dense) % moe.every == 0):
        raise ConfigError(paragraph(
            f"model.moe.first_k_dense_replace={dense!r} must be a non-negative integer below",
            f"model.num_layers={num_layers} that leaves a multiple of model.moe.every",
            f"({moe.every}) layers for the scanned MoE stack: the first k layers keep the dense",
            "MLP (DeepSeek-V3: 3)."))


def route(x_NE: jax.Array, router_EX: jax.Array, moe: MoEConfig,
          bias_X: jax.Array | None = None, balance_X: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(top-k weights (N, k) float32, expert ids (N, k), stats vector (len(STATS),), per-expert
    load (X,): assignments relative to an even share) of the configured router
    (`ROUTERS[moe.router]`, with GPT-OSS's logit bias `bias_X` and the balancing bias
    `balance_X` where the router keeps one); N may be several leading dimensions (e.g. B, T),
    the statistics are over all of them.

    The router runs in float32 whatever the compute dtype: its scores decide which matmuls
    run, and bf16 logits flip near-ties between experts."""
    n = moe.num_experts
    logits_NX = x_NE.astype(jnp.float32) @ router_EX.astype(jnp.float32)
    if bias_X is not None:  # GPT-OSS's router bias (`moe.router_bias`)
        logits_NX = logits_NX + bias_X.astype(jnp.float32).reshape(
            (1,) * (logits_NX.ndim - 1) + (-1,))
    weights_NK, experts_NK, probs_NX = ROUTERS[moe.router].choose(logits_NX, moe, balance_X)
    if moe.routed_scaling_factor != 1.0:  # DeepSeek's: the combine weights scaled
        weights_NK = weights_NK * moe.routed_scaling_factor
    leading = tuple(range(probs_NX.ndim - 1))
    counts_X = jnp.sum(jax.nn.one_hot(experts_NK, n, dtype=jnp.float32), axis=(*leading, -2))
    share_X = counts_X / experts_NK.size                 # f_e: share of the assignments
    prob_X = jnp.mean(probs_NX, axis=leading)            # P_e: carries the gradient
    aux = n * jnp.sum(share_X * prob_X)
    if moe.aux_per_sequence and probs_NX.ndim > 2:
        aux = _sequence_aux(experts_NK, probs_NX, n)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_NX, axis=-1)))
    load_X = share_X * n
    stats = jnp.stack([aux, z, jnp.zeros(()), jnp.max(load_X), jnp.min(load_X)])
    return weights_NK, experts_NK, stats, load_X


def _sequence_aux(experts_BTK: jax.Array, probs_BTX: jax.Array, n: int) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance statistic: the Switch statistic of each sequence
    (row; f and P over its own tokens), averaged over the rows. Why: a batch can be balanced
    while each sequence sends all its tokens to a few experts; this asks each to balance."""
    rows = probs_BTX.shape[0]
    counts_BX = jnp.sum(jax.nn.one_hot(experts_BTK.reshape(rows, -1), n, dtype=jnp.float32),
                        axis=1)
    share_BX = counts_BX / (experts_BTK.size // rows)
    prob_BX = jnp.mean(probs_BTX.reshape(rows, -1, n), axis=1)
    return n * jnp.mean(jnp.sum(share_BX * prob_BX, axis=-1))


def _router_stats(sown: nnx.State) -> jax.Array | None:
    """The router statistics in `sown` (what a forward pass's layers sowed), (MoE layers,
    len(STATS)); None without MoE layers."""
    stats = [v.get_value() for path, v in nnx.to_flat_state(sown) if path[-1] == ROUTER_STATS]
    if not stats:
        return None
    return jnp.concatenate([s.reshape(-1, len(STATS)) for s in stats])


def router_objective(sown: nnx.State, moe: MoEConfig) -> jax.Array | float:
    """The router's loss term, aux_coef x aux + z_coef x z averaged over the MoE layers, of
    the statistics in `sown`; 0.0 without MoE layers. Linear in them: a schedule that runs the
    backward itself (1F1B) differentiates it from its constant gradient."""
    stats_LS = _router_stats(sown)
    if stats_LS is None:
        return 0.0
    named = dict(zip(STATS, jnp.mean(stats_LS, axis=0)))
    return moe.router_aux_loss_coef * named["aux"] + moe.router_z_loss_coef * named["z"]


def router_loss(model: nnx.Module, moe: MoEConfig) -> jax.Array | float:
    """The router's loss term of a forward pass (`router_objective`). Pops the sown
    statistics and records the step's metrics (`METRICS`) on `model` as Intermediates named by
    the metric (`task.step_metrics` pops them).
    0.0 for a model without MoE layers."""
    sown = nnx.pop(model, nnx.Intermediate)
    stats_LS = _router_stats(sown)
    if stats_LS is None:
        return 0.0
    named = dict(zip(STATS, jnp.mean(stats_LS, axis=0)))
    for stat, metric in METRICS.items():
        setattr(model, metric, nnx.Intermediate(jax.lax.stop_gradient(named[stat])))
    loads = {"/".join(map(str, path[:-1] + (BIAS,))): jax.lax.stop_gradient(v.get_value())
             for path, v in nnx.to_flat_state(sown) if path[-1] == EXPERT_LOAD}
    if loads:
        setattr(model, LOAD_METRIC, nnx.Intermediate(loads))
    return router_objective(sown, moe)


def is_balance_bias(path: str) -> bool:
    """Is this parameter path a biased router's selection bias (kept out of the gradient)?"""
    return path.rsplit("/", 1)[-1] == BIAS


def balance_biases(frozen: dict, loads: dict[str, jax.Array], rate: float) -> dict:
    """`frozen` with each selection bias moved by `rate` against the sign of its experts' load
    error (DeepSeek-V3's auxiliary-loss-free balancing): up for an expert below an even share,
    down above it. `loads`: {bias path: (layers, X) loads relative to an even share}, the
    step's `LOAD_METRIC`. Outside the gradient: the optimizer never sees the bias."""
    flat = nnx.traversals.flatten_mapping(frozen, sep="/")
    for path, load in loads.items():
        bias = flat[path]
        flat[path] = (bias + rate * jnp.sign(1.0 - load).reshape(bias.shape)).astype(bias.dtype)
    return nnx.traversals.unflatten_mapping(flat, sep="/")
