"""Orbax checkpoints on every location `jaxscale.storage.locations` accepts, s3:// included.

Why this module exists: orbax 0.12 builds the tensorstore kvstore spec of every array from the
checkpoint path itself (`tensorstore_utils.build_kvstore_tspec`), and knows only two kinds of
path: `gs://` (tensorstore's gcs driver) and absolute local paths (the file driver). An
`s3://bucket/run` path is normalised to `s3:/bucket/run` and refused ("Checkpoint path should
be absolute"), and even if it were accepted it would carry no endpoint, so MinIO, Ceph, R2 or
SeaweedFS could not be reached. `install()` wraps that one function: an `s3://` directory is
handed to orbax's own gs:// branch (same OCDBT layout, same remote-storage tuning) and every
gcs driver spec in the result is swapped for `storage.kvstore_spec` of the same bucket and key,
which carries `config.storage.s3_endpoint` / `AWS_ENDPOINT_URL_S3` and the region. Arrays are
then written by tensorstore straight to the server; everything else orbax writes (metadata,
the commit marker) goes through `etils.epath`, which `storage` points at the same server.

Object stores have no atomic directory rename, so remote checkpoints use orbax's commit-file
protocol (a step counts once `commit_success.txt` is written last), as orbax already does for
gs://. Checked against orbax-checkpoint 0.12.x (pinned in pyproject.toml).

Outages: the S3 specs carry tensorstore's short per-request retries (`retry.REQUEST_RETRIES`)
instead of its default quarter of an hour, so a dead endpoint fails a save's background
commit within seconds and `jaxscale.train.checkpoint` retries the save under `config.storage.retry_s`;
a step left half-written by it has no commit file and is removed (`discard_partial`) before
the save is made again. orbax logs such a failure with its whole botocore traceback from its
background thread; `quiet_outage_logs` drops those records (the retry logs the outage once),
and `drop_orphaned_echoes` the tracebacks of the reads or writes left in flight when orbax gives
up on a step (a broken step on restore, an outage on save).
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import shutil
import sys
import traceback
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import tensorstore_utils as _ts_utils

from jaxscale.storage import locations
from jaxscale.storage.diskfull import is_disk_full
from jaxscale.storage.retry import REQUEST_RETRIES, is_outage

COMMIT_FILE = "commit_success.txt"  # orbax's marker of a finished step (commit-file protocol)
_GS_ALIAS = "gs://"


def _to_s3(spec: Any) -> Any:
    """`spec` with every gcs kvstore driver replaced by the S3 driver of the same key."""
    if isinstance(spec, list):
        return [_to_s3(v) for v in spec]
    if not isinstance(spec, dict):
        return spec
    if spec.get("driver") in ("gcs", "gcs_grpc") and "bucket" in spec:
        s3 = locations.kvstore_spec(f"s3://{spec['bucket']}")
        extra = {k: v for k, v in spec.items() if k not in ("driver", "bucket", "path")}
        return {**s3, **extra, "path": spec.get("path", ""),
                "context": {"s3_request_retries": REQUEST_RETRIES}}
    return {k: _to_s3(v) for k, v in spec.items()}


def _kvstore_spec(location: str) -> dict:
    """`locations.kvstore_spec` with tensorstore's short per-request retries on S3."""
    spec = locations.kvstore_spec(location)
    if spec["driver"] == "s3":
        spec["context"] = {"s3_request_retries": REQUEST_RETRIES}
    return spec


def _wrap(build: Any) -> Any:
    @functools.wraps(build)
    def build_kvstore_tspec(directory: Any, name: str | None = None, **kwargs: Any) -> Any:
        text = str(directory)
        if not text.startswith("s3://"):
            return build(directory, name, **kwargs)
        return _to_s3(build(_GS_ALIAS + text[len("s3://"):], name, **kwargs))

    build_kvstore_tspec.jaxscale_s3 = True
    return build_kvstore_tspec


def install() -> None:
    """Routes orbax's s3:// array specs through `jaxscale.storage.locations` (idempotent)."""
    current = _ts_utils.build_kvstore_tspec
    if not getattr(current, "jaxscale_s3", False):
        _ts_utils.build_kvstore_tspec = _wrap(current)


def atomicity_options(location: str) -> Any:
    """Commit-file steps on object stores (no atomic rename there), orbax's default locally."""
    if not locations.is_remote(location):
        return None
    return ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)


def path(location: str) -> Any:
    """The `etils.epath.Path` orbax should be given for `location` (adapters installed)."""
    install()
    if str(location).startswith("s3://"):
        _keep_directories_of_existing_buckets()
    return locations.epath(location)


@functools.cache
def _keep_directories_of_existing_buckets() -> None:
    """s3fs creates a directory under a bucket (orbax: a step's, `mkdir(parents=True,
    exist_ok=False)`) as nothing at all once the bucket exists. When its probe of the bucket
    failed in an outage, it creates the bucket instead, and the server, back by then, refuses:
    "it exists" (BucketAlreadyExists / BucketAlreadyOwnedByYou, a FileExistsError), or the
    region s3fs names (AWS's us-east-1, moto: EINVAL), or AccessDenied for a key without
    s3:CreateBucket. Any of those failed the save and the run as the server came back. So a
    failed creation under a bucket is followed by the probe again: a bucket that answers now is
    all such a directory needs, success, as it would have been had the first probe been
    answered; a bucket that still does not answer leaves the error standing (an outage's is
    retried by `retry`). The bucket itself, made again, is still a FileExistsError.
    Checked against s3fs 2026.9.x (pinned in pyproject.toml): `_makedirs` calls `_mkdir`."""
    import s3fs

    mkdir = s3fs.S3FileSystem._mkdir

    @functools.wraps(mkdir)
    async def _mkdir(self: Any, target: str, *args: Any, **kwargs: Any) -> None:
        try:
            return await mkdir(self, target, *args, **kwargs)
        except OSError:  # FileExistsError, PermissionError, EINVAL, an outage's
            bucket, key, _ = self.split_path(target)
            if not key:
                raise
            self.invalidate_cache(bucket)
            if not await self._exists(bucket):  # still no answer: the error stands
                raise
            return None
    s3fs.S3FileSystem._mkdir = _mkdir


