"""The one hardware table: per chip (a TPU chip, a GPU), peak compute, memory and link bandwidths,
with where each number comes from.

MFU (`jaxscale.observe.metrics` through `peak_flops`), the Llama presets' hardware targets
(`configs/llama.py`) and ahead-of-time compilation (`jaxscale.aot`: topologies, the compile
report's fit, the roofline estimate, the planner's HBM budget) all read `CHIPS`; none keeps a
number of its own. Capacities are bytes, bandwidths bytes per second, all per chip (per GPU). A
field is None where no public figure is known: nothing estimates with a guess.

`usable_hbm_bytes` is what the TPU compiler lets one program use, which is not the documented
capacity (v4: less; v5e, v5p, v6e: more than the decimal "GB" the documentation prints). libtpu
prints it in its compile-time out-of-memory error (`available HBM (31.24G)`, GiB), and
tests/test_hardware.py asks the installed libtpu for it, so the table cannot drift from it.
What fits is judged against it (`fits`, with `HBM_MARGIN` of it left free): by the planner, the
compile report and the TPU presets alike.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """One accelerator's facts. `device_kinds` are the substrings of jax's `device.device_kind`
    that name it ('TPU v5 lite' is a v5e); `generation` is libtpu's topology prefix for TPUs."""

    device_kinds: tuple[str, ...]
    peak_bf16_flops: float               # dense (no sparsity) bf16 FLOP/s
    hbm_bytes: float | None              # documented HBM capacity (None: it varies by model)
    source: str                          # where the numbers come from (the run banner prints it)
    usable_hbm_bytes: float | None = None  # what libtpu lets a program use (TPUs)
    ici_bidir_bytes_s: float | None = None  # chip-to-chip links, all ports, both ways (NVLink)
    ici_ports: int | None = None         # inter-chip links of a TPU chip
    dcn_bytes_s: float | None = None     # data-centre network (between TPU slices)
    host_bytes_s: float | None = None    # host <-> device (PCIe), both ways
    generation: str | None = None        # TPUs: libtpu's name, 'v5p' in 'v5p:2x2x1'
    torus_dims: int | None = None        # TPUs: 2 (v5e, v6e) or 3 (v4, v5p)
    max_chips: int | None = None         # TPUs: the largest single slice
    chip_config: str | None = None       # TPUs: libtpu chip_config_name ('megacore': 1 device)
    # Dense int8 x int8 ops/s (the `int8` precision policy's matmuls, `aot.roofline`); None: no
    # public figure. A datasheet rate: an ESTIMATE of what quantized training reaches.
    peak_int8_ops: float | None = None
    # HBM bandwidth, bytes/s, from the datasheet: what bounds decoding, which reads every weight
    # and the KV cache for each new token (`aot/decode.py`); None: no single figure.
    hbm_bytes_s: float | None = None

    @property
    def name(self) -> str:
        return self.device_kinds[0]

    @property
    def hbm_limit_bytes(self) -> float | None:
        """The HBM a program may fill: the compiler's own limit where known, else the capacity."""
        return self.usable_hbm_bytes or self.hbm_bytes

    @property
    def ring_bandwidth(self) -> float:
        """Bytes/s one TPU chip moves along a bidirectional ring over one mesh axis: the two
        links of that axis (one per neighbour), each carrying data both ways: bidirectional ICI
        per chip x 2 links / ports."""
        if self.ici_bidir_bytes_s is None or not self.ici_ports:
            raise ValueError(f"{self.name}: no ICI bandwidth and port count in the hardware table")
        return self.ici_bidir_bytes_s * 2 / self.ici_ports


# The share of a chip's usable HBM (`Chip.hbm_limit_bytes`, or a live device's limit) that a step
# must leave free to count as fitting: headroom for what the compiler's count of one step does not
# hold (the runtime's own buffers, fragmentation, a libtpu that needs a little more). The
# planner's default (`jaxscale plan --hbm_margin`) and what the TPU presets were sized with.
HBM_MARGIN = 0.1


def hbm_budget(usable_bytes: float, margin: float = HBM_MARGIN) -> float:
    """The bytes per chip a step may fill on a chip that lets a program use `usable_bytes`."""
    return usable_bytes * (1 - margin)


def fits(total_bytes: float, usable_bytes: float, margin: float = HBM_MARGIN) -> bool:
    """Whether a step needing `total_bytes` per chip fits a chip that lets a program use
    `usable_bytes`, leaving `margin` of it free (0: whether the compiler accepts it at all)."""
    return total_bytes <= hbm_budget(usable_bytes, margin)


