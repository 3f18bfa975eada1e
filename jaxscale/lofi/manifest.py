"""Schema of a Lo-Fi manifest: every field a hostile or broken writer controls is checked here.

A manifest is JSON written by another machine, so nothing in it is trusted: before any array is
opened, its leaf paths must be plain relative paths (no `..`), shapes small non-negative ints,
dtypes from a fixed list, checksum lists of the right length, `samples_seen` a finite
non-negative integer (it weights the average) and rounds/steps non-negative integers. A failed
check raises `StoreError` naming the checkpoint, the field and the fix.
"""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np

from jaxscale.errors import JaxscaleError, paragraph

FORMAT = 1
# Values per stored chunk file (1 MiB of float32), recorded in each manifest. 4x the 64 Ki of
# stores written before (whose manifests say nothing): a quarter of the files or bucket objects
# per checkpoint, and tensorstore moves them faster (1.0-1.8 -> 1.65-2.1 GB/s in
# bench/averager.py's "ts copy", bench/RESULTS.md).
CHUNK = 1 << 18
LEGACY_CHUNK = 1 << 16
MAX_INT = 1 << 62          # bound for steps, samples and sizes (JSON ints are unbounded)
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
          "int8": np.int8, "int32": np.int32}
_LEAF_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
# Chunk checksum algorithms, by the hex digest they produce. They detect corruption (bit rot,
# truncated or swapped chunk files), not forgery: whoever writes a manifest writes its sums, so
# hostile data is stopped by validation and robust aggregation instead. xxh3_128 (~30 GB/s)
# replaced sha256 (~2 GB/s), which bounded the averager's speed; stores written before say
# nothing and are read as sha256.
DIGESTS = {"xxh3_128": re.compile(r"^[0-9a-f]{32}$"), "sha256": re.compile(r"^[0-9a-f]{64}$")}
CHECKSUM = "xxh3_128"
KINDS = ("worker", "average", "params")


class StoreError(JaxscaleError):
    """A checkpoint in the store is partial, corrupt or does not match what was expected."""


def check_leaf_path(leaf: Any, where: str) -> None:
    if not isinstance(leaf, str) or not _LEAF_RE.match(leaf) or ".." in leaf.split("/"):
        raise StoreError(paragraph(
            f"{where}: leaf path {leaf!r} is not a plain relative path (it is absolute, empty or",
            "contains '..'), so it could escape the store. The checkpoint is rejected.",
        ))


def n_chunks(size: int, chunk: int) -> int:
    return max(1, -(-size // chunk))


def chunk_of(m: dict) -> int:
    """Values per chunk of a (validated) manifest's arrays."""
    return m.get("chunk", LEGACY_CHUNK)


def _bad(where: str, field: str, value: Any, expected: str) -> StoreError:
    shown = repr(value)
    shown = shown if len(shown) < 80 else shown[:77] + "..."
    return StoreError(paragraph(
        f"{where}: manifest field {field} = {shown}, expected {expected}. The manifest was",
        "written by a broken or hostile writer, so this checkpoint is rejected; re-push it",
        "from a healthy worker.",
    ))


def _int(m: dict, key: str, where: str, optional: bool = False) -> None:
    value = m.get(key)
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_INT:
        raise _bad(where, key, value, "a non-negative integer")


def checksum_of(m: dict) -> str:
    """The chunk checksum algorithm a (validated) manifest uses."""
    return m.get("checksum", "sha256")


def _checksums(value: Any, count: int, where: str, field: str, algorithm: str) -> None:
    digest = DIGESTS[algorithm]
    if (not isinstance(value, list) or len(value) != count
            or not all(isinstance(s, str) and digest.match(s) for s in value)):
        raise _bad(where, field, value, f"a list of {count} {algorithm} hex digests")


def _leaf(leaf: str, e: Any, where: str, algorithm: str, chunk: int) -> None:
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
    size = int(np.prod(shape, dtype=object))
    encoding = e.get("encoding")
    if encoding == "q8delta":
        from jaxscale.quant import BLOCK
        _int(e, "base_round", f"{where} {field}")
        _checksums(e.get("scale_checksums"), n_chunks(-(-size // BLOCK), chunk), where,
                   f"{field}.scale_checksums", algorithm)
    elif encoding != "raw":
        raise _bad(where, f"{field}.encoding", encoding, "'raw' or 'q8delta'")
    _checksums(e.get("checksums"), n_chunks(size, chunk), where, f"{field}.checksums",
               algorithm)
    if "momentum_checksums" in e:
        _checksums(e["momentum_checksums"], n_chunks(size, chunk), where,
                   f"{field}.momentum_checksums", algorithm)


def validate_manifest(m: Any, where: str) -> dict:
    """Returns `m` if every field has the expected type and range, else raises StoreError."""
    if not isinstance(m, dict):
        raise _bad(where, "(top level)", m, "a JSON object")
    if m.get("format") != FORMAT:
        raise StoreError(f"{where}: unknown checkpoint format {m.get('format')!r} "
                         f"(this jaxscale reads format {FORMAT}); upgrade jaxscale.")
    if checksum_of(m) not in DIGESTS:
        raise _bad(where, "checksum", m.get("checksum"), f"one of {sorted(DIGESTS)}")
    chunk = chunk_of(m)
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
        _leaf(leaf, entry, where, checksum_of(m), chunk)
    return m
