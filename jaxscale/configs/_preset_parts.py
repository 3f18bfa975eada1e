"""What a hardware-sized preset is made of, shared by the Llama, Mixtral and fine-tuning configs.

A model size with its pre-training recipe (`Size`), a hardware target (`Target`), what the TPU
compiler said of a SIZE,TARGET pair (`Compiled`) and a long-context preset (`LongContext`).
Not a config itself: the leading underscore keeps it out of `configs.bundled_names()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxscale.hardware import CHIPS, GiB, hbm_budget


@dataclass(frozen=True)
class Size:
    """A model size with its pre-training recipe (batch in sequences of `seq_len` tokens)."""

    model: dict[str, Any]
    strategy: str          # rules preset on hardware targets: 'dp' or 'fsdp'
    remat: str
    seq_len: int
    batch: int
    lr: float
    warmup: int
    steps: int
    precision: str = "bf16-mixed"
    max_bytes: int = 100_000_000  # enough held-out text (a tenth) for a few global batches


@dataclass(frozen=True)
class Target:
    """Hardware: devices per slice (or host), slices (hosts) over DCN, the chip (a key of the
    hardware table, `jaxscale.hardware.CHIPS`, which has its memory), and for a TPU slice the
    libtpu topology name `jaxscale compile --topology` takes."""

    devices: int
    slices: int
    chip: str
    topology: str | None = None

    @property
    def total(self) -> int:
        return self.devices * self.slices

    @property
    def gpu(self) -> bool:
        return CHIPS[self.chip].generation is None

    @property
    def hbm_gib(self) -> float:
        """HBM per device as the hardware table documents it (what the memory estimate of
        targets without a `Compiled` entry takes a share of)."""
        return CHIPS[self.chip].hbm_bytes / GiB

    @property
    def budget_gib(self) -> float:
        """What a compiled step may fill per chip: the HBM libtpu lets a program use, less
        `hardware.HBM_MARGIN` of it (`hardware.fits`, as the planner judges)."""
        return hbm_budget(CHIPS[self.chip].hbm_limit_bytes) / GiB


@dataclass(frozen=True)
class Compiled:
    """A TPU target's micro-batch as the TPU compiler chose it, not the estimate:
    `python bench/presets.py` compiles SIZE,TARGET for the target's topology (libtpu 0.0.52,
    nothing runs) at each power-of-two micro-batch, largest first, and keeps the first whose
    total per chip (arguments + temporaries) is within the target's `budget_gib` (the planner's
    `fits`). `gib` is that total; with `micro_batch` 0 not even one sequence fits
    and `gib` is what the compiler asked for at one (a lower bound where libtpu refused the
    step outright: its temporaries alone). `step_ms` is the roofline step-time ESTIMATE (full
    overlap, no overlap), never a measurement."""

    micro_batch: int
    gib: float
    step_ms: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class LongContext:
    """A long-context preset: a SIZE at a long `seq_len` on its TPU targets, each with its
    context size (a sequence per `context` chips, FSDP over the rest) and what the TPU compiler
    said of the whole preset (`gib` per chip with the accumulation, the step ESTIMATE)."""

    size: Size
    targets: dict[str, tuple[Target, int, Compiled]]  # name -> (target, context, compiled)
