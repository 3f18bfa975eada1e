"""The Lo-Fi store: checksummed checkpoints of flat arrays in any tensorstore kvstore.

Layout (under the store root):

    workers/<worker_id>/<step>/d<token>/arrays/<leaf>  one zarr3 array per parameter leaf, in a
                                                       per-attempt directory
    workers/<worker_id>/<step>/d<token>/manifest.json  step, samples seen, leaves: shape, dtype,
                                                       encoding, one xxh3_128 per chunk; version
    workers/<worker_id>/<step>/COMMIT                  "<sha256 of the manifest> d<token>/
                                                       manifest.json", created LAST, if absent
    average/<round>/...                                the same, for published averages
                                                       (+ d<token>/momentum/ for DiLoCo)
    average/<round>/CLAIM                              one averager at a time per round
    index/workers/<worker_id>/<step>, index/average/<round>   empty keys, written just before
                                                       each COMMIT, so finding checkpoints lists
                                                       one key per checkpoint, not every chunk
    index/workers.complete, index/average.complete     the index of that root is complete
                                                       (`index.py`)

The commit is one create-if-absent key naming the attempt that won: of racing writers (two
averagers, a presumed-dead one waking up, two processes pushing one worker step) exactly one
commits, nobody ever deletes or rewrites another attempt's files, and a reader never sees a
partial write, even on object stores (s3) whose multi-key writes are not atomic. Leaves are
stored flattened to 1-D (shape in the manifest) in chunks of `chunk` values, so readers can
stream any leaf chunk by chunk. Nothing here unpickles: manifests are JSON, validated field by
field (`manifest.py`), and arrays are zarr. Re-exports (`--final`) write `manifest.json` beside
a COMMIT holding only its sha256.
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
from jaxscale.lofi import index, localfs
from jaxscale.lofi.diskfull import disk_full_error, is_disk_full
from jaxscale.lofi.kv import Store, chunk_sums, kvstore_spec
from jaxscale.lofi.manifest import (CHECKSUM, CHUNK, DTYPES, FORMAT, StoreError,
                                    check_leaf_path, checksum_of, chunk_of, validate_manifest)
from jaxscale.quant import BLOCK, dequantize_blockwise, quantize_blockwise

__all__ = ["CHUNK", "FORMAT", "StoreError", "check_leaf_path", "Store", "Checkpoint", "push",
           "chunk_sums", "kvstore_spec"]
_DTYPES = DTYPES


_COMMITTED_RE = re.compile(r"^d[0-9a-f]{1,32}/manifest\.json$")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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

    @property
    def checksum(self) -> str:
        return checksum_of(self.manifest)

    @property
    def chunk(self) -> int:
        return chunk_of(self.manifest)

    @property
    def data(self) -> str:
        """Where the arrays live: averages write them under a per-attempt directory so that a
        racing or presumed-dead averager can never overwrite another's committed data."""
        return f"{self.prefix}/{self.manifest['data']}" if "data" in self.manifest else self.prefix


def _write_leaf(store: Store, key: str, flat: np.ndarray, dtype: str) -> list[str]:
    arr = store.array(key, flat.size, dtype)
    arr[...] = flat
    store.bytes_written += flat.nbytes
    return chunk_sums(flat, CHECKSUM, store.chunk)


class LostRace(StoreError):
    """Another writer committed this checkpoint first (this attempt's files were removed)."""


def attempt_dir() -> str:
    """A fresh per-attempt data directory name: racing writers never share files."""
    return "d" + uuid.uuid4().hex[:16]


