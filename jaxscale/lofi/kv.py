"""The kvstore under a Lo-Fi store: byte-counted reads and writes, conditional writes, 1-D
zarr3 arrays, and durability, for any tensorstore kvstore (local path, gs://, s3://, memory://).

`store.py` builds the checkpoint protocol (manifests, commits, verified reads) on top of this.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from typing import Any

import numpy as np
import tensorstore as ts
import xxhash

from jaxscale.lofi.chunkfiles import ChunkFiles
from jaxscale.lofi.localfs import check_path
from jaxscale.lofi.manifest import CHECKSUM, CHUNK

NO_VALUE = b"\x02"          # tensorstore's "key absent" storage generation (create-if-absent)
# Shared so memory:// stores are visible across opens in a process. More copy threads than
# cores: chunk decoding interleaves with file waits (2.3 -> 3.2 GB/s of reads on 2 cores).
_CONTEXT = ts.Context(ts.Context.Spec(
    {"data_copy_concurrency": {"limit": max(4, 2 * (os.cpu_count() or 2))}}))
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - no C library to load symbols from
    _LIBC = None


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


_HASH = {"xxh3_128": xxhash.xxh3_128_hexdigest,
         "sha256": lambda piece: hashlib.sha256(piece).hexdigest()}


def chunk_sums(values: np.ndarray, algorithm: str = CHECKSUM, chunk: int = CHUNK) -> list[str]:
    """The checksum of each `chunk`-value piece of a flat array, straight from its buffer."""
    flat = np.ascontiguousarray(values).reshape(-1)
    raw, step = flat.view(np.uint8), chunk * flat.dtype.itemsize
    digest = _HASH[algorithm]
    return [digest(raw[i:i + step]) for i in range(0, max(raw.size, 1), step)] or [digest(raw)]


class _Unhashed:
    """A tensorstore read as a (values, None) future, like a chunk-file read's."""

    def __init__(self, future: Any):
        self.future = future

    def result(self) -> tuple[np.ndarray, None]:
        return np.asarray(self.future.result()), None


class Store:
    """A kvstore plus byte counters (for the communication accounting). Arrays it creates are
    cut into `chunk`-value chunk files (the default, except in tests of older stores)."""

    def __init__(self, location: str, chunk: int = CHUNK):
        self.location = location
        self.chunk = chunk
        self.spec = kvstore_spec(location)
        self.kv = ts.KvStore.open(self.spec, context=_CONTEXT).result()
        self.bytes_read = 0
        self.bytes_written = 0
        self.indexed_roots: set[str] = set()  # roots whose index this process completed
        self._handles: dict[str, Any] = {}   # opened committed arrays (their data never changes)
        self._unsynced = False
        self._chunk_files = (ChunkFiles(self.spec["path"]) if self.spec["driver"] == "file"
                             else None)

    def start_read(self, key: str, dtype: str, a: int, b: int, checksum: str = CHECKSUM,
                   every: int = CHUNK) -> Any:
        """Starts reading values [a, b) of the committed 1-D array at `key`: a future of
        (values, the `checksum` of each `every`-value piece, or None). On a local disk, for
        arrays in jaxscale's layout, the chunk files are read directly and hashed as they
        arrive (`chunkfiles.py`: 30-50% less CPU than the zarr driver); otherwise through
        tensorstore, and the caller hashes. Callers compare the sums with the manifest's."""
        if self._chunk_files is not None:
            started = self._chunk_files.start_read(key, dtype, a, b, _HASH[checksum], every)
            if started is not None:
                return started
        return _Unhashed(self.array(key)[a:b].read())

    def start_write(self, key: str, array: Any, dtype: str, a: int, values: np.ndarray) -> Any:
        """Starts writing `values` at [a, a + n) of `array`, which this process created at
        `key` with `array()`: a future. On a local disk the chunk files are written directly,
        with O_DIRECT where allowed (`chunkfiles.py`), else through tensorstore."""
        if self._chunk_files is not None:
            started = self._chunk_files.start_write(key, dtype, a, values)
            if started is not None:
                return started
        return array[a:a + values.size].write(values)

    def sync(self) -> None:
        """Makes every array written so far durable, before a commit names it.

        On a local or NFS disk, arrays are written without one fsync per chunk file (which
        capped writes at ~0.4 GB/s) and made durable here with a single syncfs of the store's
        filesystem; object stores (gs, s3) are durable when a write completes."""
        if not self._unsynced:
            return
        fd = os.open(self.spec["path"], os.O_RDONLY)
        try:
            if getattr(_LIBC, "syncfs", None) is None or _LIBC.syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)
        self._unsynced = False

    def read(self, key: str) -> bytes | None:
        check_path(self.spec, key, leaf_is_dir=False)  # never a link, FIFO or device
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

    def delete_prefix(self, prefix: str) -> None:
        """Deletes every key under `prefix/` (unpublished or scratch data only)."""
        prefix = prefix.rstrip("/") + "/"
        self.kv.delete_range(ts.KvStore.KeyRange(prefix, prefix + "\xff")).result()

    def keys(self, prefix: str) -> list[str]:
        rng = ts.KvStore.KeyRange(prefix, prefix + "\xff")
        return [k.decode() for k in self.kv.list(rng).result()]

    def array(self, key: str, size: int | None = None, dtype: str | None = None):
        """Opens (size None; cached, so only for committed data) or creates a 1-D zarr3 array."""
        spec = {"driver": "zarr3", "kvstore": {**self.spec, "path": self.spec["path"] + key + "/"}}
        if size is None:
            if key not in self._handles:
                if len(self._handles) > 4096:
                    self._handles.clear()
                self._handles[key] = ts.open(spec, context=_CONTEXT, open=True).result()
            return self._handles[key]
        spec["metadata"] = {"shape": [size], "data_type": dtype, "chunk_grid": {
            "name": "regular", "configuration": {"chunk_shape": [min(self.chunk, max(size, 1))]}}}
        if self.spec["driver"] == "file":  # see sync()
            spec["kvstore"]["file_io_sync"] = False
            self._unsynced = True
        return ts.open(spec, context=_CONTEXT, create=True, delete_existing=True).result()