def is_complete(step_dir: Any, remote: bool) -> bool:
    """Whether a step directory is a finished save: on object stores its commit file exists
    (a step killed mid-save has the step's name but no commit file); locally orbax renames the
    temporary directory only when the save is complete, so the name suffices."""
    return not remote or (step_dir / COMMIT_FILE).exists()


def discard_partial(root: str, timeout_s: float | None = None) -> list[str]:
    """Deletes the step directories under a bucket's checkpoints directory that have no commit
    file (a save cut short by an outage), commit file first, so that orbax can write those
    steps again; returns their names. Locally orbax never renames an unfinished step."""
    if not locations.is_remote(root):
        return []
    base = path(root)
    if not base.is_dir():
        return []
    gone = [p for p in base.iterdir() if p.name.isdigit() and not is_complete(p, True)]
    for step_dir in gone:
        _delete_prefix(str(step_dir), timeout_s)
    return [p.name for p in gone]


def remove_unfinished(root: str) -> list[str]:
    """Deletes orbax's temporary step directories under a local checkpoints directory (a save
    cut short: a full disk, a crash, a kill; never listed, never restored, and named by the
    time they began, so a later save of the same step never reuses them); returns their names,
    sorted. On a bucket an unfinished step is the step itself without a commit file
    (`discard_partial`), so nothing is done here."""
    if locations.is_remote(root):
        return []
    removed = sorted(glob.glob(os.path.join(glob.escape(root), "*.orbax-checkpoint-tmp*")))
    for tmp in removed:
        shutil.rmtree(tmp, ignore_errors=True)
    return [os.path.basename(tmp) for tmp in removed]


def remove_left_unfinished(root: str) -> None:
    """At a run's start, before any save of its own: deletes the unfinished steps an earlier
    run left (they hold up to a whole state's bytes each, which nothing else would reclaim),
    with one note naming them."""
    removed = remove_unfinished(root)
    if removed:
        print(f"jaxscale: note: removed {len(removed)} unfinished checkpoint step(s) an earlier "
              f"run left in {root} ({', '.join(removed)}): never complete, never restorable.",
              file=sys.stderr, flush=True)


def move_step(src: Any, dst: Any) -> None:
    """Renames a step directory. Object stores have no directory rename: every object under
    the step is copied by tensorstore (one GET and PUT each), then the commit file is deleted
    first, so the source never looks complete with objects missing, then the rest."""
    if not str(src).startswith(("gs://", "s3://")):
        src.rename(dst)
        return
    import tensorstore as ts

    source = ts.KvStore.open(_kvstore_spec(str(src))).result()
    target = ts.KvStore.open(_kvstore_spec(str(dst))).result()
    for key in source.list().result():
        target.write(key, source.read(key).result().value).result()
    _delete_prefix(str(src))


def _delete_prefix(location: str, timeout_s: float | None = None) -> None:
    """Deletes every object under `location`, its commit file first."""
    import tensorstore as ts

    kv = ts.KvStore.open(_kvstore_spec(location)).result(timeout=timeout_s)
    commit = COMMIT_FILE.encode()
    kv.delete_range(ts.KvStore.KeyRange(commit, commit + b"\x00")).result(timeout=timeout_s)
    kv.delete_range(ts.KvStore.KeyRange()).result(timeout=timeout_s)


class _OutageRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and (is_outage(error) or is_disk_full(error)))


@functools.cache
def quiet_outage_logs() -> None:
    """Drops the log records of orbax (absl) and of its asyncio writes ("exception was never
    retrieved") that carry an outage's or a full disk's traceback: the save is retried and the
    outage logged once by `jaxscale.storage.retry`, or the full disk reported in one paragraph
    by the checkpointer; other errors are still logged."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_OutageRecords())


_ORPHANED_READ = "Encountered error while reading array index"


class _OrphanedReadFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _ORPHANED_READ not in record.getMessage()


def _is_orphaned_read(error: BaseException | None) -> bool:
    if error is None:
        return False
    if _ORPHANED_READ in str(error) or (isinstance(error, ImportError)
                                        and "likely shutting down" in str(error)):
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
            and any(f.name == "call_soon_threadsafe" for f in frames))


@functools.cache
def drop_orphaned_echoes() -> None:
    """orbax gathers a step's array reads on an asyncio loop that it closes at the first
    failure; the reads still in flight then fail unobserved, and asyncio (a log line), the
    garbage collector ("Exception ignored") and tensorstore's completion callbacks (a closed
    loop) echo them as tracebacks, sometimes at interpreter exit. The broken step is already
    reported once, as a BrokenCheckpointWarning, so these echoes, and only these, are dropped
    from then on. A save on a bucket that an outage cut short leaves such writes too (and, at
    exit, coroutines that can no longer import anything): the outage is reported once by the
    retry policy, and these echoes are dropped the same way."""
    logging.getLogger("asyncio").addFilter(_OrphanedReadFilter())
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def unraisable_hook(report: Any) -> None:
        if not _is_orphaned_read(report.exc_value):
            unraisable(report)

    def except_hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        if not _is_orphaned_read(error):
            excepthook(kind, error, tb)
    sys.unraisablehook, sys.excepthook = unraisable_hook, except_hook
