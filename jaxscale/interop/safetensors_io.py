"""The safetensors file format, read lazily and written streaming, without torch.

Layout: 8-byte little-endian header size, a JSON header {name: dtype, shape, data_offsets},
then raw little-endian data. Reading memory-maps each tensor on demand (nothing is read until
a slice of it is used), so a converter can copy one shard of one tensor at a time. Writing
takes (name, shape, dtype) specs plus a stream of arrays, so only one array is on the host at
a time; with `max_shard_bytes` it splits the tensors over `model-0000i-of-0000n.safetensors`
files and writes the `model.safetensors.index.json` that Hugging Face loaders follow.
bfloat16 and float8 map to `ml_dtypes`, so no PyTorch is needed.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

from jaxscale.errors import JaxscaleError, paragraph

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class ConversionError(JaxscaleError):
    """A Hugging Face checkpoint cannot be converted faithfully."""


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32, "I16": np.int16,
           "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
           "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
# `--dtype` spellings -> numpy dtype names (the storage dtypes that make sense for weights).
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                 "f16": "float16", "half": "float16", "float16": "float16", "fp32": "float32",
                 "f32": "float32", "float": "float32", "float32": "float32"}


def parse_dtype(name: Any) -> np.dtype | None:
    """A dtype from a user's spelling ('bf16', 'fp16', 'float32', a numpy dtype); None -> None.

    Raises a ConversionError listing the accepted names, rather than numpy's bare TypeError.
    """
    if name is None or (isinstance(name, str) and not name.strip()):
        return None
    key = name.strip().lower() if isinstance(name, str) else np.dtype(name).name
    if key not in DTYPE_ALIASES:
        raise ConversionError(paragraph(
            f"dtype {name!r} is not supported for checkpoints. Use one of",
            f"{', '.join(sorted(DTYPE_ALIASES))} (e.g. --dtype=bf16), or leave it unset to keep",
            "the stored dtype.",
        ))
    target = DTYPE_ALIASES[key]
    return np.dtype(ml_dtypes.bfloat16) if target == "bfloat16" else np.dtype(target)


def parse_size(size: int | str | None) -> int | None:
    """Bytes from 2000000, '20KB', '5GB' or '500MiB' (the spellings of `max_shard_size`)."""
    if size is None or isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", size, re.IGNORECASE)
    if not m:
        raise ConversionError(f"max_shard_size={size!r}: give bytes or a size like '5GB', "
                              "'500MB' or '2GiB'.")
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def _header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConversionError(f"{path} is not a safetensors file (unreadable header); "
                                  "re-save the model with `save_pretrained`.") from None
    header.pop("__metadata__", None)
    return 8 + size, header


def _files(directory: str) -> list[str]:
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in files if not os.path.exists(os.path.join(directory, n))]
        if missing:
            raise ConversionError(paragraph(
                f"{index} names shard file(s) {missing[:3]} that are not in {directory}. The",
                "download or copy is incomplete: fetch every model-*.safetensors file.",
            ))
        return files
    if os.path.exists(os.path.join(directory, SINGLE)):
        return [SINGLE]
    raise ConversionError(paragraph(
        f"{directory} holds neither {SINGLE} nor {INDEX}.",
        "Point at a Hugging Face model directory saved with `save_pretrained`",
        "(safetensors; PyTorch .bin files are not read because they are pickles).",
    ))


class SafetensorsReader:
    """Lazy reader over one checkpoint directory (single file or sharded with an index)."""

    def __init__(self, directory: str):
        self.entries: dict[str, tuple[str, int, dict]] = {}
        for name in _files(directory):
            path = os.path.join(directory, name)
            base, header = _header(path)
            for key, info in header.items():
                self.entries[key] = (path, base, info)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> np.ndarray:
        """A read-only memory map of tensor `key` (bytes are read only when sliced)."""
        if key not in self.entries:
            raise ConversionError(paragraph(
                f"Tensor {key!r} is missing from the checkpoint (it has {len(self.entries)}",
                f"tensors, e.g. {sorted(self.entries)[:3]}). The checkpoint does not match its",
                "config.json, or it is not a checkpoint of this model family.",
            ))
        path, base, info = self.entries[key]
        if info.get("dtype") not in _DTYPES:
            raise ConversionError(paragraph(
                f"Tensor {key!r} in {path} has safetensors dtype {info.get('dtype')!r}, which",
                f"this reader does not know (it reads {', '.join(_DTYPES)}). Re-save the",
                "checkpoint in float32, float16 or bfloat16 (e.g. `model.to(torch.bfloat16)",
                ".save_pretrained(DIR)`).",
            ))
        dtype = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == start:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=shape)


Spec = tuple[str, tuple[int, ...], np.dtype]


def _nbytes(spec: Spec) -> int:
    return math.prod(spec[1]) * np.dtype(spec[2]).itemsize


def _write_file(path: str, specs: list[Spec], arrays: Iterator[np.ndarray]) -> None:
    arrays = iter(arrays)
    header, offset = {}, 0
    for key, shape, dtype in specs:
        header[key] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                       "data_offsets": [offset, offset + _nbytes((key, shape, dtype))]}
        offset = header[key]["data_offsets"][1]
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for key, shape, dtype in specs:
            arr = next(arrays, None)
            if arr is None:
                raise ConversionError(f"{path}: the array stream ended before {key!r}; the "
                                      "file would be truncated.")
            if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
                raise ConversionError(f"{key}: expected {shape} {dtype}, got {arr.shape} "
                                      f"{arr.dtype} while writing {path}.")
            f.write(np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())


def write_safetensors(path: str, specs: list[Spec], arrays: Iterator[np.ndarray]) -> None:
    """Writes one safetensors file from specs and a stream of arrays in the same order."""
    arrays = iter(arrays)
    _write_file(path, specs, arrays)
    if next(arrays, None) is not None:
        raise ConversionError(f"More arrays than the {len(specs)} specs while writing {path}.")


def group_shards(specs: list[Spec], max_bytes: int) -> list[list[Spec]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor gets a file of its own)."""
    groups: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        if groups[-1] and size + _nbytes(spec) > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += _nbytes(spec)
    return groups


def write_checkpoint_files(out_dir: str, specs: list[Spec], arrays: Iterator[np.ndarray],
                           max_shard_size: int | str | None = None) -> list[str]:
    """`model.safetensors`, or shards + `model.safetensors.index.json` beyond `max_shard_size`.

    Returns the file names written. Stale files of the other layout are removed, since a loader
    prefers the index when both exist.
    """
    limit = parse_size(max_shard_size)
    groups = group_shards(specs, limit) if limit else [specs]
    arrays = iter(arrays)
    for stale in os.listdir(out_dir):
        if stale in (SINGLE, INDEX) or re.fullmatch(r"model-\d+-of-\d+\.safetensors", stale):
            os.remove(os.path.join(out_dir, stale))
    if len(groups) == 1:
        write_safetensors(os.path.join(out_dir, SINGLE), specs, arrays)
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for name, group in zip(names, groups):
        _write_file(os.path.join(out_dir, name), group, arrays)
    weight_map = {spec[0]: name for name, group in zip(names, groups) for spec in group}
    index = {"metadata": {"total_size": sum(map(_nbytes, specs))}, "weight_map": weight_map}
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump(index, f, indent=2)
    return names + [INDEX]
