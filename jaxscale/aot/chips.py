"""The one table of TPU chips jaxscale can compile for: memory, peak compute, link bandwidths.

Every number is per chip, from Google's public Cloud TPU documentation (the page is named in
`source`). Bandwidths in bytes per second. `ici_ports` is the number of inter-chip links a chip
has; a ring along one mesh axis uses two of them (one to each neighbour), in both directions
(`Chip.ring_bandwidth`). Only the estimate (`jaxscale.aot.roofline`) reads the bandwidths; fit and cost come from the
compiler.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Chip:
    name: str                 # jaxscale / libtpu generation name: 'v5p'
    hbm_bytes: float          # HBM capacity per chip
    peak_bf16_flops: float    # dense bf16 FLOP/s per chip
    ici_bidir_bytes_s: float  # total bidirectional ICI bandwidth per chip, all ports
    ici_ports: int
    dcn_bytes_s: float        # data-centre network bandwidth per chip (multi-slice)
    torus_dims: int           # 2 (v5e, v6e) or 3 (v4, v5p)
    max_chips: int            # largest single slice
    chip_config: str | None   # libtpu chip_config_name ('megacore': one device per chip)
    source: str

    @property
    def ring_bandwidth(self) -> float:
        """Bytes/s one chip moves along a bidirectional ring over one mesh axis: the two links
        of that axis (one per neighbour), each carrying data both ways: bidirectional ICI per
        chip x 2 links / ports."""
        return self.ici_bidir_bytes_s * 2 / self.ici_ports


CHIPS: dict[str, Chip] = {
    # https://cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, 32 GiB HBM2, 3D torus, 6 ICI
    # links; ICI 2,400 Gbps per chip as compared in https://cloud.google.com/tpu/docs/v5p.
    # No per-chip DCN figure is published for v4: the v5p figure (50 Gbps) is used.
    "v4": Chip("v4", 32 * GiB, 275e12, 2400e9 / 8, 6, 50e9 / 8, 3, 4096, "megacore",
               "https://cloud.google.com/tpu/docs/v4 (DCN: v5p figure, assumed)"),
    # https://cloud.google.com/tpu/docs/v5e and /v6e (side-by-side table): 197 TFLOP/s bf16,
    # 16 GB HBM, ICI 1,600 Gbps, 4 ports, 2D torus; per host 2 x 100 Gbps NIC for 8 chips.
    "v5e": Chip("v5e", 16 * GB, 197e12, 1600e9 / 8, 4, 2 * 100e9 / 8 / 8, 2, 256, None,
                "https://cloud.google.com/tpu/docs/v6e (v5e column), /tpu/docs/v5e"),
    # https://cloud.google.com/tpu/docs/v5p-training: 459 TFLOP/s bf16, 95 GiB HBM, ICI 1,200
    # GB/s bidirectional per chip, 3D torus (6 ports), DCN 50 Gbps per chip.
    "v5p": Chip("v5p", 95 * GiB, 459e12, 1200e9, 6, 50e9 / 8, 3, 6144, "megacore",
                "https://cloud.google.com/tpu/docs/v5p-training"),
    # https://cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM, ICI 3,584 Gbps,
    # 4 ports, 2D torus; per host 4 x 200 Gbps NIC for 8 chips.
    "v6e": Chip("v6e", 32 * GB, 918e12, 3584e9 / 8, 4, 4 * 200e9 / 8 / 8, 2, 256, None,
                "https://cloud.google.com/tpu/docs/v6e"),
}

# Slice shapes by generation, named `GEN:AxBxC` as libtpu takes them (the common single-slice
# shapes of each generation's documentation page).
TOPOLOGIES: dict[str, tuple[str, ...]] = {
    "v4": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16"),
    "v5e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16",
            "8x16x16", "16x16x16", "16x16x24"),
    "v6e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
}


def known_topologies() -> list[str]:
    return [f"{gen}:{shape}" for gen, shapes in TOPOLOGIES.items() for shape in shapes]
