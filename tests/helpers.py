"""Shared test helpers: train a config for a few steps and keep what the assertions need."""

from __future__ import annotations

import numpy as np

from jaxscale.train.loop import Trainer
from jaxscale.train.state import TrainState


def train_steps(config, steps: int) -> tuple[np.ndarray, TrainState, Trainer]:
    """(losses of `steps` train steps, the final state, the trainer) for `config`, no workdir."""
    trainer = Trainer.build(config, workdir=None)
    it = trainer.batches.iterator()
    state, losses = trainer.state, []
    for _ in range(steps):
        state, metrics = trainer.train_fn(state, trainer.to_global(next(it)))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state, trainer
