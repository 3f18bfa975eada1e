"""Shared test helpers: train a config for a few steps and keep what the assertions need."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.train.loop import Trainer
from jaxscale.train.state import TrainState


def run_steps(trainer: Trainer, steps: int) -> tuple[np.ndarray, TrainState, Any]:
    """(losses, final state, the data iterator, for more batches) of `steps` train steps from
    `trainer.state`, whose buffers the steps donate: copy what you compare against first."""
    it = trainer.batches.iterator()
    state, losses = trainer.state, []
    for _ in range(steps):
        state, metrics = trainer.train_fn(state, trainer.to_global(next(it)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, it


def train_steps(config, steps: int) -> tuple[np.ndarray, TrainState, Trainer]:
    """(losses of `steps` train steps, the final state, the trainer) for `config`, no workdir."""
    trainer = Trainer.build(config, workdir=None)
    losses, state, _ = run_steps(trainer, steps)
    return losses, state, trainer


def assert_cached_decoding_is_the_full_forward(model_def: Any, params: Any,
                                                tokens: np.ndarray, prefill: int = 3) -> None:
    """The logits of a prefill of `prefill` tokens and then one token at a time through the
    model's own cache equal the full forward's over `tokens` (B, T)."""
    from jaxscale.inference.sampling import forward_cached

    b, t = tokens.shape

    def cached(p, toks):
        model = model_def.module(p)
        logits, cache = forward_cached(model, toks[:, :prefill], jnp.int32(0),
                                       model.init_cache(b, t))
        out = [logits]
        for i in range(prefill, t):
            logits, cache = forward_cached(model, toks[:, i:i + 1], jnp.int32(i), cache)
            out.append(logits)
        return jnp.concatenate(out, axis=1)

    full = jax.jit(lambda p, x: model_def.module(p)(x))(params, tokens)
    np.testing.assert_allclose(np.asarray(jax.jit(cached)(params, tokens)), np.asarray(full),
                               atol=1e-5, rtol=1e-5)
