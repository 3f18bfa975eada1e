"""The small files of a workdir (config.json, metrics.jsonl, events.jsonl, TensorBoard events) on
a local path, gs:// or s3://.

Why a module: object stores have no append and no rename, but a single PUT replaces an object
atomically, so on a bucket each file is rewritten whole (a reader sees the old or the new
object, never a torn one), and TensorBoard, whose writer appends to local files, writes to a
local mirror that is uploaded (`TensorBoardMirror`). Checkpoints are not here: orbax and
tensorstore write them straight to the store (`jaxscale.storage.orbax_paths`).

Outages: on a bucket every read and write is retried under `config.storage.retry_s`
(`retry.for_workdir`, shared with the run's checkpoints), each request with tensorstore's
short per-request retries; a write is one whole-object PUT, so re-issuing it is harmless.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any, TextIO

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.storage import locations
from jaxscale.storage.diskfull import naming_a_full_disk
from jaxscale.storage.retry import REQUEST_RETRIES, for_workdir

TB_UPLOAD_EVERY_S = 30.0  # events are a convenience: upload a growing file at most this often


def _object(location: str) -> tuple[Any, str]:
    """(tensorstore kvstore of the parent prefix, key) of a file on a bucket. Tensorstore, not
    fsspec: one GET reads a whole object even while a writer replaces it (s3fs pins the ETag
    across ranged reads and fails with FileExpired when the object changes under it)."""
    import tensorstore as ts

    parent, _, name = location.rstrip("/").rpartition("/")
    spec = locations.kvstore_spec(parent)
    if spec["driver"] == "s3":  # a dead endpoint fails in seconds; the retry policy waits
        spec["context"] = {"s3_request_retries": REQUEST_RETRIES}
    return ts.KvStore.open(spec).result(), name


def read_bytes(location: str) -> bytes | None:
    """The file's bytes, or None if it does not exist."""
    if locations.is_remote(location):
        def read(timeout_s: float | None) -> bytes | None:
            kv, key = _object(location)
            got = kv.read(key).result(timeout=timeout_s)
            return got.value if got.state == "value" else None
        return for_workdir(location).call(f"reading {location}", read)
    if not os.path.exists(location):
        return None
    with open(location, "rb") as f:
        return f.read()


def write_bytes(location: str, data: bytes) -> None:
    """One PUT on a bucket (readers see the old or the new object); a plain write locally."""
    if locations.is_remote(location):
        def write(timeout_s: float | None) -> None:
            kv, key = _object(location)
            kv.write(key, data).result(timeout=timeout_s)
        for_workdir(location).call(f"writing {location}", write, len(data))
        return
    with open(location, "wb") as f:
        f.write(data)


def read_text(location: str) -> str | None:
    """The file's UTF-8 text, or None if it does not exist. A directory, an unreadable file or
    bytes that are not text are one paragraph naming the file: a bare IsADirectoryError or
    UnicodeDecodeError names neither the file nor the fix."""
    if locations.is_remote(location):
        data = read_bytes(location)
    elif not os.path.exists(location):
        return None
    else:
        try:
            with open(location, "rb") as f:
                data = f.read()
        except OSError as e:  # a directory, no read permission
            raise _unreadable(location, e.strerror or str(e)) from None
    try:
        return None if data is None else data.decode()
    except UnicodeDecodeError as e:
        raise _unreadable(location, f"not UTF-8 text: byte {e.start} is 0x{e.object[e.start]:02x}"
                          ) from None


def _unreadable(location: str, why: str) -> JaxscaleError:
    return JaxscaleError(paragraph(
        f"{location} cannot be read as a text file ({why}): it is a directory, not readable, or",
        "holds something other than what jaxscale wrote there. Move it aside (or restore it",
        "from a copy) and rerun."))


