"""MXFP4 expert weights of the published GPT-OSS checkpoints, dequantised on import.

openai/gpt-oss-20b and -120b store each layer's `mlp.experts.gate_up_proj` and `down_proj` as
`*_blocks` (uint8, two 4-bit values a byte, 16 bytes = 32 values a block) and `*_scales` (uint8,
one power-of-two exponent a block, biased by 127), over the tensor's last axis, rows first:
blocks (X, rows, G, 16) and scales (X, rows, G) hold the (X, rows, 32 G) matrix whose transpose
(X, 32 G, rows) is the bf16 tensor transformers' modeling uses. A 4-bit value is an FP4 (E2M1)
code: sign, then one of 0, 0.5, 1, 1.5, 2, 3, 4, 6; the low nibble is the earlier value.

Why dequantise rather than train in MXFP4: jaxscale fine-tunes in bf16 / f32 (an optimizer step
on 4-bit codes would lose nearly every update), and every FP4 value times a power of two is
exact in bf16, so the import is exactly transformers' `dequantize=True` load, which the tests
compare against (`convert_moe_packed_tensors`). Exports write the dequantised tensors: a
fine-tuned model is no longer on the MXFP4 grid.

`mxfp4_reader` wraps a checkpoint reader so that a dequantised name reads its blocks and
scales: the GPT-OSS leaf table (`hf_gpt_oss.py`) stays the same for both kinds of checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 (..., 32 G, rows) of MXFP4 `blocks` (..., rows, G, 16) and `scales`
    (..., rows, G): each byte's low then high nibble, times 2^(scale - 127), transposed."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} disagree: the "
                         "blocks must be the scales' shape plus 16 bytes.")
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)
    values = values.reshape(*scales.shape, -1)                       # (..., rows, G, 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(*scales.shape[:-1], -1), -1, -2)


class Mxfp4Reader:
    """A checkpoint reader where `name` may be stored as `name_blocks` + `name_scales`."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    def __contains__(self, key: str) -> bool:
        return key in self._reader or key + BLOCKS in self._reader

    def keys(self) -> list[str]:
        keys = [k for k in self._reader.keys() if not k.endswith((BLOCKS, SCALES))]
        return keys + [k.removesuffix(BLOCKS) for k in self._reader.keys() if k.endswith(BLOCKS)]

    def get(self, key: str) -> np.ndarray:
        if key in self._reader or key + BLOCKS not in self._reader:
            return self._reader.get(key)
        return dequantize(self._reader.get(key + BLOCKS), self._reader.get(key + SCALES))

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return getattr(self._reader, name)


def mxfp4_reader(reader: Any) -> Any:
    """`reader` itself when it holds no MXFP4 tensor, else a `Mxfp4Reader` over it."""
    return Mxfp4Reader(reader) if any(k.endswith(BLOCKS) for k in reader.keys()) else reader
