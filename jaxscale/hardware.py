"""Hardware facts: peak FLOP/s per device kind, with where each number comes from.

One table per fact: MFU (`jaxscale.observe.metrics`), the presets and the planner read the
peaks here, never a copy of their own.
"""

from __future__ import annotations

# Dense (no sparsity) bf16 peak FLOP/s per device, i.e. per chip for TPUs and per GPU, and where
# each number comes from (`PEAK_SOURCES`, same keys; the run banner prints the one it uses).
PEAK_FLOPS: dict[str, float] = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "A100": 312e12,
    "H100": 989e12,
    "H100 PCIe": 756e12,
    "H200": 989e12,
}
_V5E = "https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16 per chip)"
_V5P = "https://cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16 per chip)"
_V6E = "https://cloud.google.com/tpu/docs/v6e (Trillium, 918 TFLOP/s bf16 per chip)"
_H100 = "NVIDIA H100 datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity / 2"
PEAK_SOURCES: dict[str, str] = {
    "TPU v4": "https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16 per chip)",
    "TPU v5 lite": _V5E, "TPU v5e": _V5E,
    "TPU v5p": _V5P, "TPU v5": _V5P,
    "TPU v6 lite": _V6E, "TPU v6e": _V6E,
    "A100": "NVIDIA A100 datasheet, BF16 Tensor Core dense (SXM and PCIe alike): 312 TFLOPS",
    "H100": _H100,
    "H100 PCIe": "NVIDIA H100 datasheet, PCIe: BF16 Tensor Core 1,513 TFLOPS with sparsity / 2",
    "H200": "NVIDIA H200 datasheet: the H100 SXM's compute (989 TFLOPS dense bf16), more HBM",
}


def _peak_key(device_kind: str) -> str | None:
    kind = device_kind.lower()
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
        if name.lower() in kind:
            return name
    return None


def peak_flops_source(device_kind: str) -> str | None:
    """Where the peak used for `device_kind` comes from (None when it has no known peak)."""
    key = _peak_key(device_kind)
    return f"{key}: {PEAK_SOURCES[key]}" if key else None


def peak_flops(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s for a jax `device.device_kind` string; None for CPUs and unknown kinds.

    Matching is by case-insensitive substring, longest key first, so 'TPU v5 lite' wins over
    'TPU v5' and 'NVIDIA H100 PCIe' over 'H100', while vendor strings such as
    'NVIDIA H100 80GB HBM3' or 'NVIDIA A100-SXM4-80GB' need no entry of their own. Returning
    None (rather than guessing) keeps a bogus MFU out of the logs on hardware we do not know.
    """
    key = _peak_key(device_kind)
    return PEAK_FLOPS[key] if key else None
