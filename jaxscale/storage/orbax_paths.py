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
"""

from __future__ import annotations

import functools
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import tensorstore_utils as _ts_utils

from jaxscale.storage import locations

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
        return {**s3, **extra, "path": spec.get("path", "")}
    return {k: _to_s3(v) for k, v in spec.items()}


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
    """The `etils.epath.Path` orbax should be given for `location` (adapter installed)."""
    install()
    return locations.epath(location)


def is_complete(step_dir: Any, remote: bool) -> bool:
    """Whether a step directory is a finished save: on object stores its commit file exists
    (a step killed mid-save has the step's name but no commit file); locally orbax renames the
    temporary directory only when the save is complete, so the name suffices."""
    return not remote or (step_dir / COMMIT_FILE).exists()
