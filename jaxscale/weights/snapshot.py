"""Committed snapshots: flat {leaf: array} weights in any tensorstore kvstore, checksummed.

The one on-disk format jaxscale stores weights in outside orbax checkpoints: a params export
(`init_from.export_params`, `launch.convert`, `launch.lofi_average --final`), a Lo-Fi worker's
push and a published Lo-Fi average (`jaxscale/lofi/store.py` decides which and when). A
snapshot is one committed set of weights with its manifest. ("Snapshot", not "checkpoint": a
training run's orbax checkpoints are `jaxscale/train/checkpoint.py`'s, a different thing.)

Layout (under the store root):

    <prefix>/d<token>/arrays/<leaf>      one zarr3 array per parameter leaf (each chunk with its
                                         crc32c), in a per-attempt directory
    <prefix>/d<token>/manifest.json      step, samples seen, chunk size, leaves: shape, dtype,
                                         encoding; format version
    commits/<prefix>                     "<sha256 of the manifest> d<token>/manifest.json",
                                         created LAST, if absent
    params/manifest.json + commits/params  a re-export: the COMMIT holds only the manifest's
                                         sha256
  with <prefix> one of `params`, `workers/<worker_id>/<step>` (Lo-Fi pushes) and
  `average/<round>` (Lo-Fi averages, + d<token>/momentum/ for DiLoCo; `average/<round>/CLAIM`
  is the averager's lease). A compressed snapshot (`q8delta`) stores 8-bit deltas from an
  average, which is why this format knows where averages live.

The commit is one create-if-absent key naming the attempt that won: of racing writers (two
averagers, a presumed-dead one waking up, two processes pushing one worker step) exactly one
commits, nobody ever deletes or rewrites another attempt's files, and a reader never sees a
partial write, even on object stores (s3) whose multi-key writes are not atomic. COMMIT markers
live under their own prefix, so listing `commits/workers/` finds every committed push (one key
each, never a chunk) and an uncommitted attempt is simply not listed. Leaves are stored
flattened to 1-D (shape in the manifest) in chunks of `chunk` values, so readers can stream any
leaf block by block; tensorstore checks each chunk's crc32c as it reads (`kv.py`). Nothing here
unpickles: manifests are JSON, validated field by field (`manifest.py`), and arrays are zarr.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxscale import __version__
from jaxscale.errors import paragraph
from jaxscale.storage.diskfull import disk_full_error, is_disk_full
from jaxscale.storage.retry import StoreUnavailable
from jaxscale.weights import localfs
from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import (
    DTYPES,
    FORMAT,
    StoreError,
    check_leaf_path,
    chunk_of,
    validate_manifest,
)
from jaxscale.weights.push_codec import BLOCK, dequantize_blockwise, quantize_blockwise

COMMITS = "commits"
PARAMS = "params"   # where a params export keeps its snapshot

_COMMITTED_RE = re.compile(r"^d[0-9a-f]{1,32}/manifest\.json$")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def commit_key(prefix: str) -> str:
    """The COMMIT marker of the snapshot at `prefix` (e.g. `commits/workers/3/100`)."""
    return f"{COMMITS}/{prefix}"


@dataclass(frozen=True)
class Snapshot:
    """A committed snapshot: its key prefix and validated manifest."""

    prefix: str
    manifest: dict

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def leaves(self) -> dict[str, dict]:
        return self.manifest["leaves"]

    @property
    def chunk(self) -> int:
        return chunk_of(self.manifest)

    @property
    def data(self) -> str:
        """Where the arrays live: pushes and averages write them under a per-attempt directory
        so that a racing or presumed-dead writer can never overwrite another's committed data."""
        return f"{self.prefix}/{self.manifest['data']}" if "data" in self.manifest else self.prefix


def _write_leaf(store: Store, key: str, flat: np.ndarray, dtype: str) -> None:
    array = store.array(key, flat.size, dtype)
    store.started(f"writing {key}", lambda: array.write(flat), flat.nbytes).result()
    store.bytes_written += flat.nbytes


class LostRace(StoreError):
    """Another writer committed this snapshot first (this attempt's files were removed)."""


def attempt_dir() -> str:
    """A fresh per-attempt data directory name: racing writers never share files."""
    return "d" + uuid.uuid4().hex[:16]


