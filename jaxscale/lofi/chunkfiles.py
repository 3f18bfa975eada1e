"""The averager's I/O on a local disk: chunk files read and written straight from numpy buffers.

Through tensorstore's zarr driver each chunk is read into a buffer of its own, decoded and
copied into the result, and each chunk written goes through a lock file, a temporary file and a
rename: on this project's 2-core test VM, 1.4-2x the CPU time of plain reads and 3-6x that of
plain writes, a large share of a round whose inputs are in the page cache. jaxscale writes every
array in one fixed zarr3 layout (1-D, the `bytes` codec, little endian, default chunk keys,
fill value 0), so on a local or NFS disk each chunk file *is* its values. `ChunkFiles` checks an
array's `zarr.json` (written by tensorstore when the array was created) against that layout and
then reads chunk files with `readinto` into one buffer, or writes them whole, on a few threads
(the GIL is released during file I/O). For anything else (object stores, another layout, a
write that does not end on a chunk boundary) it returns None and the caller uses tensorstore;
the files it writes are ordinary zarr3 chunks (tested: tensorstore reads them back).

Output chunk files are written with O_DIRECT where the filesystem allows it (from the block
buffer when it is page-aligned, else through a reused per-thread aligned buffer): the averaged
model is written once and read later, often by other machines, so copying it into the page
cache only to write it back is wasted work. On this project's VM a buffered 1 GiB write costs
2.7 CPU-seconds (fresh page-cache memory is slow to touch) and O_DIRECT 0.15, 3x faster in
wall time. (O_DIRECT does not make a file durable: the device cache and the file's metadata
still need the `Store.sync()` that precedes every COMMIT.) A filesystem that refuses O_DIRECT
or our alignment (EINVAL or EOPNOTSUPP at open or write; older tmpfs, some FUSE mounts) gets
ordinary writes from then on; a short direct write is redone through the page cache. Reads
stay buffered: the inputs may be in the cache.

Correctness does not rest on this module: every chunk read is checked against the manifest's
checksum, exactly as tensorstore's reads are, and written arrays are only named by a COMMIT
after `Store.sync()`. A missing chunk file reads as zeros (zarr's fill value: tensorstore does
not store all-zero chunks); a short one raises.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from jaxscale.lofi.manifest import DTYPES

# Output chunk files are written with O_DIRECT (Linux): buffer address, offset and length in
# multiples of ALIGN (every common device's logical block size divides it).
ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


def _layout_chunk(meta: dict, dtype: str) -> int | None:
    """The chunk size if `meta` (a zarr.json) is exactly jaxscale's layout for `dtype`."""
    try:
        grid = meta["chunk_grid"]
        chunk = grid["configuration"]["chunk_shape"]
        codecs = meta["codecs"]
        ok = (meta.get("zarr_format") == 3 and meta.get("node_type") == "array"
              and len(meta["shape"]) == 1 and isinstance(meta["shape"][0], int)
              and grid.get("name") == "regular"
              and len(chunk) == 1 and isinstance(chunk[0], int) and chunk[0] > 0
              and meta.get("data_type") == dtype and meta.get("fill_value") in (0, 0.0)
              and meta.get("chunk_key_encoding") == {"name": "default"}
              and codecs == [{"name": "bytes", "configuration": {"endian": "little"}}]
              and not meta.get("dimension_names") and not meta.get("storage_transformers"))
    except (KeyError, TypeError, AttributeError):
        return None
    return chunk[0] if ok else None


_POOL: ThreadPoolExecutor | None = None  # shared by every store: no threads per Store object


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(4, thread_name_prefix="lofi-chunkfiles")
    return _POOL


