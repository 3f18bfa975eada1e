"""The snapshot store's storage layer: a tensorstore kvstore for small keys, zarr3 for arrays.

Every array is a 1-D zarr3 array whose chunks carry a `crc32c` codec: tensorstore writes the
checksum with each chunk and verifies it on every read, so a flipped bit or a truncated chunk
is an error (DATA_LOSS / FAILED_PRECONDITION), never silent garbage. Arrays are written with
`store_data_equal_to_fill_value` (every chunk is stored, zeros included) and read with
`fill_missing_data_reads` off, so a deleted chunk is an error too instead of reading as zeros.
Readers open an array with the shape, dtype, chunking and codecs they expect (from the
manifest), so an array whose metadata was swapped or damaged is refused at open.

Durability: a write is complete when its tensorstore future resolves. On a local disk the file
kvstore writes each chunk to a temporary file, fsyncs it and renames it into place (its
default `file_io_sync`), so a completed write is durable and a reader never sees half a chunk;
object stores (gs, s3) hold an object once its PUT returns. A COMMIT is only written after
every write it names has completed, which is all the ordering the commit protocol needs.

Outages: on gs:// and s3:// every operation goes through `retry.py` (bounded backoff across a
server outage, one log line when it starts and one when it ends, `StoreUnavailable` when the
budget runs out); tensorstore's own per-request retries are cut short for that reason.
"""

from __future__ import annotations

import os
from typing import Any

import tensorstore as ts

from jaxscale.storage import locations as storage
from jaxscale.storage.retry import REQUEST_RETRIES, Retry, RetryingFuture
from jaxscale.weights.localfs import check_path
from jaxscale.weights.manifest import CHUNK

NO_VALUE = b"\x02"          # tensorstore's "key absent" storage generation (create-if-absent)
# Shared so memory:// stores are visible across opens in a process. More copy threads than
# cores: chunk decoding interleaves with file waits.
_CONTEXT = ts.Context(ts.Context.Spec(
    {"data_copy_concurrency": {"limit": max(4, 2 * (os.cpu_count() or 2))},
     "s3_request_retries": REQUEST_RETRIES, "gcs_request_retries": REQUEST_RETRIES}))
_CHECKED: set[str] = set()  # locations storage.check passed in this process
CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def kvstore_spec(location: str) -> dict:
    """`path`, `file://path`, `gs://bucket/prefix`, `s3://bucket/prefix`, `memory://name`:
    jaxscale.storage.locations's one parser (S3 endpoint and region from config.storage / AWS_*)."""
    return storage.kvstore_spec(location)


def array_metadata(size: int, dtype: str, chunk: int) -> dict:
    """The zarr3 metadata of every snapshot array: 1-D, `chunk` values per chunk, crc32c."""
    return {"shape": [size], "data_type": dtype, "codecs": CODECS,
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": [min(chunk, max(size, 1))]}}}


class Store:
    """A kvstore plus byte counters (for the communication accounting). Arrays it creates are
    cut into `chunk`-value chunks (recorded in each manifest)."""

    def __init__(self, location: str, chunk: int = CHUNK, retry: Retry | None = None):
        self.location = location
        self.chunk = chunk
        self.spec = kvstore_spec(location)
        if location not in _CHECKED:  # a bucket: fail fast, in one paragraph, if unusable
            storage.check(location)
            _CHECKED.add(location)
        self.retry = retry or Retry(location)  # a workdir's: `storage.retry.for_workdir`
        self.kv = self.retry.call(f"opening {location}", lambda t: ts.KvStore.open(
            self.spec, context=_CONTEXT).result(timeout=t))
        self.bytes_read = 0
        self.bytes_written = 0
        self._handles: dict[tuple, Any] = {}   # opened committed arrays (immutable data)

    def _array_spec(self, key: str) -> dict:
        return {"driver": "zarr3", "kvstore": {**self.spec, "path": self.spec["path"] + key + "/"}}

    def open_array(self, key: str, size: int, dtype: str, chunk: int) -> Any:
        """Opens the committed array at `key` for reading, checking that its stored metadata is
        exactly what the manifest says (cached: committed data never changes)."""
        handle = (key, size, dtype, chunk)
        if handle not in self._handles:
            if len(self._handles) > 4096:
                self._handles.clear()
            spec = {**self._array_spec(key), "metadata": array_metadata(size, dtype, chunk),
                    "fill_missing_data_reads": False}
            self._handles[handle] = ts.open(spec, context=_CONTEXT, open=True).result(
                timeout=self._timeout())
        return self._handles[handle]

    def array(self, key: str, size: int, dtype: str) -> Any:
        """Creates (replacing any leftover of an abandoned attempt) a 1-D zarr3 array."""
        spec = {**self._array_spec(key), "metadata": array_metadata(size, dtype, self.chunk),
                "store_data_equal_to_fill_value": True}
        return self.retry.call(f"creating {key}", lambda t: ts.open(
            spec, context=_CONTEXT, create=True, delete_existing=True).result(timeout=t))

    def started(self, what: str, start: Any, nbytes: int = 0) -> RetryingFuture:
        """A tensorstore read or write `start()` of `nbytes` begun now, retried across
        outages."""
        return self.retry.future(what, start, nbytes)

    def _timeout(self) -> float | None:
        return storage.settings().timeout_s if self.retry.enabled else None

    def read(self, key: str) -> bytes | None:
        check_path(self.spec, key, leaf_is_dir=False)  # never a link, FIFO or device
        value, _ = self.read_stamped(key)
        self.bytes_read += len(value or b"")
        return value

    def read_stamped(self, key: str) -> tuple[bytes | None, bytes]:
        """(value or None, storage generation) for conditional overwrites."""
        result = self.retry.call(f"reading {key}", lambda t: self.kv.read(key).result(timeout=t))
        return (bytes(result.value) if result.state == "value" else None), result.stamp.generation

    def write(self, key: str, data: bytes | None, if_absent: bool = False,
              if_generation: bytes | None = None) -> bool:
        """Writes `data` (None: deletes); with `if_absent` only if the key does not exist,
        with `if_generation` only if it is unchanged since read (compare-and-swap). Returns
        success."""
        condition = NO_VALUE if if_absent else if_generation
        stamp = self.retry.call(f"writing {key}", lambda t: self.kv.write(
            key, data, if_equal=condition).result(timeout=t))
        ok = stamp.generation != b""
        self.bytes_written += len(data or b"") if ok else 0
        return ok

    def delete(self, key: str) -> None:
        self.write(key, None)

    def delete_prefix(self, prefix: str) -> None:
        """Deletes every key under `prefix/` (unpublished or scratch data only)."""
        prefix = prefix.rstrip("/") + "/"
        rng = ts.KvStore.KeyRange(prefix, prefix + "\xff")
        self.retry.call(f"deleting {prefix}", lambda t: self.kv.delete_range(rng).result(
            timeout=t))

    def keys(self, prefix: str) -> list[str]:
        rng = ts.KvStore.KeyRange(prefix, prefix + "\xff")
        return [k.decode() for k in self.retry.call(
            f"listing {prefix}", lambda t: self.kv.list(rng).result(timeout=t))]
