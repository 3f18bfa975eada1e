"""The train step a run would execute, built from the config and a mesh: shared by the loop
(`Trainer.build`) and ahead-of-time compilation (`jaxscale.aot.compile`), so that what is
compiled for a TPU topology is exactly what `launch.train` runs there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_collections as mlc
from jax.sharding import Mesh

from jaxscale.models import lora
from jaxscale.parallel.pipeline import make_layer_runner
from jaxscale.precision import DynamicLossScale, get_policy
from jaxscale.rules import AxisRules
from jaxscale.train.optim import make_optimizer
from jaxscale.models import ModelDef
from jaxscale.train.state import TrainState, abstract_state
from jaxscale.train.step import StepContext


@dataclass(frozen=True)
class StepSetup:
    """The step's static context plus what sharded initialisation needs."""

    ctx: StepContext
    trainable: Callable[[str], bool]
    init_extra: Callable[[], dict]

    def abstract_state(self) -> tuple[TrainState, TrainState]:
        """(ShapeDtypeStructs carrying shardings, shardings): the state without allocating."""
        c = self.ctx
        return abstract_state(c.model_def, c.optimizer, c.rules, c.mesh, self.trainable,
                              self.init_extra)


def build_step(config: mlc.ConfigDict, mesh: Mesh) -> StepSetup:
    """Model definition, optimizer, precision, rules and pipeline runner for `config`."""
    rules = AxisRules.from_config(config)
    policy = get_policy(config.precision)
    model_def = lora.with_adapters(ModelDef.build(config.model, policy), config.lora)
    optimizer, lr = make_optimizer(config.optim, config.train.steps)
    scaler = DynamicLossScale.from_config(config.loss_scale) if policy.loss_scaling else None
    ctx = StepContext(model_def, optimizer, lr, policy, rules, mesh,
                      config.train.grad_accum, config.train.skip_nonfinite,
                      run_layers=make_layer_runner(config.pipeline, mesh, config.model.remat,
                                                   config.model.get("num_layers")),
                      task=config.model.get("task", "lm"), loss_scale=scaler)
    return StepSetup(ctx, lora.trainable(config.lora), scaler.init if scaler else dict)


def lm_batch_spec(config: mlc.ConfigDict) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch of a language-model step: `tokens` (batch, seq_len + 1) int32."""
    d = config.data
    return {"tokens": jax.ShapeDtypeStruct((d.batch_size, d.seq_len + 1), jnp.int32)}