def write_snapshot(store: Store, prefix: str, params: Mapping[str, Any], meta: dict,
                   base: Snapshot | None = None, compress: bool = False,
                   exclusive: bool = False) -> Snapshot:
    """Writes arrays, then the manifest, then COMMIT (the order readers rely on). With
    `exclusive` (pushes, averages) the data goes to a per-attempt directory and an already
    committed snapshot is never replaced; losing the race raises LostRace."""
    if exclusive and "data" not in meta:
        meta = {**meta, "data": attempt_dir()}
    data = f"{prefix}/{meta['data']}" if "data" in meta else prefix
    try:
        return _write_snapshot(store, prefix, data, params, meta, base, compress, exclusive)
    except Exception as e:
        if not is_disk_full(e):
            raise
        if data != prefix:
            store.delete_prefix(data)  # only this attempt's own directory
        need = sum(np.asarray(v).nbytes for v in params.values())
        raise disk_full_error(store.location, f"writing {prefix}", need, data) from None


def _write_snapshot(store: Store, prefix: str, data: str, params: Mapping[str, Any],
                    meta: dict, base: Snapshot | None, compress: bool,
                    exclusive: bool) -> Snapshot:
    leaves = {}
    for leaf, value in sorted(params.items()):
        check_leaf_path(leaf, prefix)
        value = np.asarray(value)
        entry = {"shape": list(value.shape), "dtype": str(value.dtype)}
        if compress:
            delta = value.astype(np.float32).ravel() - read_leaf(store, base, leaf).ravel()
            q, scale = quantize_blockwise(delta)
            _write_leaf(store, f"{data}/arrays/{leaf}", q, "int8")
            _write_leaf(store, f"{data}/scales/{leaf}", scale, "float32")
            entry.update(encoding="q8delta", base_round=meta["base_round"])
        else:
            _write_leaf(store, f"{data}/arrays/{leaf}", value.ravel(), str(value.dtype))
            entry.update(encoding="raw")
        leaves[leaf] = entry
    manifest = {"format": FORMAT, "jaxscale_version": __version__, "created": time.time(),
                "chunk": store.chunk, **meta, "leaves": leaves}
    if not commit(store, prefix, manifest, exclusive) and not _ours(store, prefix, data):
        if data != prefix:
            store.delete_prefix(data)
        raise LostRace(f"{prefix}: another writer committed this snapshot first; its data "
                       "was left untouched and this attempt's removed.")
    return Snapshot(prefix, manifest)


def _ours(store: Store, prefix: str, data: str) -> bool:
    """Whether the COMMIT of `prefix` names this attempt's `data` directory: a conditional
    write retried after a lost response finds its own earlier success, which must not be taken
    for a lost race (deleting the data a COMMIT names)."""
    return data != prefix and committed_data(store, prefix) == data.rsplit("/", 1)[1]


def commit(store: Store, prefix: str, manifest: dict, exclusive: bool = True) -> bool:
    """Makes `manifest` the committed snapshot at `prefix`; False if another won.

    Callers have waited for every array write to complete: a completed tensorstore write is
    durable and whole (the file kvstore fsyncs a temporary file and renames it into place;
    object stores hold an object once its PUT returns), so nothing a COMMIT names can be lost
    or half-written after it. `exclusive` (the manifest names its attempt directory in `data`):
    the manifest goes into that directory and COMMIT, created if absent, holds its sha256 and
    path: one conditional single-key write decides the race (which holds on s3 too, where
    multi-key writes are not atomic), and a committed snapshot is never overwritten.
    Otherwise (re-exports) the old COMMIT is removed first, so readers never mix the two."""
    data = json.dumps(manifest, sort_keys=True).encode()
    if not exclusive:
        store.delete(commit_key(prefix))
        store.write(f"{prefix}/manifest.json", data)
        return store.write(commit_key(prefix), _sha(data).encode())
    relative = f"{manifest['data']}/manifest.json"
    store.write(f"{prefix}/{relative}", data)
    return store.write(commit_key(prefix), f"{_sha(data)} {relative}".encode(), if_absent=True)


