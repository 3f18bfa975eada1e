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

from jaxscale.errors import ConversionError, paragraph

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


def packed_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...] | None]:
    """{suffix: shape} of the blocks and scales that store a dequantised (..., 32 G, rows)
    tensor of `shape` (None each where `shape` is unknown or not a whole number of blocks:
    then the blocks and scales are checked against each other only)."""
    if len(shape) < 2 or shape[-2] % 32:
        return {BLOCKS: None, SCALES: None}
    scales = (*shape[:-2], shape[-1], shape[-2] // 32)
    return {BLOCKS: (*scales, 16), SCALES: scales}


def stored_shapes(reader: Any, name: str, shape: tuple[int, ...] | None
                  ) -> dict[str, tuple[int, ...] | None]:
    """{stored tensor: the shape it must have} for tensor `name` of `shape` (None: unknown):
    `name` itself, or its MXFP4 blocks and scales, which must also agree with each other."""
    if not isinstance(reader, Mxfp4Reader) or name in reader._reader:
        return {name: shape}
    want = packed_shapes(shape) if shape is not None else {BLOCKS: None, SCALES: None}
    if shape is not None and want[SCALES] is None:
        raise ConversionError(paragraph(
            f"{reader.file_of(name + BLOCKS)}: tensor {name} is stored in MXFP4 blocks of 32",
            f"values, but config.json implies the shape {shape}, whose axis {len(shape) - 2}",
            "is not a multiple of 32: the checkpoint and its config.json disagree. Pair the",
            "safetensors with their own config.json. Nothing was written."))
    if want[SCALES] is None:  # the scales are the blocks' shape less their 16 bytes
        blocks = tuple(reader.get_slice(name + BLOCKS).get_shape())
        want = {BLOCKS: (*blocks[:-1], 16), SCALES: blocks[:-1]}
    return {name + suffix: s for suffix, s in want.items()}


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
