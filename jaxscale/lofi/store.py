"""The Lo-Fi store: checksummed checkpoints of flat arrays in any tensorstore kvstore.

Layout (under the store root):

    workers/<worker_id>/<step>/arrays/<leaf path>   one zarr3 array per parameter leaf
    workers/<worker_id>/<step>/manifest.json        step, samples seen, leaves: shape, dtype,
                                                    encoding, one sha256 per chunk; version
    workers/<worker_id>/<step>/COMMIT               sha256 of manifest.json, written LAST
    average/<round>/...                             the same, for published averages
    average/<round>/CLAIM                           create-if-absent marker: one averager per round

A checkpoint exists for readers only once COMMIT matches its manifest, so a reader never sees a
partial write, even on object stores (s3) whose multi-key writes are not atomic. Leaves are stored
flattened to 1-D (shape in the manifest) in chunks of `CHUNK` values, so readers can stream any
leaf chunk by chunk. Nothing here unpickles: manifests are JSON and arrays are zarr.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

from jaxscale import __version__
from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.quant import BLOCK, dequantize_blockwise, quantize_blockwise

FORMAT = 1
CHUNK = 1 << 16            # values per stored chunk; a multiple of the quantization block
NO_VALUE = b"\x02"          # tensorstore's "key absent" storage generation (create-if-absent)
_CONTEXT = ts.Context()     # shared so memory:// stores are visible across opens in a process
_LEAF_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
           "int8": np.int8, "int32": np.int32}


class StoreError(JaxscaleError):
    """A checkpoint in the store is partial, corrupt or does not match what was expected."""


def kvstore_spec(location: str) -> dict:
    """`path`, `file://path`, `gs://bucket/prefix`, `s3://bucket/prefix`, `memory://name`."""
    for scheme, driver in (("gs://", "gcs"), ("s3://", "s3")):
        if location.startswith(scheme):
            bucket, _, prefix = location[len(scheme):].partition("/")
            return {"driver": driver, "bucket": bucket, "path": prefix.rstrip("/") + "/"}
    if location.startswith("memory://"):
        return {"driver": "memory", "path": location[len("memory://"):].strip("/") + "/"}
    path = location[len("file://"):] if location.startswith("file://") else location
    return {"driver": "file", "path": path.rstrip("/") + "/"}


def check_leaf_path(leaf: str, where: str) -> None:
    if not _LEAF_RE.match(leaf) or ".." in leaf.split("/"):
        raise StoreError(paragraph(
            f"{where}: leaf path {leaf!r} is not a plain relative path (it is absolute, empty or",
            "contains '..'), so it could escape the store. The checkpoint is rejected.",
        ))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Store:
    """A kvstore plus byte counters (for the communication accounting)."""

    def __init__(self, location: str):
        self.location = location
        self.spec = kvstore_spec(location)
        self.kv = ts.KvStore.open(self.spec, context=_CONTEXT).result()
        self.bytes_read = 0
        self.bytes_written = 0

    def read(self, key: str) -> bytes | None:
        result = self.kv.read(key).result()
        if result.state != "value":
            return None
        self.bytes_read += len(result.value)
        return bytes(result.value)

    def read_stamped(self, key: str) -> tuple[bytes | None, bytes]:
        """(value or None, storage generation) for conditional overwrites."""
        result = self.kv.read(key).result()
        return (bytes(result.value) if result.state == "value" else None), result.stamp.generation

    def write(self, key: str, data: bytes, if_absent: bool = False,
              if_generation: bytes | None = None) -> bool:
        """Writes `data`; with `if_absent` only if the key does not exist, with `if_generation`
        only if it is unchanged since read (compare-and-swap). Returns success."""
        condition = NO_VALUE if if_absent else if_generation
        stamp = self.kv.write(key, data, if_equal=condition).result()
        ok = stamp.generation != b""
        self.bytes_written += len(data) if ok else 0
        return ok

    def keys(self, prefix: str) -> list[str]:
        rng = ts.KvStore.KeyRange(prefix, prefix + "\xff")
        return [k.decode() for k in self.kv.list(rng).result()]

    def array(self, key: str, size: int | None = None, dtype: str | None = None):
        spec = {"driver": "zarr3", "kvstore": {**self.spec, "path": self.spec["path"] + key + "/"}}
        if size is None:
            return ts.open(spec, context=_CONTEXT, open=True).result()
        spec["metadata"] = {"shape": [size], "data_type": dtype, "chunk_grid": {
            "name": "regular", "configuration": {"chunk_shape": [min(CHUNK, max(size, 1))]}}}
        return ts.open(spec, context=_CONTEXT, create=True, delete_existing=True).result()


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its key prefix and validated manifest."""

    prefix: str
    manifest: dict

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def leaves(self) -> dict[str, dict]:
        return self.manifest["leaves"]