def committed_data(store: Store, prefix: str) -> str | None:
    """The attempt directory the COMMIT of `prefix` names (None: none, or a re-export)."""
    marker = store.read(commit_key(prefix))
    text = marker.decode(errors="replace") if marker else ""
    return text.split(" ", 1)[1].split("/", 1)[0] if " " in text else None


def load_snapshot(store: Store, prefix: str) -> Snapshot:
    """The committed snapshot at `prefix`, or StoreError saying why it is not usable."""
    localfs.check_path(store.spec, commit_key(prefix), leaf_is_dir=False)
    marker = store.read(commit_key(prefix))
    if marker is None:
        raise StoreError(f"{prefix}: no commit marker ({commit_key(prefix)}); the write is "
                         "partial.")
    sha, _, relative = marker.decode(errors="replace").partition(" ")
    if relative and not _COMMITTED_RE.match(relative):
        raise StoreError(f"{prefix}: the commit marker names {relative!r}, not an attempt's "
                         "manifest; rejected.")
    if relative:  # links and FIFOs are never followed or opened (`localfs.py`)
        localfs.check_tree(store.spec, f"{prefix}/{relative.split('/', 1)[0]}")
    data = store.read(f"{prefix}/{relative or 'manifest.json'}")
    if data is None:
        raise StoreError(f"{prefix}: the committed manifest is missing (corrupt).")
    if sha != _sha(data):
        raise StoreError(f"{prefix}: the commit marker does not match the manifest (corrupt).")
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise StoreError(f"{prefix}: manifest.json is not valid JSON ({e}); rejected.") from None
    manifest = validate_manifest(manifest, prefix)
    if relative and manifest.get("data") != relative.split("/", 1)[0]:
        raise StoreError(f"{prefix}: the committed manifest's data field names another "
                         "attempt's directory; rejected.")
    return Snapshot(prefix, manifest)


