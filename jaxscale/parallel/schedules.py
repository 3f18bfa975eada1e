"""Pipeline schedules by name (`config.pipeline.schedule`): the table and the runner it builds.

Each entry says which runner executes the schedule (gpipe.py's `PipelineRunner` for GPipe and
circular, onef1b.py's `OneFOneB` for 1F1B), how many iterations it takes for S stages, M
microbatches and R repeats (its bubble, `stages.iterations`) and which configurations it
accepts. `make_layer_runner` is what the step builder calls: the configured schedule's runner,
checked before anything compiles. A runner is what the train step hands the model in place of
its layer scan (the `LayerRunner` interface of jaxscale/models/runner.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jax.sharding import Mesh

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.nn.scan import check_remat
from jaxscale.models.runner import LayerRunner
from jaxscale.parallel.gpipe import PipelineRunner
from jaxscale.parallel.onef1b import OneFOneB
from jaxscale.parallel.stages import check_layers, iterations


def _one_f_one_b(mesh: Mesh, stages: int, microbatches: int, repeats: int,
                 remat: str) -> OneFOneB:
    """1F1B's runner (repeats are refused by the schedule's check)."""
    return OneFOneB(mesh, stages, microbatches, remat)


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: its runner, how many iterations it takes and which repeats it
    accepts."""

    name: str
    circular: bool
    # (mesh, stages, microbatches, repeats, remat) -> the runner the train step hands the model
    runner: Callable[[Mesh, int, int, int, str], LayerRunner]
    note: str = ""  # why a non-circular schedule has no repeats, for the error message

    def iterations(self, stages: int, microbatches: int, repeats: int) -> int:
        return iterations(stages, microbatches, repeats)

    def bubble_fraction(self, stages: int, microbatches: int, repeats: int) -> float:
        """Idle fraction of each device: (S-1) of M*R+S-1 iterations (each 1/R of a stage)."""
        return (stages - 1) / self.iterations(stages, microbatches, repeats)

    def check(self, stages: int, microbatches: int, repeats: int) -> None:
        if repeats < 1 or microbatches < 1:
            raise ConfigError(paragraph(
                f"pipeline.microbatches={microbatches} and pipeline.repeats={repeats} must both",
                "be at least 1."))
        if repeats > 1 and not self.circular:
            raise ConfigError(paragraph(
                f"pipeline.schedule={self.name!r} runs each stage's layers once{self.note}, but",
                f"pipeline.repeats={repeats}. Use --config.pipeline.schedule=circular for",
                "several non-contiguous layer groups per stage, or set pipeline.repeats=1."))
        if repeats > 1 and microbatches < stages:
            raise ConfigError(paragraph(
                "The circular schedule needs pipeline.microbatches >= the number of stages",
                f"(mesh.pipeline={stages}), got microbatches={microbatches}: a microbatch must",
                "leave the last stage before it re-enters the first for its next repeat.",
                f"Set --config.pipeline.microbatches={stages} (or a larger value dividing the",
                "batch)."))


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule("gpipe", circular=False, runner=PipelineRunner),
    "circular": Schedule("circular", circular=True, runner=PipelineRunner),
    # Same bubble as GPipe, counted in forward+backward units: the steady phase runs one forward
    # and one backward per iteration (jaxscale/parallel/onef1b.py). Runs the loss inside.
    "1f1b": Schedule("1f1b", circular=False, runner=_one_f_one_b,
                     note=" (an interleaved 1F1B is not implemented)"),
}


def get_schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ConfigError(paragraph(
            f"Unknown pipeline.schedule={name!r}. Valid schedules: {', '.join(SCHEDULES)}",
            "('gpipe': one contiguous layer block per stage; 'circular': pipeline.repeats",
            "non-contiguous blocks per stage, a smaller bubble; '1f1b': GPipe's stages with",
            "each stage's backward interleaved, activations bounded by the stages)."))
    return SCHEDULES[name]


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
    return schedule.runner(mesh, stages, microbatches, repeats, remat)