def _chunk_bounds(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + CHUNK, size)) for a in range(0, max(size, 1), CHUNK)]


def _write_leaf(store: Store, key: str, flat: np.ndarray, dtype: str) -> list[str]:
    arr = store.array(key, flat.size, dtype)
    arr[...] = flat
    store.bytes_written += flat.nbytes
    return [_sha(np.ascontiguousarray(flat[a:b]).tobytes()) for a, b in _chunk_bounds(flat.size)]


def write_checkpoint(store: Store, prefix: str, params: Mapping[str, Any], meta: dict,
                     base: Checkpoint | None = None, compress: bool = False) -> Checkpoint:
    """Writes arrays, then manifest.json, then COMMIT (the order readers rely on)."""
    leaves = {}
    for leaf, value in sorted(params.items()):
        check_leaf_path(leaf, prefix)
        value = np.asarray(value)
        entry = {"shape": list(value.shape), "dtype": str(value.dtype)}
        if compress:
            delta = value.astype(np.float32).ravel() - read_leaf(store, base, leaf).ravel()
            q, scale = quantize_blockwise(delta)
            entry.update(encoding="q8delta", base_round=meta["base_round"],
                         checksums=_write_leaf(store, f"{prefix}/arrays/{leaf}", q, "int8"),
                         scale_checksums=_write_leaf(store, f"{prefix}/scales/{leaf}", scale,
                                                     "float32"))
        else:
            entry.update(encoding="raw", checksums=_write_leaf(
                store, f"{prefix}/arrays/{leaf}", value.ravel(), str(value.dtype)))
        leaves[leaf] = entry
    manifest = {"format": FORMAT, "jaxscale_version": __version__, "created": time.time(),
                **meta, "leaves": leaves}
    data = json.dumps(manifest, sort_keys=True).encode()
    store.write(f"{prefix}/manifest.json", data)
    store.write(f"{prefix}/COMMIT", _sha(data).encode())
    return Checkpoint(prefix, manifest)


def load_checkpoint(store: Store, prefix: str) -> Checkpoint:
    """The committed checkpoint at `prefix`, or StoreError saying why it is not usable."""
    commit, data = store.read(f"{prefix}/COMMIT"), store.read(f"{prefix}/manifest.json")
    if commit is None or data is None:
        raise StoreError(f"{prefix}: no commit marker or manifest; the write is partial.")
    if commit.decode() != _sha(data):
        raise StoreError(f"{prefix}: the commit marker does not match manifest.json (corrupt).")
    manifest = json.loads(data)
    if manifest.get("format") != FORMAT:
        raise StoreError(f"{prefix}: unknown checkpoint format {manifest.get('format')!r}.")
    for leaf in manifest["leaves"]:
        check_leaf_path(leaf, prefix)
    return Checkpoint(prefix, manifest)


