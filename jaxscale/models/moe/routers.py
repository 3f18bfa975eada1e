"""How tokens pick their experts: the routers by `model.moe.router` (`ROUTERS`), and the
router's statistics and losses.

Every router starts from the same float32 logits (x @ router) and returns each token's top-k
expert ids and their combine weights, plus the per-expert probabilities the Switch load-balancing
loss averages; what differs between families is the choice: softmax then top-k (Mixtral,
Qwen3-MoE), or top k of the logits then a softmax over those k (GPT-OSS). A new router is one
function and one line in `ROUTERS`.

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

from jaxscale.models.moe.config import MoEConfig

# The per-call router statistics, in the order of the sown vector (all float32 scalars):
# aux: Switch load-balancing loss E * sum_e f_e * P_e (f_e: share of the token-expert
#   assignments routed to e, P_e: mean router probability of e); 1.0 when perfectly balanced.
#   (Hugging Face Mixtral's `load_balancing_loss_func` is experts_per_token times this.)
# z: mean over tokens of logsumexp(router logits)^2 (ST-MoE), keeps the logits small.
# dropped: share of the assignments dropped by full expert buffers (0 when dropless).
# load_max / load_min: the busiest / idlest expert's assignments relative to a balanced load.
STATS = ("aux", "z", "dropped", "load_max", "load_min")
ROUTER_STATS = "router_stats"  # the name of the sown Intermediate
METRICS = {"aux": "moe_aux_loss", "z": "moe_z_loss", "dropped": "moe_dropped",
           "load_max": "moe_load_max", "load_min": "moe_load_min"}


@dataclass(frozen=True)
class Router:
    """One way of routing. `choose(logits_NX, moe)` -> (combine weights (N, K) float32, expert ids
    (N, K), per-expert probabilities (N, X) whose mean over tokens the aux loss uses)."""

    choose: Callable[[jax.Array, MoEConfig], tuple[jax.Array, jax.Array, jax.Array]]


def softmax_topk(logits_NX: jax.Array, moe: MoEConfig
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax over all experts, then the top k (Mixtral, Qwen3-MoE); the k weights renormalised
    to sum to one with `norm_topk_prob`."""
    probs_NX = jax.nn.softmax(logits_NX, axis=-1)
    weights_NK, experts_NK = jax.lax.top_k(probs_NX, moe.experts_per_token)
    if moe.norm_topk_prob:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return weights_NK, experts_NK, probs_NX


def topk_softmax(logits_NX: jax.Array, moe: MoEConfig
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The top k logits, then a softmax over those k alone (GPT-OSS): the same weights as
    softmax_topk renormalised, computed as transformers does. The aux loss averages the
    softmax over all experts, as transformers' load-balancing loss does."""
    top_NK, experts_NK = jax.lax.top_k(logits_NX, moe.experts_per_token)
    return jax.nn.softmax(top_NK, axis=-1), experts_NK, jax.nn.softmax(logits_NX, axis=-1)


ROUTERS: dict[str, Router] = {
    "softmax_topk": Router(softmax_topk),
    "topk_softmax": Router(topk_softmax),
}


def route(x_NE: jax.Array, router_EX: jax.Array, moe: MoEConfig,
          bias_X: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(top-k weights (N, k) float32, expert ids (N, k), stats vector (len(STATS),)) of the
    configured router (`ROUTERS[moe.router]`); N may be several leading dimensions (e.g. B, T),
    the statistics are over all of them.

    The router runs in float32 whatever the compute dtype: its scores decide which matmuls
    run, and bf16 logits flip near-ties between experts."""
    n = moe.num_experts
    logits_NX = x_NE.astype(jnp.float32) @ router_EX.astype(jnp.float32)
    if bias_X is not None:  # GPT-OSS's router bias (`moe.router_bias`)
        logits_NX = logits_NX + bias_X.astype(jnp.float32).reshape(
            (1,) * (logits_NX.ndim - 1) + (-1,))
    weights_NK, experts_NK, probs_NX = ROUTERS[moe.router].choose(logits_NX, moe)
    leading = tuple(range(probs_NX.ndim - 1))
    counts_X = jnp.sum(jax.nn.one_hot(experts_NK, n, dtype=jnp.float32), axis=(*leading, -2))
    share_X = counts_X / experts_NK.size                 # f_e: share of the assignments
    prob_X = jnp.mean(probs_NX, axis=leading)            # P_e: carries the gradient
    aux = n * jnp.sum(share_X * prob_X)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_NX, axis=-1)))
    load_X = share_X * n
    stats = jnp.stack([aux, z, jnp.zeros(()), jnp.max(load_X), jnp.min(load_X)])
    return weights_NK, experts_NK, stats


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
    return router_objective(sown, moe)