_LIBTPU = "usable HBM: libtpu 0.0.52's CompileTimeHbmOom, 'available HBM ({}G)'"
# TPU host <-> HBM: no datasheet publishes it. "How to Scale Your Model" (jax-ml.github.io/
# scaling-book/tpus, "PCIe bandwidth ... around 1.5e10 bytes/s per TPU", its v5e / v6e figure,
# one way) is used for every TPU generation here: an ESTIMATE, both ways 2 x 1.5e10.
TPU_HOST_BYTES_S = 2 * 1.5e10
_NVIDIA = "NVLink and PCIe (both ways) from the same datasheet; HBM in binary units, as stacks are"

CHIPS: dict[str, Chip] = {
    # ICI 2,400 Gbps per chip as compared on the v5p page. No DCN figure is published for v4:
    # the v5p one (50 Gbps per chip) is assumed.
    "v4": Chip(("TPU v4",), 275e12, 32 * GiB,
               "https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB HBM2, 6 ICI links "
               "per chip); ICI 2,400 Gbps and DCN (v5p's, assumed) from "
               "https://cloud.google.com/tpu/docs/v5p; " + _LIBTPU.format("30.75"),
               usable_hbm_bytes=30.75 * GiB, ici_bidir_bytes_s=2400e9 / 8, ici_ports=6,
               dcn_bytes_s=50e9 / 8,
               host_bytes_s=TPU_HOST_BYTES_S, generation="v4", torus_dims=3, max_chips=4096,
               chip_config="megacore",
               # int8: the v4 page's "275 teraflops (bf16 or int8)": no faster than bf16
               peak_int8_ops=275e12,
               hbm_bytes_s=1200e9),  # the v4 page: HBM2 bandwidth 1,200 GBps
    # Per host 2 x 100 Gbps NICs for 8 chips.
    "v5e": Chip(("TPU v5 lite", "TPU v5e"), 197e12, 16 * GB,
                "https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16 per chip, 16 GB HBM); "
                "ICI 1,600 Gbps, 4 ports, NICs: the v5e column of "
                "https://cloud.google.com/tpu/docs/v6e; " + _LIBTPU.format("15.75"),
                usable_hbm_bytes=15.75 * GiB, ici_bidir_bytes_s=1600e9 / 8, ici_ports=4,
                dcn_bytes_s=2 * 100e9 / 8 / 8,
                host_bytes_s=TPU_HOST_BYTES_S, generation="v5e", torus_dims=2, max_chips=256,
                # int8: "Peak compute per chip (Int8) 393 TOPs", cloud.google.com/tpu/docs/v5e
                peak_int8_ops=393e12,
                hbm_bytes_s=819e9),  # the v5e page: HBM2 bandwidth 819 GBps
    "v5p": Chip(("TPU v5p", "TPU v5"), 459e12, 95 * GiB,
                "https://cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16 per chip); 95 GiB HBM, "
                "ICI 1,200 GB/s both ways per chip, 3D torus, DCN 50 Gbps per chip: "
                "https://cloud.google.com/tpu/docs/v5p-training; " + _LIBTPU.format("95.73"),
                usable_hbm_bytes=95.73 * GiB, ici_bidir_bytes_s=1200e9, ici_ports=6,
                dcn_bytes_s=50e9 / 8,
                host_bytes_s=TPU_HOST_BYTES_S, generation="v5p", torus_dims=3, max_chips=6144,
                chip_config="megacore",
                # int8: 918 TOPs (twice bf16), the v5p launch post, cloud.google.com/blog/
                # products/ai-machine-learning/introducing-cloud-tpu-v5p-and-ai-hypercomputer
                peak_int8_ops=918e12,
                hbm_bytes_s=2765e9),  # the v5p page: HBM2e bandwidth 2,765 GBps
    # Per host 4 x 200 Gbps NICs for 8 chips.
    "v6e": Chip(("TPU v6 lite", "TPU v6e"), 918e12, 32 * GB,
                "https://cloud.google.com/tpu/docs/v6e (Trillium, 918 TFLOP/s bf16 per chip, "
                "32 GB HBM, ICI 3,584 Gbps, 4 ports, 2D torus); " + _LIBTPU.format("31.24"),
                usable_hbm_bytes=31.24 * GiB, ici_bidir_bytes_s=3584e9 / 8, ici_ports=4,
                dcn_bytes_s=4 * 200e9 / 8 / 8,
                host_bytes_s=TPU_HOST_BYTES_S, generation="v6e", torus_dims=2, max_chips=256,
                # int8: "Peak compute per chip (Int8) 1836 TOPs", cloud.google.com/tpu/docs/v6e
                peak_int8_ops=1836e12,
                hbm_bytes_s=1640e9),  # the v6e page: HBM bandwidth 1,640 GBps
    "a100": Chip(("A100",), 312e12, None,
                 "NVIDIA A100 datasheet, BF16 Tensor Core dense (SXM and PCIe alike): 312 TFLOPS; "
                 "40 or 80 GB HBM by model; NVLink 600 GB/s, PCIe Gen4 64 GB/s (SXM)",
                 ici_bidir_bytes_s=600e9, host_bytes_s=64e9,
                 peak_int8_ops=624e12),  # datasheet INT8 Tensor Core, dense
    "h100": Chip(("H100",), 989e12, 80 * GiB,
                 "NVIDIA H100 datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity / 2; "
                 "80 GB HBM3; NVLink 900 GB/s, PCIe Gen5 128 GB/s. " + _NVIDIA,
                 ici_bidir_bytes_s=900e9, host_bytes_s=128e9,
                 peak_int8_ops=1979e12,  # datasheet INT8 3,958 TOPS with sparsity / 2
                 hbm_bytes_s=3.35e12),  # datasheet, SXM: 3.35 TB/s
    "h100-pcie": Chip(("H100 PCIe",), 756e12, 80 * GiB,
                      "NVIDIA H100 datasheet, PCIe: BF16 Tensor Core 1,513 TFLOPS with sparsity "
                      "/ 2; 80 GB HBM2e; NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s. " + _NVIDIA,
                      ici_bidir_bytes_s=600e9, host_bytes_s=128e9,
                      peak_int8_ops=1513e12,  # datasheet INT8 3,026 TOPS with sparsity / 2
                      hbm_bytes_s=2.0e12),  # datasheet, PCIe: 2 TB/s
    "h200": Chip(("H200",), 989e12, 141 * GiB,
                 "NVIDIA H200 datasheet, SXM: the H100 SXM's compute (989 TFLOPS dense bf16), "
                 "141 GB HBM3e; NVLink 900 GB/s, PCIe Gen5 128 GB/s. " + _NVIDIA,
                 ici_bidir_bytes_s=900e9, host_bytes_s=128e9,
                 peak_int8_ops=1979e12,  # the H100 SXM's INT8 (3,958 TOPS sparse / 2)
                 hbm_bytes_s=4.8e12),  # datasheet: 4.8 TB/s
}

