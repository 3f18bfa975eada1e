"""FP8 block-quantised weights of the published DeepSeek-V3 checkpoints, dequantised on import.

deepseek-ai/DeepSeek-V3 (and R1, V3.1) store every linear weight but the embedding, the head
and the routers as float8_e4m3fn with a float32 `{name}_scale_inv` beside it: one scale per
block of `weight_block_size` (128 x 128) of the (out, in) matrix, the last block of a row or
column cut short where a width is not a multiple of 128 (e.g. 7168 / 128 = 56 exactly, but
kv_a_proj_with_mqa's 576 rows are 4.5 blocks: 5 scale rows). config.json says so in
`quantization_config` (`quant_method` fp8, `fmt` e4m3, `weight_block_size`). The weight is
w_fp8 x scale_inv of its block, computed in float32 (an FP8 value times a float32 scale is
exact there), then cast by the import to the run's dtype (bf16, float32, ...), as transformers'
`dequantize=True` load computes it (`_dequantize_fp8_weight`, which the tests compare against).

Why dequantise: jaxscale trains in bf16 / f32, and an exported fine-tune is no longer on the FP8
grid, so exports write the dequantised tensors (no `quantization_config`). `fp8_reader` wraps a
checkpoint reader so that a weight name reads dequantised: the DeepSeek leaf tables stay the
same for both kinds of checkpoint. A scale of the wrong shape is refused, naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxscale.errors import ConversionError, paragraph

SCALE = "_scale_inv"


def block_size(hf: Mapping[str, Any], where: str) -> tuple[int, int] | None:
    """The (rows, cols) block of a config.json's FP8 `quantization_config`; None without one.
    Another quantisation is refused in one paragraph."""
    q = hf.get("quantization_config")
    if not q:
        return None
    block = q.get("weight_block_size")
    if (q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3"
            or not (isinstance(block, (list, tuple)) and len(block) == 2
                    and all(isinstance(b, int) and b > 0 for b in block))):
        raise ConversionError(paragraph(
            f"{where}: quantization_config={dict(q)!r} is not the fine-grained FP8 of the",
            "published DeepSeek-V3 checkpoints (quant_method fp8, fmt e4m3, weight_block_size",
            "[128, 128]), the one quantisation this converter dequantises. Convert an FP8 or a",
            "bf16 checkpoint."))
    return int(block[0]), int(block[1])


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int],
               name: str = "weight") -> np.ndarray:
    """float32 (rows, cols) of an FP8 `weight` times the `scale_inv` of its `block`-sized
    block (the last blocks of a row or column cut short)."""
    rows, cols = weight.shape[-2:]
    want = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != want:
        raise ConversionError(paragraph(
            f"Tensor {name}{SCALE} has shape {tuple(scale_inv.shape)}, but {name}",
            f"{tuple(weight.shape)} in blocks of {block[0]} x {block[1]} (config.json's",
            f"weight_block_size) needs {want}, one scale per block. The scale and the weight",
            "disagree: the file is corrupt, or config.json's weight_block_size is not the",
            "checkpoint's. Fetch the matching files. Nothing was written."))
    scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=-2),
                      block[1], axis=-1)[..., :rows, :cols]
    return np.asarray(weight).astype(np.float32) * scale


class Fp8Reader:
    """A checkpoint reader whose FP8 weights (those with a `name_scale_inv`) read dequantised."""

    def __init__(self, reader: Any, block: tuple[int, int]) -> None:
        self._reader, self.block = reader, block

    def keys(self) -> list[str]:
        return [k for k in self._reader.keys() if not k.endswith(SCALE)]

    def get(self, key: str) -> np.ndarray:
        arr = self._reader.get(key)
        if key + SCALE not in self._reader:
            return arr
        return dequantize(arr, self._reader.get(key + SCALE), self.block, key)

    def __contains__(self, key: str) -> bool:
        return key in self._reader

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return getattr(self._reader, name)


def fp8_reader(reader: Any, hf: Mapping[str, Any], where: str) -> Any:
    """`reader` itself for an unquantised checkpoint, else an `Fp8Reader` over it."""
    block = block_size(hf, where)
    return reader if block is None else Fp8Reader(reader, block)
