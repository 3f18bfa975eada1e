"""The GRPO-family policy loss (`objectives/grpo.py`) against a hand-written per-token loop.

A crafted rollout batch (2 prompts x 3 completions of different lengths, some ratios outside
the clip range, advantages of both signs) is scored by nested Python loops written from the
papers' definitions (GRPO, DAPO's clip-higher and token norm, Dr. GRPO's constant norm, GSPO's
sequence ratio), for the loss and its gradient; on a rollout's first update the gradient of a
tiny softmax policy equals REINFORCE's with the group-mean baseline.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.objectives.grpo import (
    LOSS_NORMS,
    RATIO_LEVELS,
    group_advantages,
    policy_loss,
    row_weights,
)

B, T, G, MAX_NEW = 6, 5, 3, 5
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = [5, 2, 4, 1, 3, 5]
    mask = np.array([[t < n for t in range(T)] for n in lengths])
    old = -rng.uniform(0.5, 3.0, (B, T))
    logp = old + rng.normal(0, 0.3, (B, T))  # ratios from ~0.5 to ~2: some clipped
    ref = old + rng.normal(0, 0.2, (B, T))
    rewards = np.array([1.0, 0.0, 0.5, 0.0, 0.0, 1.0])
    return logp, old, ref, rewards, mask


def _advantages(rewards, scale):
    out = np.zeros(B)
    for g in range(B // G):
        r = rewards[g * G:(g + 1) * G]
        std = {"group": r.std(), "batch": rewards.std(), "none": None}[scale]
        out[g * G:(g + 1) * G] = (r - r.mean()) / (std + 1e-4 if std is not None else 1.0)
    return out


def _weight(mask, i, norm):
    if norm == "token":
        return 1.0 / mask.sum()
    if norm == "sequence":
        return 1.0 / (B * mask[i].sum())
    return 1.0 / (B * MAX_NEW)


def _by_hand(logp, old, ref, adv, mask, norm, level, beta):
    """(loss, d loss / d logp) from the definitions, one token at a time."""
    loss, grad = 0.0, np.zeros((B, T))
    for i in range(B):
        n = mask[i].sum()
        seq_ratio = math.exp(sum(logp[i, t] - old[i, t] for t in range(T) if mask[i, t]) / n)
        w = _weight(mask, i, norm)
        for t in range(T):
            if not mask[i, t]:
                continue
            r = math.exp(logp[i, t] - old[i, t]) if level == "token" else seq_ratio
            clipped = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
            unclipped_wins = r * adv[i] <= clipped * adv[i]
            loss += w * -min(r * adv[i], clipped * adv[i])
            inside = 1 - EPS_LOW <= r <= 1 + EPS_HIGH
            if unclipped_wins or inside:  # the gradient flows through r
                if level == "token":
                    grad[i, t] += w * -adv[i] * r
                else:  # d seq_ratio / d logp_u = seq_ratio / n for every token u of the row
                    for u in range(T):
                        grad[i, u] += w * -adv[i] * r / n * mask[i, u]
            delta = ref[i, t] - logp[i, t]
            loss += w * beta * (math.exp(delta) - delta - 1)
            grad[i, t] += w * beta * (1 - math.exp(delta))
    return loss, grad


@pytest.mark.parametrize("norm,level,beta", list(itertools.product(
    LOSS_NORMS, RATIO_LEVELS, (0.0, 0.04))))
def test_loss_and_gradient_equal_the_per_token_definition(norm, level, beta):
    logp, old, ref, rewards, mask = _batch()
    adv = _advantages(rewards, "group")
    weights = row_weights(jnp.asarray(mask), norm, MAX_NEW)

    def loss_of(logp_BT):
        return policy_loss(logp_BT, *(jnp.asarray(a, jnp.float32) for a in (old, ref, adv)),
                           jnp.asarray(mask), weights, epsilon=EPS_LOW, epsilon_high=EPS_HIGH,
                           beta=beta, ratio_level=level)[0]

    value, grad = jax.value_and_grad(loss_of)(jnp.asarray(logp, jnp.float32))
    want, want_grad = _by_hand(logp, old, ref, adv, mask, norm, level, beta)
    assert float(value) == pytest.approx(want, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_the_group_centred_rewards(scale):
    *_, rewards, _ = _batch()
    adv, std = group_advantages(jnp.asarray(rewards), G, scale)
    np.testing.assert_allclose(np.asarray(adv), _advantages(rewards, scale), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(std), rewards.reshape(-1, G).std(axis=1), rtol=1e-6)
    same, _ = group_advantages(jnp.ones(B), G, scale)
    assert not np.asarray(same).any()  # a group of equal rewards teaches nothing


@pytest.mark.parametrize("level", RATIO_LEVELS)
def test_first_update_gradient_is_reinforce_with_the_group_mean_baseline(level):
    rng = np.random.default_rng(1)
    feats = jnp.asarray(rng.normal(size=(B, T, 4)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 7, (B, T)))
    _, _, _, rewards, mask = _batch()
    mask = jnp.asarray(mask)
    w0 = jnp.asarray(rng.normal(size=(4, 7)), jnp.float32)

    def logps(w):
        logp_BTV = jax.nn.log_softmax(feats @ w, axis=-1)
        return jnp.take_along_axis(logp_BTV, tokens[..., None], axis=-1)[..., 0]

    adv = jnp.asarray(rewards) - jnp.asarray(rewards).reshape(-1, G).mean(1).repeat(G)
    weights = row_weights(mask, "sequence", MAX_NEW)
    grpo = jax.grad(lambda w: policy_loss(
        logps(w), logps(w), None, adv, mask, weights, epsilon=EPS_LOW,  # old: not differentiated
        epsilon_high=EPS_HIGH, beta=0.0, ratio_level=level)[0])(w0)
    reinforce = jax.grad(lambda w: -(weights * adv * jnp.where(mask, logps(w), 0).sum(1)).sum())
    np.testing.assert_allclose(np.asarray(grpo), np.asarray(reinforce(w0)), rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("norm", LOSS_NORMS)
def test_parts_of_a_batch_sum_to_the_whole(norm):
    logp, old, ref, rewards, mask = _batch()
    adv = jnp.asarray(_advantages(rewards, "group"))
    weights = row_weights(jnp.asarray(mask), norm, MAX_NEW)
    run = lambda rows: policy_loss(*(jnp.asarray(a)[rows] for a in (logp, old, ref)), adv[rows],
                                   jnp.asarray(mask)[rows], weights[rows], epsilon=EPS_LOW,
                                   epsilon_high=EPS_HIGH, beta=0.04)
    whole, whole_metrics = run(slice(None))
    halves = [run(slice(0, 3)), run(slice(3, None))]
    assert float(whole) == pytest.approx(sum(float(h[0]) for h in halves), rel=1e-6)
    for name in whole_metrics:
        assert float(whole_metrics[name]) == pytest.approx(
            sum(float(h[1][name]) for h in halves), rel=1e-6, abs=1e-9)