# TPU chips by libtpu generation name ('v5p'), for topologies such as 'v5p:2x2x1'.
TPUS: dict[str, Chip] = {c.generation: c for c in CHIPS.values() if c.generation}

# Views of the table by device kind, for MFU and the run banner (no numbers of their own).
PEAK_FLOPS: dict[str, float] = {
    kind: c.peak_bf16_flops for c in CHIPS.values() for kind in c.device_kinds}
PEAK_SOURCES: dict[str, str] = {kind: c.source for c in CHIPS.values() for kind in c.device_kinds}
_BY_KIND: dict[str, Chip] = {kind: c for c in CHIPS.values() for kind in c.device_kinds}


def _kind_key(device_kind: str) -> str | None:
    kind = device_kind.lower()
    for name in sorted(_BY_KIND, key=len, reverse=True):
        if name.lower() in kind:
            return name
    return None


def chip_of(device_kind: str) -> Chip | None:
    """The table entry for a jax `device.device_kind` string; None for CPUs and unknown kinds.

    Matching is by case-insensitive substring, longest key first, so 'TPU v5 lite' wins over
    'TPU v5' and 'NVIDIA H100 PCIe' over 'H100', while vendor strings such as
    'NVIDIA H100 80GB HBM3' or 'NVIDIA A100-SXM4-80GB' need no entry of their own.
    """
    key = _kind_key(device_kind)
    return _BY_KIND[key] if key else None


def peak_flops_source(device_kind: str) -> str | None:
    """Where the peak used for `device_kind` comes from (None when it has no known peak)."""
    key = _kind_key(device_kind)
    return f"{key}: {PEAK_SOURCES[key]}" if key else None


def peak_flops(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s for a jax `device.device_kind` string; None for CPUs and unknown kinds
    (rather than a guess, which would put a bogus MFU in the logs)."""
    chip = chip_of(device_kind)
    return chip.peak_bf16_flops if chip else None