def write_checkpoint(store: Store, prefix: str, params: Mapping[str, Any], meta: dict,
                     base: Checkpoint | None = None, compress: bool = False,
                     exclusive: bool = False) -> Checkpoint:
    """Writes arrays, then the manifest, then COMMIT (the order readers rely on). With
    `exclusive` (pushes, averages) the data goes to a per-attempt directory and an already
    committed checkpoint is never replaced; losing the race raises LostRace."""
    if exclusive and "data" not in meta:
        meta = {**meta, "data": attempt_dir()}
    data = f"{prefix}/{meta['data']}" if "data" in meta else prefix
    try:
        return _write_checkpoint(store, prefix, data, params, meta, base, compress, exclusive)
    except Exception as e:
        if not is_disk_full(e):
            raise
        if data != prefix:
            store.delete_prefix(data)  # only this attempt's own directory
        need = sum(np.asarray(v).nbytes for v in params.values())
        raise disk_full_error(store.location, f"writing {prefix}", need, data) from None


def _write_checkpoint(store: Store, prefix: str, data: str, params: Mapping[str, Any],
                      meta: dict, base: Checkpoint | None, compress: bool,
                      exclusive: bool) -> Checkpoint:
    leaves = {}
    for leaf, value in sorted(params.items()):
        check_leaf_path(leaf, prefix)
        value = np.asarray(value)
        entry = {"shape": list(value.shape), "dtype": str(value.dtype)}
        if compress:
            delta = value.astype(np.float32).ravel() - read_leaf(store, base, leaf).ravel()
            q, scale = quantize_blockwise(delta)
            entry.update(encoding="q8delta", base_round=meta["base_round"],
                         checksums=_write_leaf(store, f"{data}/arrays/{leaf}", q, "int8"),
                         scale_checksums=_write_leaf(store, f"{data}/scales/{leaf}", scale,
                                                     "float32"))
        else:
            entry.update(encoding="raw", checksums=_write_leaf(
                store, f"{data}/arrays/{leaf}", value.ravel(), str(value.dtype)))
        leaves[leaf] = entry
    manifest = {"format": FORMAT, "jaxscale_version": __version__, "created": time.time(),
                "checksum": CHECKSUM, "chunk": store.chunk, **meta, "leaves": leaves}
    if not commit(store, prefix, manifest, exclusive):
        if data != prefix:
            store.delete_prefix(data)
        raise LostRace(f"{prefix}: another writer committed this checkpoint first; its data "
                       "was left untouched and this attempt's removed.")
    return Checkpoint(prefix, manifest)


def commit(store: Store, prefix: str, manifest: dict, exclusive: bool = True) -> bool:
    """Makes `manifest` the committed checkpoint at `prefix`; False if another won.

    `exclusive` (the manifest names its attempt directory in `data`): the manifest goes into
    that directory and COMMIT, created if absent, holds its sha256 and path: one conditional
    single-key write decides the race (which holds on s3 too, where multi-key writes are not
    atomic), and a committed checkpoint is never overwritten. Otherwise (re-exports) the old
    COMMIT is removed first, so readers never mix the two."""
    data = json.dumps(manifest, sort_keys=True).encode()
    store.sync()  # the arrays are durable before anything names them
    if not exclusive:
        store.kv.write(f"{prefix}/COMMIT", None).result()
        store.write(f"{prefix}/manifest.json", data)
        return store.write(f"{prefix}/COMMIT", _sha(data).encode())
    relative = f"{manifest['data']}/manifest.json"
    store.write(f"{prefix}/{relative}", data)
    index.add_entry(store, prefix)  # before COMMIT: the index may list more than is committed
    return store.write(f"{prefix}/COMMIT", f"{_sha(data)} {relative}".encode(), if_absent=True)


def committed_data(store: Store, prefix: str) -> str | None:
    """The attempt directory the COMMIT at `prefix` names (None: none, or a re-export)."""
    marker = store.read(f"{prefix}/COMMIT")
    text = marker.decode(errors="replace") if marker else ""
    return text.split(" ", 1)[1].split("/", 1)[0] if " " in text else None


def load_checkpoint(store: Store, prefix: str) -> Checkpoint:
    """The committed checkpoint at `prefix`, or StoreError saying why it is not usable."""
    localfs.check_path(store.spec, f"{prefix}/COMMIT", leaf_is_dir=False)
    marker = store.read(f"{prefix}/COMMIT")
    if marker is None:
        raise StoreError(f"{prefix}: no commit marker; the write is partial.")
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
    return Checkpoint(prefix, manifest)


