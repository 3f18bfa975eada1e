"""Shared test helpers: train a config for a few steps and keep what the assertions need."""

from __future__ import annotations

from typing import Any

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
