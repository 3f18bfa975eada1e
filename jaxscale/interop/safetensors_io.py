"""Hugging Face safetensors checkpoints: read with the `safetensors` library, written streaming.

Reading uses `safetensors.safe_open` (headers validated up front, tensors read on demand, so a
converter copies one tensor at a time). Writing is what the library lacks: `save_file` wants
every tensor in memory at once, while `write_checkpoint_files` takes (name, shape, dtype) specs
plus a stream of arrays, so only one array is on the host at a time; past `max_shard_size` it
splits the tensors over `model-0000i-of-0000n.safetensors` files and writes the
`model.safetensors.index.json` that Hugging Face loaders follow. The file layout: 8-byte
little-endian header size, a JSON header {name: dtype, shape, data_offsets}, raw
little-endian data. bfloat16 and float8 map to `ml_dtypes`, so no PyTorch is needed.
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
from safetensors import SafetensorError, safe_open

from jaxscale.errors import ConversionError, paragraph

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


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


def _files(directory: str) -> list[str]:
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConversionError(paragraph(
                f"{index} is not a readable safetensors index ({type(e).__name__}: {e}). Re-save",
                "the model with `save_pretrained`, or remove the index to read a single",
                f"{SINGLE}.",
            )) from None
        missing = [n for n in files if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            raise ConversionError(paragraph(
                f"{index} names shard file(s) {missing[:3]} that are not in {directory}. The",
                "download or copy is incomplete: fetch every model-*.safetensors file.",
            ))
        return files
    if os.path.isfile(os.path.join(directory, SINGLE)):
        return [SINGLE]
    raise ConversionError(paragraph(
        f"{directory} holds neither {SINGLE} nor {INDEX}.",
        "Point at a Hugging Face model directory saved with `save_pretrained`",
        "(safetensors; PyTorch .bin files are not read because they are pickles).",
    ))


def _open(path: str) -> Any:
    """`safe_open` with its failures (a truncated file, a corrupt or absurd header) as one
    paragraph naming the file, instead of the library's bare `SafetensorError`."""
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError, MemoryError) as e:
        raise ConversionError(paragraph(
            f"{path} is not a readable safetensors file ({e}). It is truncated or corrupt (an",
            "interrupted download or copy?): fetch it again, or re-save the model with",
            "`save_pretrained`.",
        )) from None


class SafetensorsReader:
    """The tensors of one checkpoint directory (single file, or shards with an index), read
    with the `safetensors` library: headers are parsed up front, tensor bytes only on demand
    (`get` reads one tensor, `get_slice(key)[...]` only part of one)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._handles: dict[str, Any] = {}
        self._file_of: dict[str, str] = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # float8 reads (`_raw`)
        for name in _files(directory):
            path = os.path.join(directory, name)
            self._handles[path] = handle = _open(path)
            for key in handle.keys():
                self._file_of[key] = path

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def keys(self) -> list[str]:
        return list(self._file_of)

    def file_of(self, key: str) -> str:
        """The file holding tensor `key`."""
        return self._file_of.get(key, self.directory)

    def dtype(self, key: str) -> str:
        """The safetensors dtype name of tensor `key` ('F32', 'BF16', ...)."""
        return self._slice(key).get_dtype()

    def get_slice(self, key: str) -> Any:
        """A lazy view of tensor `key`: index it to read just that part."""
        return self._slice(key)

    def get(self, key: str) -> np.ndarray:
        """Tensor `key` as a host array in its stored dtype."""
        view = self._slice(key)
        if view.get_dtype() not in _DTYPES:
            raise ConversionError(paragraph(
                f"Tensor {key!r} in {self._file_of[key]} has safetensors dtype",
                f"{view.get_dtype()!r}, which this reader does not know (it reads",
                f"{', '.join(_DTYPES)}). Re-save the checkpoint in float32, float16 or bfloat16",
                "(e.g. `model.to(torch.bfloat16).save_pretrained(DIR)`).",
            ))
        try:
            if view.get_dtype().startswith("F8_"):  # numpy has no float8: the library fails
                return self._raw(key, _DTYPES[view.get_dtype()])
            arr = self._handles[self._file_of[key]].get_tensor(key)
        except (SafetensorError, OSError, MemoryError, KeyError, ValueError) as e:
            raise ConversionError(paragraph(
                f"Tensor {key!r} in {self._file_of[key]} cannot be read ({e}); the file is",
                "corrupt: fetch it again, or re-save the model with `save_pretrained`.",
            )) from None
        return np.asarray(arr).view(np.dtype(_DTYPES[view.get_dtype()]))

    def _raw(self, key: str, dtype: Any) -> np.ndarray:
        """Tensor `key` read at its header's byte offsets, for the dtypes (float8) the library's
        numpy reader cannot build: the bytes viewed as `dtype`. Each file's header is parsed
        once."""
        path = self._file_of[key]
        if path not in self._headers:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[path] = (8 + size, json.loads(f.read(size)))
        base, header = self._headers[path]
        start, end = header[key]["data_offsets"]
        with open(path, "rb") as f:
            f.seek(base + start)
            data = f.read(end - start)
        return np.frombuffer(data, np.uint8).view(dtype).reshape(header[key]["shape"])

    def _slice(self, key: str) -> Any:
        if key not in self._file_of:
            raise ConversionError(paragraph(
                f"Tensor {key!r} is missing from the checkpoint (it has {len(self._file_of)}",
                f"tensors, e.g. {sorted(self._file_of)[:3]}). The checkpoint does not match its",
                "config.json, or it is not a checkpoint of this model family.",
            ))
        return self._handles[self._file_of[key]].get_slice(key)


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