def _verified(store: Store, key: str, dtype: str, a: int, b: int, sums: list[str],
              where: str, ckpt: Checkpoint, future: Any = None) -> np.ndarray:
    """Reads values [a, b) (aligned to `ckpt`'s chunks; or takes a read `start_read` began)
    and checks every chunk's checksum."""
    try:
        future = future if future is not None else _start(store, key, dtype, a, b, ckpt)
        values, got = future.result()
    except Exception as e:  # truncated or undecodable chunk files, missing arrays
        raise StoreError(f"{where}: cannot read chunk data ({e}).") from None
    store.bytes_read += values.nbytes
    chunk = ckpt.chunk
    got = got if got is not None else chunk_sums(values, ckpt.checksum, chunk)
    for start, digest in zip(range(a, b, chunk), got):
        if digest != sums[start // chunk]:
            raise StoreError(paragraph(
                f"{where}: checksum mismatch in chunk {start // chunk} (values {start}..",
                f"{min(start + chunk, b)}); the data on disk is corrupt. This checkpoint is",
                "skipped.",
            ))
    return values.astype(_DTYPES[dtype], copy=False)


def _start(store: Store, key: str, dtype: str, a: int, b: int, ckpt: Checkpoint) -> Any:
    return store.start_read(key, dtype, a, b, ckpt.checksum, ckpt.chunk)


def read_range(store: Store, ckpt: Checkpoint, leaf: str, a: int, b: int) -> np.ndarray:
    """Values [a, b) of a leaf's flattened float32 view (`a` chunk aligned), verified."""
    entry = ckpt.leaves[leaf]
    where = f"{ckpt.prefix} leaf {leaf}"
    if entry["encoding"] == "raw":
        return _verified(store, f"{ckpt.data}/arrays/{leaf}", entry["dtype"], a, b,
                         entry["checksums"], where, ckpt).astype(np.float32, copy=False)
    # Compressed: int8 deltas (padded to whole blocks) + one scale per block, from a base round.
    qb = -(-b // BLOCK) * BLOCK  # interior reads are chunk aligned, so qb == b there
    q = _verified(store, f"{ckpt.data}/arrays/{leaf}", "int8", a, qb, entry["checksums"], where,
                  ckpt)
    n_scales = -(-int(np.prod(entry["shape"])) // BLOCK)
    scales = _verified(store, f"{ckpt.data}/scales/{leaf}", "float32", 0, n_scales,
                       entry["scale_checksums"], where, ckpt)[a // BLOCK:qb // BLOCK]
    delta = dequantize_blockwise(q, scales, (qb - a,))[:b - a]
    base = load_checkpoint(store, average_prefix(entry["base_round"]))
    return delta + read_range(store, base, leaf, a, b)


def start_reads(store: Store, ckpts: list[Checkpoint], leaf: str, a: int, b: int) -> list[Any]:
    """Starts the raw reads of values [a, b) of a leaf in several checkpoints, so they run in
    tensorstore's I/O threads while the caller computes (None where a read is compressed or
    cannot start: `read_many` then reads it itself and reports why)."""
    started = []
    for ckpt in ckpts:
        future = None
        if ckpt.leaves[leaf]["encoding"] == "raw":
            try:
                future = _start(store, f"{ckpt.data}/arrays/{leaf}",
                                ckpt.leaves[leaf]["dtype"], a, b, ckpt)
            except Exception:  # noqa: BLE001 - reported by _verified in read_many
                future = None
        started.append(future)
    return started


def read_many(store: Store, ckpts: list[Checkpoint], leaf: str, a: int, b: int,
              started: list[Any] | None = None) -> list[np.ndarray | StoreError]:
    """`read_range` of several checkpoints with their raw reads in flight together (the
    averager's inner loop; `started` from `start_reads` if already begun); each result is the
    float32 values or the StoreError it raised."""
    started = start_reads(store, ckpts, leaf, a, b) if started is None else started
    out: list[np.ndarray | StoreError] = []
    for ckpt, future in zip(ckpts, started):
        entry = ckpt.leaves[leaf]
        try:
            if future is None:
                out.append(read_range(store, ckpt, leaf, a, b))
            else:
                out.append(_verified(store, f"{ckpt.data}/arrays/{leaf}", entry["dtype"], a, b,
                                     entry["checksums"], f"{ckpt.prefix} leaf {leaf}",
                                     ckpt, future).astype(np.float32, copy=False))
        except StoreError as e:
            out.append(e)
    return out


def read_leaf(store: Store, ckpt: Checkpoint | None, leaf: str) -> np.ndarray:
    """A whole leaf as float32 in its shape (workers loading an average; small reads)."""
    entry = ckpt.leaves[leaf]
    size = int(np.prod(entry["shape"]))
    return read_range(store, ckpt, leaf, 0, size).reshape(entry["shape"])


def read_params(store: Store, ckpt: Checkpoint) -> dict[str, np.ndarray]:
    return {leaf: read_leaf(store, ckpt, leaf).astype(_DTYPES[e["dtype"]])
            for leaf, e in ckpt.leaves.items()}


# ----------------------------------------------------------------------------- layout helpers
def worker_prefix(worker_id: int, step: int) -> str:
    return f"workers/{int(worker_id)}/{int(step)}"


def average_prefix(round_: int) -> str:
    return f"average/{int(round_)}"


def worker_checkpoints(store: Store) -> dict[int, list[int]]:
    """{worker_id: committed steps, ascending}."""
    out: dict[int, list[int]] = {}
    for parts in sorted(index.committed(store, "workers")):
        if len(parts) == 2:
            out.setdefault(parts[0], []).append(parts[1])
    return out


def average_rounds(store: Store) -> list[int]:
    return sorted(p[0] for p in index.committed(store, "average") if len(p) == 1)


def latest_average_checkpoint(store: Store) -> Checkpoint | None:
    """The newest average whose commit is valid (a partial newer one is ignored). Workers poll
    this at sync points: each round's COMMIT is read once, by load_checkpoint, newest first."""
    indexed = index.committed(store, "average", exact=False)
    for round_ in sorted((p[0] for p in indexed if len(p) == 1), reverse=True):
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
    skipped: bool = False      # this step was already committed: kept, not overwritten


def push(location: str | Store, worker_id: int, step: int, params: Mapping[str, Any],
         samples_seen: int, compress: bool = False, synced_round: int | None = None
         ) -> PushReport:
    """A worker's push of flat {leaf: array} weights; compressed pushes store 8-bit deltas from
    the newest average (falling back to raw when there is none yet). `synced_round` is the
    average the worker last continued from (the averager measures staleness against it).

    A step that is already committed (a restarted worker redoing steps, or two processes with
    one worker id) is kept as it is: the averager may be reading it, and committed data is
    never overwritten. A partial push of the same step (a worker killed mid-push) is simply
    written again into a new attempt directory; the killed attempt's files are never read.
    """
    store = location if isinstance(location, Store) else Store(location)
    prefix = worker_prefix(worker_id, step)
    raw = sum(np.asarray(v).nbytes for v in params.values())
    if store.read(f"{prefix}/COMMIT") is not None:
        return PushReport(prefix, 0, raw, skipped=True)
    before = store.bytes_written
    base = latest_average_checkpoint(store) if compress else None
    meta = {"kind": "worker", "worker_id": int(worker_id), "step": int(step),
            "samples_seen": int(samples_seen),
            "base_round": int(base.manifest["round"]) if base else None,
            "synced_round": None if synced_round is None or synced_round < 0
            else int(synced_round)}
    try:
        write_checkpoint(store, prefix, params, meta, base,
                         compress=compress and base is not None, exclusive=True)
    except LostRace:  # another process pushed this worker step first: keep its push
        return PushReport(prefix, store.bytes_written - before, raw, skipped=True)
    return PushReport(prefix, store.bytes_written - before, raw)
