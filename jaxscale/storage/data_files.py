"""Data files wherever they live: a local path or an object in a bucket (gs://, s3://).

Why one module: the document readers (`documents.py`, `text_readers.py`) address a document
by file and byte offset, so that a process reads only the documents of its own rows. On a
local disk that is `open` + `seek` (or a memory map); in a bucket it must be an HTTP range
request, never a download of the whole file. These few functions are the readers' only way to
reach a file, so the two cases stay the same everywhere: `glob` expands a pattern (fsspec's
glob for buckets, sorted full URLs), `size` and `read_range` are stateless (safe from grain's
reader threads), `open_binary` streams a whole file (a jsonl file's line scan, parquet's
random access). Endpoints and credentials come from `jaxscale.storage.locations` (config.storage or
the standard AWS_* / Google variables), as for every other location.
"""

from __future__ import annotations

import glob as globlib
import os
from typing import IO, Any

from jaxscale.storage import locations

LINE_READ = 1 << 16  # bytes fetched per request while looking for the end of a jsonl line


def _fs(location: locations.Location) -> Any:
    import fsspec

    locations.epath(location.url())  # applies the endpoint / emulator settings to fsspec
    return fsspec.filesystem("gcs" if location.scheme == "gs" else "s3")


def _key(location: locations.Location) -> str:
    return f"{location.bucket}/{location.path}"


def glob(pattern: str) -> list[str]:
    """The files matching `pattern` (`**` recurses), sorted; URLs keep their scheme."""
    loc = locations.parse(pattern)
    if not loc.remote:  # names as the pattern gives them (relative stays relative)
        local = pattern[len("file://"):] if pattern.startswith("file://") else pattern
        found = globlib.glob(os.path.expanduser(local), recursive=True)
        return sorted(f for f in found if os.path.isfile(f))
    found = _fs(loc).glob(_key(loc), detail=True)
    return sorted(f"{loc.scheme}://{name}" for name, info in found.items()
                  if info.get("type") == "file")


def size(path: str) -> int:
    loc = locations.parse(path)
    return os.path.getsize(loc.path) if not loc.remote else int(_fs(loc).size(_key(loc)))


def fingerprint(path: str) -> str:
    """Names this version of a file (for caches): path, size and modification time, or for
    an object its URL, size and ETag / generation (a rewritten object gets a new one)."""
    loc = locations.parse(path)
    if not loc.remote:
        st = os.stat(loc.path)
        return f"{loc.path}|{st.st_size}|{st.st_mtime_ns}"
    info = _fs(loc).info(_key(loc))
    version = next((str(info[k]) for k in ("ETag", "etag", "generation", "md5Hash",
                                           "LastModified", "updated") if info.get(k)), "")
    return f"{loc.url()}|{info.get('size')}|{version}"


def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file: one seek and read, or one HTTP range request."""
    loc = locations.parse(path)
    if loc.remote:
        return _fs(loc).cat_file(_key(loc), start=start, end=end)
    with open(loc.path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def read_line(path: str, offset: int) -> bytes:
    """The line starting at byte `offset` (with its newline, if any)."""
    loc = locations.parse(path)
    if not loc.remote:
        with open(loc.path, "rb") as f:
            f.seek(offset)
            return f.readline()
    parts, pos = [], offset
    while True:
        try:
            part = read_range(path, pos, pos + LINE_READ)
        except Exception:  # a range starting at the end of the object (416)
            if not parts:
                raise
            return b"".join(parts)
        newline = part.find(b"\n")
        if newline >= 0 or len(part) < LINE_READ:
            parts.append(part if newline < 0 else part[:newline + 1])
            return b"".join(parts)
        parts.append(part)
        pos += len(part)


def open_binary(path: str) -> IO[bytes]:
    """A seekable binary file object (buffered range requests for a bucket object)."""
    loc = locations.parse(path)
    return open(loc.path, "rb") if not loc.remote else _fs(loc).open(_key(loc), "rb")


def is_local(path: str) -> bool:
    return not locations.parse(path).remote


def local_path(path: str) -> str:
    """A local file's path as the OS takes it (`file://` dropped)."""
    return path[len("file://"):] if path.startswith("file://") else path