def _verified(store: Store, key: str, dtype: str, a: int, b: int, sums: list[str],
              where: str) -> np.ndarray:
    """Reads values [a, b) (chunk aligned) and checks every chunk's sha256."""
    try:
        values = np.asarray(store.array(key)[a:b].read().result())
    except Exception as e:  # truncated or undecodable chunk files
        raise StoreError(f"{where}: cannot read chunk data ({e}).") from None
    store.bytes_read += values.nbytes
    for start in range(a, b, CHUNK):
        got = _sha(np.ascontiguousarray(values[start - a:min(start + CHUNK, b) - a]).tobytes())
        if got != sums[start // CHUNK]:
            raise StoreError(paragraph(
                f"{where}: checksum mismatch in chunk {start // CHUNK} (values {start}..",
                f"{min(start + CHUNK, b)}); the data on disk is corrupt. This checkpoint is skipped.",
            ))
    return values.astype(_DTYPES.get(dtype, dtype))


def read_range(store: Store, ckpt: Checkpoint, leaf: str, a: int, b: int) -> np.ndarray:
    """Values [a, b) of a leaf's flattened float32 view (`a` chunk aligned), verified."""
    entry = ckpt.leaves[leaf]
    where = f"{ckpt.prefix} leaf {leaf}"
    if entry["encoding"] == "raw":
        return _verified(store, f"{ckpt.prefix}/arrays/{leaf}", entry["dtype"], a, b,
                         entry["checksums"], where).astype(np.float32)
    # Compressed: int8 deltas (padded to whole blocks) + one scale per block, from a base round.
    qb = -(-b // BLOCK) * BLOCK  # interior reads are chunk aligned, so qb == b there
    q = _verified(store, f"{ckpt.prefix}/arrays/{leaf}", "int8", a, qb, entry["checksums"], where)
    n_scales = -(-int(np.prod(entry["shape"])) // BLOCK)
    scales = _verified(store, f"{ckpt.prefix}/scales/{leaf}", "float32", 0, n_scales,
                       entry["scale_checksums"], where)[a // BLOCK:qb // BLOCK]
    delta = dequantize_blockwise(q, scales, (qb - a,))[:b - a]
    base = load_checkpoint(store, average_prefix(entry["base_round"]))
    return delta + read_range(store, base, leaf, a, b)


def read_leaf(store: Store, ckpt: Checkpoint | None, leaf: str) -> np.ndarray:
    """A whole leaf as float32 in its shape (workers loading an average; small reads)."""
    entry = ckpt.leaves[leaf]
    size = int(np.prod(entry["shape"]))
    return read_range(store, ckpt, leaf, 0, size).reshape(entry["shape"])


def read_params(store: Store, ckpt: Checkpoint) -> dict[str, np.ndarray]:
    return {leaf: read_leaf(store, ckpt, leaf).astype(_DTYPES.get(e["dtype"], e["dtype"]))
            for leaf, e in ckpt.leaves.items()}


# ----------------------------------------------------------------------------- layout helpers
def worker_prefix(worker_id: int, step: int) -> str:
    return f"workers/{int(worker_id)}/{int(step)}"


def average_prefix(round_: int) -> str:
    return f"average/{int(round_)}"


def _committed(store: Store, root: str) -> dict[tuple[int, ...], str]:
    """{numeric path parts: prefix} of every directory under `root` holding a COMMIT."""
    out = {}
    for key in store.keys(root + "/"):
        if key.endswith("/COMMIT"):
            prefix = key[:-len("/COMMIT")]
            parts = prefix[len(root) + 1:].split("/")
            if all(p.isdigit() for p in parts):
                out[tuple(int(p) for p in parts)] = prefix
    return out


def worker_checkpoints(store: Store) -> dict[int, list[int]]:
    """{worker_id: committed steps, ascending}."""
    out: dict[int, list[int]] = {}
    for parts in sorted(_committed(store, "workers")):
        if len(parts) == 2:
            out.setdefault(parts[0], []).append(parts[1])
    return out


def average_rounds(store: Store) -> list[int]:
    return sorted(p[0] for p in _committed(store, "average") if len(p) == 1)


def latest_average_checkpoint(store: Store) -> Checkpoint | None:
    """The newest average whose commit is valid (a partial newer one is ignored)."""
    for round_ in reversed(average_rounds(store)):
        try:
            return load_checkpoint(store, average_prefix(round_))
        except StoreError:
            continue
    return None


@dataclass(frozen=True)
class PushReport:
    prefix: str
    bytes_written: int
    raw_bytes: int


def push(location: str | Store, worker_id: int, step: int, params: Mapping[str, Any],
         samples_seen: int, compress: bool = False) -> PushReport:
    """A worker's push of flat {leaf: array} weights; compressed pushes store 8-bit deltas from
    the newest average (falling back to raw when there is none yet)."""
    store = location if isinstance(location, Store) else Store(location)
    before = store.bytes_written
    base = latest_average_checkpoint(store) if compress else None
    meta = {"kind": "worker", "worker_id": int(worker_id), "step": int(step),
            "samples_seen": int(samples_seen),
            "base_round": int(base.prefix.split("/")[1]) if base else None}
    prefix = worker_prefix(worker_id, step)
    write_checkpoint(store, prefix, params, meta, base, compress=compress and base is not None)
    raw = sum(np.asarray(v).nbytes for v in params.values())
    return PushReport(prefix, store.bytes_written - before, raw)