def read_json(location: str) -> Any:
    """The file's JSON value, or None if it does not exist; a file that does not parse (cut
    short by a full disk, edited by hand) is one paragraph naming it, not a JSONDecodeError."""
    text = read_text(location)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise JaxscaleError(paragraph(
            f"{location} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): it",
            "was cut short or edited by hand. Restore it from a copy, or rerun the command that",
            "wrote it (`jaxscale train` writes config.json, `jaxscale convert --from_hf` writes",
            "model_config.json).",
        )) from None


def write_text(location: str, text: str) -> None:
    """Replaces the file atomically: one PUT on an object store, write-then-rename locally."""
    if locations.is_remote(location):
        write_bytes(location, text.encode())
        return
    os.makedirs(os.path.dirname(os.path.abspath(location)), exist_ok=True)
    tmp = location + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, location)


class LineLog:
    """A text file of whole lines that only grows (metrics.jsonl, events.jsonl), appended line by
    line. Locally each line is flushed at once, so a kill leaves whole lines or one cut-short last
    line, after which the next writer starts a line of its own; on gs:// / s3:// (no append) the
    whole object is rewritten at each line (one PUT: a reader sees every line up to the last).
    Opened lazily, on the first line."""

    def __init__(self, location: str):
        self.location = location
        self._remote = locations.is_remote(location)
        self._file: TextIO | None = None
        self._text: str | None = None  # remote: the object's content

    def append(self, line: str) -> None:
        """Adds `line` (ending in a newline) to the file."""
        if self._remote:
            if self._text is None:
                # bytes that are not UTF-8 (a damaged file) become a line no reader parses
                self._text = (read_bytes(self.location) or b"").decode("utf-8", "replace")
                if self._text and not self._text.endswith("\n"):
                    self._text += "\n"
            self._text += line
            write_text(self.location, self._text)
            return
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.location)), exist_ok=True)
            cut = os.path.exists(self.location) and _ends_without_newline(self.location)
            self._file = open(self.location, "a")
            if cut:
                self._file.write("\n")
        # A full disk, not a broken file: named, in one paragraph. What part of the line was
        # not written stays buffered; `close` (once space is freed) completes it, or the file
        # ends in one cut-short line, which readers skip.
        with naming_a_full_disk(self.location):
            self._file.write(line)
            self._file.flush()

    def replace(self, text: str) -> None:
        """Replaces the whole file with `text` atomically (the old or the new file, never a mix)."""
        self.close()
        write_text(self.location, text)
        if self._remote:
            self._text = text

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _ends_without_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


class TensorBoardMirror:
    """Where TensorBoard writes for a workdir: WORKDIR/tensorboard itself when local; for a
    bucket, a local temporary directory whose event files are uploaded to
    WORKDIR/tensorboard/ (`sync`: at most every TB_UPLOAD_EVERY_S, and always on `close`, which
    then removes the directory; one whose last upload failed is kept, so no event is lost)."""

    def __init__(self, workdir: str):
        self.remote = locations.join(workdir, "tensorboard")
        self.is_remote = locations.is_remote(workdir)
        self.local = (tempfile.mkdtemp(prefix="jaxscale-tensorboard-") if self.is_remote
                      else self.remote)
        self._uploaded: dict[str, int] = {}
        self._last = 0.0

    def sync(self, force: bool = False) -> None:
        """Uploads event files that grew since the last upload."""
        if not self.is_remote or (not force and time.monotonic() - self._last
                                  < TB_UPLOAD_EVERY_S):
            return
        self._last = time.monotonic()
        for root, _, files in os.walk(self.local):
            for name in files:
                src = os.path.join(root, name)
                rel = os.path.relpath(src, self.local)
                size = os.path.getsize(src)
                if self._uploaded.get(rel) != size:
                    with open(src, "rb") as f:
                        write_bytes(locations.join(self.remote, rel), f.read())
                    self._uploaded[rel] = size

    def close(self) -> None:
        self.sync(force=True)
        if self.is_remote:
            shutil.rmtree(self.local, ignore_errors=True)