# ----------------------------------------------------------------------------- reading data
def _stored(ckpt: Snapshot, kind: str, leaf: str) -> tuple[str, int, str]:
    """(key, stored size, dtype) of a leaf's array of `kind`: `arrays` (the values, or int8
    deltas padded to whole blocks when compressed), `scales` (one per block) or `momentum`."""
    entry = ckpt.leaves[leaf]
    size = int(np.prod(entry["shape"]))
    if kind == "arrays" and entry["encoding"] == "q8delta":
        size, dtype = -(-size // BLOCK) * BLOCK, "int8"
    elif kind == "scales":
        size, dtype = -(-size // BLOCK), "float32"
    else:
        dtype = entry["dtype"] if kind == "arrays" else "float32"
    return f"{ckpt.data}/{kind}/{leaf}", size, dtype


def _start(store: Store, ckpt: Snapshot, kind: str, leaf: str, a: int, b: int) -> Any:
    """Starts reading values [a, b) of a stored array: a future (retried across outages).
    Opening checks the array's metadata against the manifest; reading checks every chunk's
    crc32c."""
    key, size, dtype = _stored(ckpt, kind, leaf)
    return store.started(f"reading {key}", lambda: store.open_array(
        key, size, dtype, ckpt.chunk)[a:b].read(), (b - a) * np.dtype(DTYPES[dtype]).itemsize)


def _finish(store: Store, ckpt: Snapshot, leaf: str, start: Any) -> np.ndarray:
    """The values of a read `start()` began (or raises), as a StoreError naming the damage."""
    try:
        values = np.asarray(start().result())
    except StoreUnavailable:  # the server, not the snapshot: never skip a healthy push for it
        raise
    except Exception as e:  # corrupt, truncated or missing chunks, swapped metadata
        text = str(e)
        what = ("checksum mismatch (crc32c): the stored data is corrupt" if "igest mismatch"
                in text else "cannot read its data (truncated, missing or swapped files)")
        raise StoreError(paragraph(
            f"{ckpt.prefix} leaf {leaf}: {what} ({text}). This snapshot is skipped.",
        )) from None
    store.bytes_read += values.nbytes
    return values


def read_values(store: Store, ckpt: Snapshot, kind: str, leaf: str, a: int,
                b: int) -> np.ndarray:
    """Values [a, b) of one of a leaf's stored arrays (see `_stored`), verified."""
    return _finish(store, ckpt, leaf, lambda: _start(store, ckpt, kind, leaf, a, b))


def read_range(store: Store, ckpt: Snapshot, leaf: str, a: int, b: int) -> np.ndarray:
    """Values [a, b) of a leaf's flattened float32 view, verified."""
    entry = ckpt.leaves[leaf]
    if entry["encoding"] == "raw":
        return read_values(store, ckpt, "arrays", leaf, a, b).astype(np.float32, copy=False)
    # Compressed: int8 deltas (padded to whole blocks) + one scale per block, from a base round.
    qa, qb = a // BLOCK * BLOCK, -(-b // BLOCK) * BLOCK
    q = read_values(store, ckpt, "arrays", leaf, qa, qb)
    scales = read_values(store, ckpt, "scales", leaf, qa // BLOCK, qb // BLOCK)
    delta = dequantize_blockwise(q, scales, (qb - qa,))[a - qa:b - qa]
    base = load_snapshot(store, average_prefix(entry["base_round"]))
    return delta + read_range(store, base, leaf, a, b)


def start_reads(store: Store, ckpts: list[Snapshot], leaf: str, a: int, b: int) -> list[Any]:
    """Starts the raw reads of values [a, b) of a leaf in several snapshots, so they run in
    tensorstore's I/O threads while the caller computes (None where a read is compressed or
    cannot start: `read_many` then reads it itself and reports why)."""
    started = []
    for ckpt in ckpts:
        future = None
        if ckpt.leaves[leaf]["encoding"] == "raw":
            try:
                future = _start(store, ckpt, "arrays", leaf, a, b)
            except Exception:  # reported by read_range in read_many
                future = None
        started.append(future)
    return started


def read_many(store: Store, ckpts: list[Snapshot], leaf: str, a: int, b: int,
              started: list[Any] | None = None) -> list[np.ndarray | StoreError]:
    """`read_range` of several snapshots with their raw reads in flight together (the
    averager's inner loop; `started` from `start_reads` if already begun); each result is the
    float32 values or the StoreError it raised."""
    started = start_reads(store, ckpts, leaf, a, b) if started is None else started
    out: list[np.ndarray | StoreError] = []
    for ckpt, future in zip(ckpts, started):
        try:
            if future is None:
                out.append(read_range(store, ckpt, leaf, a, b))
            else:
                out.append(_finish(store, ckpt, leaf, lambda f=future: f)
                           .astype(np.float32, copy=False))
        except StoreError as e:
            out.append(e)
    return out


def read_leaf(store: Store, ckpt: Snapshot | None, leaf: str) -> np.ndarray:
    """A whole leaf as float32 in its shape (workers loading an average; small reads)."""
    entry = ckpt.leaves[leaf]
    size = int(np.prod(entry["shape"]))
    return read_range(store, ckpt, leaf, 0, size).reshape(entry["shape"])


def read_params(store: Store, ckpt: Snapshot) -> dict[str, np.ndarray]:
    return {leaf: read_leaf(store, ckpt, leaf).astype(DTYPES[e["dtype"]])
            for leaf, e in ckpt.leaves.items()}


# ----------------------------------------------------------------------------- finding snapshots
def average_prefix(round_: int) -> str:
    """Where round `round_`'s average lives (the base a compressed snapshot's deltas name)."""
    return f"average/{int(round_)}"


def committed(store: Store, root: str, depth: int) -> list[tuple[int, ...]]:
    """The numeric path parts (`depth` of them) of every COMMIT under `commits/<root>/`,
    ascending: one listing of one key per committed snapshot (anything else is ignored)."""
    found = []
    for key in store.keys(f"{COMMITS}/{root}/"):
        parts = key.split("/")[2:]
        if len(parts) == depth and all(p.isdigit() for p in parts):
            found.append(tuple(int(p) for p in parts))
    return sorted(found)


def average_rounds(store: Store) -> list[int]:
    return [round_ for round_, in committed(store, "average", 1)]


def latest_average_snapshot(store: Store) -> Snapshot | None:
    """The newest average whose commit is valid (a corrupt newer one is skipped). Workers poll
    this at sync points: each round's COMMIT is read once, by load_snapshot, newest first."""
    for round_ in reversed(average_rounds(store)):
        try:
            return load_snapshot(store, average_prefix(round_))
        except StoreError:
            continue
    return None
