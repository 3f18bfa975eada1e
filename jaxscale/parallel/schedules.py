"""Pipeline schedules by name (`config.pipeline.schedule`) and the checks every schedule shares.

The table says how many iterations a schedule takes for S stages, M microbatches and R repeats
(its bubble) and which configurations it accepts; `check_layers` / `check_batch` reject layer
counts and batches that do not split evenly. The runners that execute the schedules are in
gpipe.py (GPipe, circular), onef1b.py (1F1B) and pipeline.py (`make_layer_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxscale.errors import ConfigError, paragraph


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: how many iterations it takes and which repeats it accepts."""

    name: str
    circular: bool
    note: str = ""  # why a non-circular schedule has no repeats, for the error message

    def iterations(self, stages: int, microbatches: int, repeats: int) -> int:
        return microbatches * repeats + stages - 1

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
    "gpipe": Schedule("gpipe", circular=False),
    "circular": Schedule("circular", circular=True),
    # Same bubble as GPipe, counted in forward+backward units: the steady phase runs one forward
    # and one backward per iteration (jaxscale/parallel/onef1b.py).
    "1f1b": Schedule("1f1b", circular=False, note=" (an interleaved 1F1B is not implemented)"),
}


def get_schedule(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ConfigError(paragraph(
            f"Unknown pipeline.schedule={name!r}. Valid schedules: {', '.join(SCHEDULES)}",
            "('gpipe': one contiguous layer block per stage; 'circular': pipeline.repeats",
            "non-contiguous blocks per stage, a smaller bubble; '1f1b': GPipe's stages with",
            "each stage's backward interleaved, activations bounded by the stages)."))
    return SCHEDULES[name]


def check_layers(num_layers: int, stages: int, repeats: int) -> None:
    if num_layers % (stages * repeats):
        raise ConfigError(paragraph(
            f"model.num_layers={num_layers} is not divisible by mesh.pipeline={stages} x",
            f"pipeline.repeats={repeats} = {stages * repeats}: every stage must hold the same",
            "number of layers in every repeat. Change num_layers, the pipeline mesh size or",
            "the repeats."))


def check_batch(batch: int, microbatches: int) -> None:
    if batch % microbatches:
        raise ConfigError(paragraph(
            f"The pipeline received a batch of {batch} rows, which is not divisible by",
            f"pipeline.microbatches={microbatches} (rows = data.batch_size / train.grad_accum).",
            "Choose microbatches dividing the batch, e.g. a power of two for a power-of-two",
            "batch."))
