"""Layer runners for pipeline parallelism: `make_layer_runner(config.pipeline, mesh)`.

A runner is what the train step hands the model in place of its layer scan (the `LayerRunner`
interface of jaxscale/models/runner.py). `PipelineRunner` runs the GPipe and circular schedules
(gpipe.py) and leaves the loss to ordinary autodiff; `OneFOneB` (onef1b.py) runs each stage's
backward inside its schedule, so it fuses the head and loss (`fuses_loss`). The schedule table
and its checks are in schedules.py (re-exported here: `SCHEDULES`, `get_schedule`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxscale.models.runner import LayerRunner, LossFn
from jaxscale.models.scan import check_remat
from jaxscale.parallel.gpipe import batch_over_stages, pipeline_layers
from jaxscale.parallel.onef1b import OneFOneB
from jaxscale.parallel.schedules import SCHEDULES, check_layers, get_schedule

__all__ = ["SCHEDULES", "OneFOneB", "PipelineRunner", "get_schedule", "make_layer_runner"]


@dataclass(frozen=True, eq=False)
class PipelineRunner:
    """GPipe (repeats = 1) or circular (repeats > 1) layers over the `pipeline` axis."""

    mesh: Mesh
    stages: int
    microbatches: int
    repeats: int = 1
    remat: str = "none"
    fuses_loss: bool = False

    def __call__(self, block: nnx.Module, h_BTE: jax.Array, positions_BT: jax.Array | None,
                 segments_BT: jax.Array | None = None) -> jax.Array:
        return pipeline_layers(block, h_BTE, positions_BT, mesh=self.mesh, stages=self.stages,
                               microbatches=self.microbatches, repeats=self.repeats,
                               remat=self.remat, segments_BT=segments_BT)

    def head_scope(self) -> contextlib.AbstractContextManager:
        """The model's head runs split over stages by batch rows (`gpipe.batch_over_stages`)."""
        return batch_over_stages(self.mesh)

    def scaled(self, loss_scale: jax.Array) -> "PipelineRunner":
        return self  # the loss scale reaches these layers through ordinary autodiff

    def fused_loss(self, model: Any, tokens_BT: jax.Array, targets_BT: jax.Array,
                   loss_fn: LossFn, positions_BT: jax.Array | None = None,
                   segments_BT: jax.Array | None = None) -> jax.Array:
        raise NotImplementedError("GPipe / circular runners do not fuse the loss "
                                  "(fuses_loss is False): call the runner instead.")


def make_layer_runner(pipeline_cfg: Mapping[str, Any], mesh: Mesh, remat: str = "none",
                      num_layers: int | None = None) -> LayerRunner | None:
    """The layer runner for the configured schedule, or None when mesh.pipeline == 1.

    Validates the schedule, repeats and (when given) the layer count up front so a bad config
    fails before anything compiles; the batch is checked when the step is traced.
    """
    stages = int(mesh.shape.get("pipeline", 1))
    schedule = get_schedule(pipeline_cfg.get("schedule", "gpipe"))
    microbatches = int(pipeline_cfg.get("microbatches", 1))
    repeats = int(pipeline_cfg.get("repeats", 1))
    check_remat(remat)
    if stages == 1:
        return None
    schedule.check(stages, microbatches, repeats)
    if num_layers is not None:
        check_layers(num_layers, stages, repeats)
    if schedule.name == "1f1b":  # the loss runs inside the schedule
        return OneFOneB(mesh, stages, microbatches, remat)
    return PipelineRunner(mesh, stages, microbatches, repeats, remat)
