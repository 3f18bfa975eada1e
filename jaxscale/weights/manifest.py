"""Schema of a snapshot manifest: every field a hostile or broken writer controls is checked here.

A manifest (`snapshot.py`: a params export, a Lo-Fi push or average) is JSON written by another
machine, so nothing in it is trusted: before any array is
opened, its leaf paths must be plain relative paths (no `..`), shapes small non-negative ints,
dtypes from a fixed list, `samples_seen` a finite non-negative integer (it weights the average)
and rounds/steps non-negative integers. A failed check raises `StoreError` naming the
snapshot, the field and the fix. The data itself is checked by tensorstore: every array chunk
carries a zarr3 `crc32c` checksum, verified on read (`kv.py`).
"""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np

from jaxscale.errors import JaxscaleError, paragraph

# 2: arrays checksummed by zarr3's crc32c codec, COMMIT markers under `commits/` (format 1
# kept per-chunk sums in the manifest and COMMIT beside the data; it is not read any more).
FORMAT = 2
# Values per stored chunk (1 MiB of float32), recorded in each manifest: few enough files or
# bucket objects per snapshot, small enough to stream in bounded memory.
CHUNK = 1 << 18
MAX_INT = 1 << 62          # bound for steps, samples and sizes (JSON ints are unbounded)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
          "int8": np.int8, "int32": np.int32}
_LEAF_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
KINDS = ("worker", "average", "params")


class StoreError(JaxscaleError):
    """A snapshot in the store is partial, corrupt or does not match what was expected."""


def check_leaf_path(leaf: Any, where: str) -> None:
    if not isinstance(leaf, str) or not _LEAF_RE.match(leaf) or ".." in leaf.split("/"):
        raise StoreError(paragraph(
            f"{where}: leaf path {leaf!r} is not a plain relative path (it is absolute, empty or",
            "contains '..'), so it could escape the store. The snapshot is rejected.",
        ))


def chunk_of(m: dict) -> int:
    """Values per chunk of a (validated) manifest's arrays."""
    return m["chunk"]


def _bad(where: str, field: str, value: Any, expected: str) -> StoreError:
    shown = repr(value)
    shown = shown if len(shown) < 80 else shown[:77] + "..."
    return StoreError(paragraph(
        f"{where}: manifest field {field} = {shown}, expected {expected}. The manifest was",
        "written by a broken or hostile writer, so this snapshot is rejected; re-push it",
        "from a healthy worker.",
    ))


def _int(m: dict, key: str, where: str, optional: bool = False) -> None:
    value = m.get(key)
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_INT:
        raise _bad(where, key, value, "a non-negative integer")


def _leaf(leaf: str, e: Any, where: str) -> None:
    check_leaf_path(leaf, where)
    field = f"leaves[{leaf!r}]"
    if not isinstance(e, dict):
        raise _bad(where, field, e, "an object")
    shape = e.get("shape")
    if (not isinstance(shape, list) or len(shape) > 8 or any(
            isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < MAX_INT for d in shape)
            or int(np.prod(shape, dtype=object)) >= MAX_INT):
        raise _bad(where, f"{field}.shape", shape, "a list of at most 8 non-negative integers")
    if e.get("dtype") not in DTYPES:
        raise _bad(where, f"{field}.dtype", e.get("dtype"), f"one of {sorted(DTYPES)}")
    encoding = e.get("encoding")
    if encoding == "q8delta":
        _int(e, "base_round", f"{where} {field}")
    elif encoding != "raw":
        raise _bad(where, f"{field}.encoding", encoding, "'raw' or 'q8delta'")
    if not isinstance(e.get("momentum", False), bool):
        raise _bad(where, f"{field}.momentum", e["momentum"],
                   "true or false (whether DiLoCo momentum is stored)")


def validate_manifest(m: Any, where: str) -> dict:
    """Returns `m` if every field has the expected type and range, else raises StoreError."""
    if not isinstance(m, dict):
        raise _bad(where, "(top level)", m, "a JSON object")
    if m.get("format") != FORMAT:
        raise StoreError(paragraph(
            f"{where}: snapshot format {m.get('format')!r}, but this jaxscale reads format",
            f"{FORMAT} only (format 1 stores, with checksums in the manifest, are not read any",
            "more). Write the store with one jaxscale version: upgrade the older writer, or",
            "start a new store.",
        ))
    chunk = m.get("chunk")
    if (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk & (chunk - 1)
            or not 1 << 10 <= chunk <= 1 << 24):
        raise _bad(where, "chunk", chunk, "a power of two from 1024 to 16777216 (values)")
    if m.get("kind") not in KINDS:
        raise _bad(where, "kind", m.get("kind"), f"one of {KINDS}")
    _int(m, "step", where)
    _int(m, "samples_seen", where)
    for key in ("round", "base_round", "synced_round", "worker_id"):
        _int(m, key, where, optional=True)
    if "data" in m and not (isinstance(m["data"], str) and _NAME_RE.match(m["data"])):
        raise _bad(where, "data", m["data"], "a plain directory name")
    contributors = m.get("contributors", {})
    if not isinstance(contributors, dict) or not all(
            isinstance(k, str) and k.isdigit() and isinstance(v, int) and not isinstance(v, bool)
            and 0 <= v < MAX_INT for k, v in contributors.items()):
        raise _bad(where, "contributors", contributors, "an object {worker id: step}")
    leaves = m.get("leaves")
    if not isinstance(leaves, dict) or not leaves:
        raise _bad(where, "leaves", leaves, "a non-empty object {leaf path: entry}")
    for leaf, entry in leaves.items():
        _leaf(leaf, entry, where)
    return m
