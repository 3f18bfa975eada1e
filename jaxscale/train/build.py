"""The train step a run would execute, built from the config and a mesh: the one builder of the
loop (`Trainer.build`), ahead-of-time compilation (`jaxscale.aot.compile`), the sharding
inspector (`launch.inspect`) and the benches, so that what they compile, report or time is
exactly what `launch.train` runs (tests/test_inspect.py compares the lowered programs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
import ml_collections as mlc
from jax.sharding import Mesh

from jaxscale.data.mixture import configured_kind
from jaxscale.data.packing import carries_segments
from jaxscale.models import ModelDef
from jaxscale.models.adapters import lora
from jaxscale.models.moe.routers import is_balance_bias
from jaxscale.objectives import objective_of
from jaxscale.optim import check_offload, make_optimizer
from jaxscale.parallel.schedules import make_layer_runner
from jaxscale.precision import DynamicLossScale, get_policy
from jaxscale.rules import AxisRules
from jaxscale.train.reference import initial_reference, reference_for
from jaxscale.train.state import InitReference, TrainState, abstract_state, init_state
from jaxscale.train.step import StepContext, jit_train_step

BatchSpec = dict[str, jax.ShapeDtypeStruct]


@dataclass(frozen=True)
class StepSetup:
    """The step's static context plus what sharded initialisation needs."""

    ctx: StepContext
    trainable: Callable[[str], bool]
    init_extra: Callable[[], dict]
    init_reference: InitReference  # the reference weights the state holds (their shapes)

    def abstract_state(self) -> tuple[TrainState, TrainState]:
        """(ShapeDtypeStructs carrying shardings, shardings): the state without allocating;
        a preference objective's reference weights included, so compiling counts them."""
        c = self.ctx
        return abstract_state(c.model_def, c.optimizer, c.rules, c.mesh, self.trainable,
                              self.init_extra, c.offload_state, self.init_reference)

    def init_state(self, seed: int, loaded: Mapping[str, jax.Array] | None = None
                   ) -> tuple[TrainState, TrainState]:
        """(state, shardings): the sharded initial state, with `loaded` parameters (init_from's,
        `weights.init_from.load_params`) in place of random ones; before a checkpoint is
        restored (`train.reference.set_reference` then fills the reference)."""
        c = self.ctx
        return init_state(c.model_def, c.optimizer, c.rules, c.mesh, seed, self.trainable,
                          self.init_extra, c.offload_state, self.init_reference, loaded)

    def jit(self, shardings: TrainState, batch: BatchSpec) -> Callable:
        """The jitted train step as the loop forms it: explicit shardings, donated state."""
        return jit_train_step(self.ctx, shardings, {k: v.shape for k, v in batch.items()})

    def lower(self, batch: BatchSpec,
              state: tuple[TrainState, TrainState] | None = None) -> jax.stages.Lowered:
        """The train step lowered against abstract arrays (nothing allocated or run); `state`
        is `self.abstract_state()` when the caller already has it."""
        abstract, shardings = state or self.abstract_state()
        return self.jit(shardings, batch).lower(abstract, batch)


def build_step(config: mlc.ConfigDict, mesh: Mesh) -> StepSetup:
    """Model definition, objective (and its reference model), optimizer, precision, rules and
    pipeline runner for `config`."""
    rules = AxisRules.from_config(config)
    policy = get_policy(config.precision)
    model_def = lora.with_adapters(ModelDef.build(config.model, policy), config.lora)
    optimizer, lr = make_optimizer(config.optim, config.train.steps)
    scaler = DynamicLossScale.from_config(config.loss_scale) if policy.loss_scaling else None
    offload = bool(config.optim.get("offload_state", False))
    if offload:
        check_offload(mesh.devices.flat)
    ctx = StepContext(model_def, optimizer, lr, policy, rules, mesh,
                      config.train.grad_accum, config.train.skip_nonfinite,
                      run_layers=make_layer_runner(config.pipeline, mesh, config.model.remat,
                                                   config.model.get("num_layers")),
                      loss_scale=scaler,
                      offload_state=offload, objective=objective_of(config),
                      reference=reference_for(config),
                      bias_update_rate=config.model.get("moe", {}).get("bias_update_rate", 0.0))
    return StepSetup(ctx, trained(config), scaler.init if scaler else dict,
                     initial_reference(config))


def trained(config: mlc.ConfigDict) -> Callable[[str], bool]:
    """Which parameter paths get gradients and optimizer state: LoRA's adapters (or all), never
    a router's balancing bias, which the step moves itself (`moe.routers.balance_biases`) and
    the state keeps with the frozen parameters, so checkpoints hold it."""
    adapted = lora.trainable(config.lora)
    return lambda path: adapted(path) and not is_balance_bias(path)


def batch_spec(config: mlc.ConfigDict) -> BatchSpec:
    """The global batch the training loop feeds its step, from the config alone (no data read):
    the objective says its arrays (the model's task's: `tokens` for a language model, `images`
    and `labels` for a classifier; a preference objective's pairs) given the data's layout
    (rows that carry segment ids, a chat loss mask)."""
    d = config.data
    return objective_of(config).batch_spec(config.model, d.batch_size, d.seq_len,
                                           carries_segments(d), configured_kind(d) == "chat")
