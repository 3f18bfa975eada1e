"""A roofline ESTIMATE of step time and MFU from compiled FLOPs and collective bytes.

Never a measurement: compute runs at the chip's peak bf16 rate (int8 x int8 matmuls, from the
`int8` precision policy, at its int8 peak: `hardware.Chip.peak_int8_ops`; an ESTIMATE from the
datasheet until a TPU has run them), each collective at its link
bandwidth with the ring formula for its group size n (all-gather and reduce-scatter move
(n-1)/n of the full buffer through each chip, all-reduce twice that, a collective-permute its
payload over one link, all-to-all (n-1)/n), over ICI within a slice and DCN across slices.
Host offload (optimizer state in pinned host memory, offloaded activations) crosses PCIe at
`Chip.host_bytes_s / 2` a direction, the two directions counted one after the other (`host_s`).
Two bounds: no overlap (compute + communication + host transfers) and full overlap (the largest
of the three, each on its own links).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from jaxscale.hardware import Chip

_RING_FACTOR = {"all-gather": 1.0, "reduce-scatter": 1.0, "all-reduce": 2.0, "all-to-all": 1.0}


@dataclass(frozen=True)
class Estimate:
    compute_s: float
    ici_s: float
    dcn_s: float
    host_s: float
    no_overlap_s: float
    full_overlap_s: float
    mfu_no_overlap: float | None
    mfu_full_overlap: float | None


def collective_seconds(kind: str, nbytes: float, group: int, bandwidth: float) -> float:
    """Seconds for one execution of a collective moving `nbytes` per chip in groups of `group`."""
    if kind == "collective-permute":
        return nbytes / (bandwidth / 2)  # one link, one direction
    if group <= 1:
        return 0.0
    return _RING_FACTOR[kind] * nbytes * (group - 1) / group / bandwidth


def compute_seconds(chip: Chip, flops: float, int8_flops: float = 0.0) -> float:
    """Seconds of matmul at peak: `int8_flops` (part of `flops`) at the chip's int8 rate, where
    the table has one (else at the bf16 rate), the rest at the bf16 rate."""
    int8_rate = chip.peak_int8_ops or chip.peak_bf16_flops
    return (flops - int8_flops) / chip.peak_bf16_flops + int8_flops / int8_rate


def host_seconds(chip: Chip, to_device: float, to_host: float) -> float:
    """Seconds to move `to_device` + `to_host` bytes between the chip and its host's memory,
    each direction at half the both-ways PCIe bandwidth (0 with nothing to move)."""
    if not to_device and not to_host:
        return 0.0
    if not chip.host_bytes_s:
        raise ValueError(f"{chip.name}: no host bandwidth in the hardware table")
    return (to_device + to_host) / (chip.host_bytes_s / 2)


def estimate(chip: Chip, flops: float, collectives: Iterable[dict],
             model_flops: float | None, int8_flops: float = 0.0,
             host_bytes: tuple[float, float] = (0.0, 0.0)) -> Estimate:
    """Per-chip step-time bounds; MFU = analytic model FLOPs / (time x bf16 peak), the bf16
    peak even for int8 matmuls, so MFU compares across precision policies. `host_bytes`:
    (to the device, to the host) over PCIe per step."""
    compute = compute_seconds(chip, flops, int8_flops)
    ici = dcn = 0.0
    for c in collectives:
        bw = chip.dcn_bytes_s if c["dcn"] else chip.ring_bandwidth
        t = collective_seconds(c["kind"], c["bytes"], c["group"], bw) * c["executions"]
        if c["dcn"]:
            dcn += t
        else:
            ici += t
    host = host_seconds(chip, *host_bytes)
    no_overlap, full_overlap = compute + ici + dcn + host, max(compute, ici + dcn, host)
    util = lambda t: model_flops / (t * chip.peak_bf16_flops) if model_flops and t else None
    return Estimate(compute, ici, dcn, host, no_overlap, full_overlap, util(no_overlap),
                    util(full_overlap))