class ChunkFiles:
    """Reads and writes 1-D arrays under a local store root (see the module docstring)."""

    def __init__(self, root: str):
        self.root = root
        self._layouts: dict[tuple[str, str], tuple[int, int] | None] = {}
        self.enabled = sys.byteorder == "little"
        self.direct = O_DIRECT != 0  # cleared for good once the filesystem refuses it

    def start_read(self, key: str, dtype: str, a: int, b: int,
                   digest: Callable[[memoryview], str], every: int) -> Future | None:
        """A future of (values, the `digest` of each `every`-value piece), or None: read
        through tensorstore. Each chunk is hashed as soon as it is read, while in cache and
        off the caller's thread (when checksum pieces are the chunks, as jaxscale writes them;
        otherwise the sums are None and the caller hashes)."""
        if not self.enabled or dtype not in DTYPES:
            return None
        layout = self._layout(key, dtype)
        if layout is None:
            return None
        return _pool().submit(self._read, os.path.join(self.root, key, "c"), layout[0],
                              np.dtype(DTYPES[dtype]), a, b, digest, every)

    def start_write(self, key: str, dtype: str, a: int, values: np.ndarray) -> Future | None:
        """A future of writing `values` at [a, a + values.size) of the array created at `key`,
        or None (write through tensorstore): the range must start on a chunk boundary and end
        on one or at the array's end (then the last chunk is padded, as zarr stores it)."""
        layout = self._layout(key, dtype) if self.enabled and dtype in DTYPES else None
        if layout is None or values.dtype != np.dtype(DTYPES[dtype]) or values.ndim != 1:
            return None
        chunk, size = layout
        end = a + values.size
        if a % chunk or end > size or (end % chunk and end != size):
            return None
        return _pool().submit(self._write, os.path.join(self.root, key, "c"), chunk, a,
                              np.ascontiguousarray(values))

    def _layout(self, key: str, dtype: str) -> tuple[int, int] | None:
        """(chunk, size) of the array at `key` if in jaxscale's layout (cached: arrays are
        immutable once committed, and created once per attempt before being written)."""
        if (key, dtype) not in self._layouts:
            if len(self._layouts) > 4096:
                self._layouts.clear()
            try:
                with open(os.path.join(self.root, key, "zarr.json"), "rb") as f:
                    meta = json.loads(f.read(1 << 16))
            except (OSError, ValueError):
                meta = {}
            chunk = _layout_chunk(meta, dtype) if isinstance(meta, dict) else None
            self._layouts[(key, dtype)] = (chunk, int(meta["shape"][0])) if chunk else None
        return self._layouts[(key, dtype)]

    @staticmethod
    def _read(folder: str, chunk: int, dtype: np.dtype, a: int, b: int,
              digest: Callable[[memoryview], str], every: int
              ) -> tuple[np.ndarray, list[str] | None]:
        out = np.empty(b - a, dtype)
        raw = memoryview(out.view(np.uint8))
        size, sums = dtype.itemsize, []
        hash_per_file = every == chunk and a % chunk == 0
        for index in range(a // chunk, -(-b // chunk)):
            lo, hi = max(index * chunk, a), min((index + 1) * chunk, b)
            view = raw[(lo - a) * size:(hi - a) * size]
            try:
                with open(os.path.join(folder, str(index)), "rb", buffering=0) as f:
                    f.seek((lo - index * chunk) * size)
                    got = _fill(f, view)
            except FileNotFoundError:
                out[lo - a:hi - a] = 0
                got = len(view)
            if got != len(view):
                raise OSError(f"chunk file {folder}/{index} is truncated ({got} of "
                              f"{len(view)} bytes)")
            if hash_per_file:
                sums.append(digest(view))
        return out, (sums if hash_per_file and a < b else None)  # None: the caller hashes

    def _write(self, folder: str, chunk: int, a: int, values: np.ndarray) -> None:
        os.makedirs(folder, exist_ok=True)
        raw, size = values.view(np.uint8), values.dtype.itemsize
        for index, lo in enumerate(range(0, values.size, chunk), start=a // chunk):
            piece = raw[lo * size:(lo + chunk) * size]
            if piece.size < chunk * size:  # the array's last chunk: zarr stores it whole
                piece = np.concatenate([piece, np.zeros(chunk * size - piece.size, np.uint8)])
            self._write_file(os.path.join(folder, str(index)), piece)

    def _write_file(self, path: str, data: np.ndarray) -> None:
        """Writes one chunk file, bypassing the page cache where the filesystem allows."""
        if self.direct and data.size % ALIGN == 0 and self._write_direct(path, _aligned(data)):
            return
        fd = os.open(path, _CREATE, 0o666)  # O_TRUNC: a refused direct attempt leaves nothing
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)

    def _write_direct(self, path: str, data: np.ndarray) -> bool:
        """Writes `data` (aligned) with O_DIRECT in one call; False if that was refused or
        short (then the caller rewrites the whole file through the page cache). A filesystem
        that refuses O_DIRECT, or our alignment, is not asked again by this store."""
        try:
            fd = os.open(path, _CREATE | O_DIRECT, 0o666)
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            self.direct = False
            return False
        try:
            done = os.write(fd, data)
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            self.direct, done = False, -1
        finally:
            os.close(fd)
        return done == data.size  # short (e.g. a nearly full disk): the buffered path decides


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
# How a filesystem says it has no O_DIRECT, or wants stricter alignment (FUSE and overlay
# setups may answer EOPNOTSUPP rather than EINVAL).
_REFUSED = {errno.EINVAL} | {getattr(errno, name) for name in ("EOPNOTSUPP", "ENOTSUP")
                             if hasattr(errno, name)}
_BOUNCE = threading.local()


def aligned_empty(n: int, dtype: np.dtype | str) -> np.ndarray:
    """An uninitialised 1-D array whose data starts on an ALIGN boundary (O_DIRECT needs it)."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + n * dtype.itemsize].view(dtype)


def _aligned(data: np.ndarray) -> np.ndarray:
    """`data` itself if it starts on an ALIGN boundary, else a copy in this thread's reusable
    aligned buffer (a chunk-sized memcpy that stays in cache)."""
    if data.ctypes.data % ALIGN == 0:
        return data
    bounce = getattr(_BOUNCE, "buffer", None)
    if bounce is None or bounce.size < data.size:
        bounce = _BOUNCE.buffer = aligned_empty(data.size, np.uint8)
    bounce[:data.size] = data
    return bounce[:data.size]


def _write_all(fd: int, data: np.ndarray) -> None:
    """os.write until all of `data` is written (a write may take less than offered)."""
    view, done = memoryview(data), 0
    while done < len(view):
        wrote = os.write(fd, view[done:])
        if wrote <= 0:
            raise OSError(errno.EIO, f"write made no progress after {done} of {len(view)} bytes")
        done += wrote


def _fill(f, view: memoryview) -> int:
    """readinto until `view` is full or the file ends (a read may return less than asked)."""
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            break
        done += got
    return done
