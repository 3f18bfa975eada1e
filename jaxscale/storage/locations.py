"""One notion of a storage location: a local path, `file://path`, `gs://bucket/prefix`,
`s3://bucket/prefix` (and `memory://name` for tests), turned into a tensorstore kvstore spec
and an `etils.epath.Path` that reach the same bytes.

Why one module: the workdir, `init_from`, the Lo-Fi store and converters all take locations;
if each parsed URLs itself, an S3 endpoint set in one place would be ignored in another (as
tensorstore ignores `AWS_ENDPOINT_URL`). Settings for S3-compatible servers (MinIO, Ceph,
R2, SeaweedFS) come from `config.storage` (applied with `configure`) or else the standard
`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` / `AWS_REGION` variables; credentials only from
the standard AWS / Google credential chains, never from a config or a log line.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import urllib.parse
from typing import Any

from jaxscale.errors import ConfigError, JaxscaleError, paragraph

SCHEMES = ("file://", "gs://", "s3://", "memory://")
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRY_S = 300.0   # how long Lo-Fi store operations ride out an outage (lofi/retry.py)
# S3-compatible servers other than AWS honour If-None-Match / If-Match on PUT (measured on
# SeaweedFS and moto, see docs/object-stores.md), but tensorstore only sends them to *.amazonaws.com unless
# told to: without them its create-if-absent is a HEAD then a PUT, which two writers can race.
_CONDITIONAL_WRITE_ENV = "TENSORSTORE_S3_USE_CONDITIONAL_WRITE"


class StorageError(JaxscaleError):
    """A location cannot be used: bad scheme, unreachable endpoint, missing bucket, denied."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Where S3 requests go, how long one request may take, and how long an outage is
    ridden out before giving up (config.storage)."""

    s3_endpoint: str = ""
    s3_region: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    retry_s: float = DEFAULT_RETRY_S


_settings = Settings()


def configure(storage: Any = None, **overrides: Any) -> Settings:
    """Applies `config.storage` (or keyword overrides) process-wide and to fsspec's s3fs, so
    epath, orbax and tensorstore reach the same endpoint. Returns the settings in force."""
    global _settings
    fields = {f.name for f in dataclasses.fields(Settings)}
    given = {k: storage[k] for k in fields if storage is not None and k in storage}
    _settings = dataclasses.replace(Settings(), **{**given, **overrides})
    _configure_fsspec()
    return _settings


def settings() -> Settings:
    return _settings


def make_local_dir(path: str, flag: str) -> None:
    """Creates a local directory and its parents; one paragraph naming the flag when it cannot
    be (below a regular file, read-only, no permission)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(paragraph(
            f"{flag}={path} cannot be created ({e.strerror}: {e.filename}). Give a directory",
            "path whose parents are directories you may write to.",
        )) from None


def check_settings(storage: Any) -> None:
    """The `config.storage` section (`config.validate` calls this): positive request time-out,
    a retry budget of zero or more seconds."""
    timeout, retry = storage.get("timeout_s", 30.0), storage.get("retry_s", 300.0)
    if not (timeout > 0 and retry >= 0):
        raise ConfigError(paragraph(
            f"storage.timeout_s={timeout} must be > 0 (seconds one object-store request may",
            f"take) and storage.retry_s={retry} >= 0 (seconds a Lo-Fi store outage is ridden",
            "out before the run stops; 0: fail at the first error)."))


def s3_endpoint() -> str:
    """config.storage.s3_endpoint, else AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, else ''
    (AWS itself)."""
    return (_settings.s3_endpoint or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL") or "").rstrip("/")


def s3_region() -> str:
    return (_settings.s3_region or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION") or ("us-east-1" if s3_endpoint() else ""))


@dataclasses.dataclass(frozen=True)
class Location:
    """A parsed location: scheme in {file, gs, s3, memory}; `path` is the key prefix (no
    leading or trailing '/') for buckets, the absolute path for files."""

    scheme: str
    bucket: str
    path: str

    @property
    def remote(self) -> bool:
        return self.scheme in ("gs", "s3")

    def url(self) -> str:
        if self.scheme == "file":
            return self.path
        return f"{self.scheme}://{self.bucket}/{self.path}".rstrip("/")


def parse(location: str) -> Location:
    """Parses a location; an unsupported `scheme://` is a one-paragraph StorageError."""
    text = os.fspath(location)
    if "://" in text and not text.startswith(SCHEMES):
        scheme = text.split("://", 1)[0]
        raise StorageError(paragraph(
            f"Storage location {text!r} uses the scheme {scheme}://, which jaxscale does not "
            "support.", "Use a local path, file:///abs/path, gs://bucket/prefix or "
            "s3://bucket/prefix (S3-compatible servers: set config.storage.s3_endpoint or "
            "AWS_ENDPOINT_URL_S3)."))
    for scheme in ("gs", "s3", "memory"):
        if text.startswith(f"{scheme}://"):
            bucket, _, prefix = text[len(scheme) + 3:].partition("/")
            if not bucket and scheme != "memory":
                raise StorageError(paragraph(
                    f"Storage location {text!r} names no bucket.",
                    f"Write it as {scheme}://BUCKET/prefix."))
            return Location(scheme, bucket, prefix.strip("/"))
    path = text[len("file://"):] if text.startswith("file://") else text
    return Location("file", "", os.path.abspath(os.path.expanduser(path)))


def is_remote(location: str) -> bool:
    return parse(location).remote


def join(location: str, *parts: str) -> str:
    """`location/part/...` keeping the scheme (os.path.join would break `gs://`)."""
    loc = parse(location)
    tail = "/".join(p.strip("/") for p in parts if p)
    if loc.scheme == "file":
        return os.path.join(loc.path, *parts)
    return f"{loc.scheme}://{loc.bucket}/" + "/".join(x for x in (loc.path, tail) if x)


def kvstore_spec(location: str) -> dict:
    """The tensorstore kvstore spec of a location (its `path` ends in '/', a key prefix)."""
    loc = parse(location)
    prefix = loc.path + "/" if loc.path else ""
    if loc.scheme == "gs":
        return {"driver": "gcs", "bucket": loc.bucket, "path": prefix}
    if loc.scheme == "s3":
        _conditional_writes()
        spec = {"driver": "s3", "bucket": loc.bucket, "path": prefix}
        if s3_endpoint():
            spec["endpoint"] = s3_endpoint()
        if s3_region():
            spec["aws_region"] = s3_region()
        if _env_credentials():  # only the variables: the default chain would also try to
            # read ~/.aws/config and log ~10 alarming errors when it is absent (not errors)
            spec["aws_credentials"] = {"type": "environment"}
        return spec
    if loc.scheme == "memory":
        return {"driver": "memory", "path": "/".join(x for x in (loc.bucket, loc.path) if x)
                + "/"}
    return {"driver": "file", "path": loc.path.rstrip("/") + "/"}


def epath(location: str):
    """An `etils.epath.Path` of the location (s3fs / gcsfs configured for the same servers)."""
    from etils import epath as _epath

    loc = parse(location)
    if loc.scheme == "memory":
        raise StorageError(paragraph(f"{location!r} is an in-process memory:// store; it has "
                                     "no file path.", "Use a local path, gs:// or s3://."))
    if loc.remote:
        _configure_fsspec()
    return _epath.Path(loc.url())


def _conditional_writes() -> None:
    os.environ.setdefault(_CONDITIONAL_WRITE_ENV, "1")


def _configure_fsspec() -> None:
    """Points s3fs at the S3 endpoint (fsspec applies `config.conf` to new filesystems) and
    gcsfs at a GCS emulator named by STORAGE_EMULATOR_HOST / TENSORSTORE_GCS_HTTP_URL."""
    import fsspec.config

    s3 = {}
    if s3_endpoint():
        s3["endpoint_url"] = s3_endpoint()
    if s3_region():
        s3["client_kwargs"] = {"region_name": s3_region()}
    s3["config_kwargs"] = {"connect_timeout": min(_settings.timeout_s, 60),
                           "retries": {"max_attempts": 3}}
    fsspec.config.conf["s3"] = s3
    gcs_url = os.environ.get("STORAGE_EMULATOR_HOST") or os.environ.get(
        "TENSORSTORE_GCS_HTTP_URL")
    if gcs_url:
        os.environ.setdefault("STORAGE_EMULATOR_HOST", gcs_url)
        fsspec.config.conf["gcs"] = {"endpoint_url": gcs_url, "token": "anon"}
    _clear_epath_cache()


def _clear_epath_cache() -> None:
    """epath caches one filesystem per scheme; drop it so new settings take effect."""
    try:
        import fsspec
        from etils.epath import backend

        backend.fsspec_backend._get_filesystem.cache_clear()
        for cls in _fsspec_classes():
            cls.clear_instance_cache()
        del fsspec
    except (ImportError, AttributeError):  # pragma: no cover - older etils
        pass


def _fsspec_classes():
    import fsspec.registry

    for name in ("s3", "gcs"):
        try:
            yield fsspec.registry.get_filesystem_class(name)
        except (ImportError, ValueError):
            continue


def endpoint_of(location: str) -> str:
    """The URL requests for `location` go to (for error messages)."""
    loc = parse(location)
    return _endpoint_of(loc) if loc.remote else loc.url()


def _endpoint_of(loc: Location) -> str:
    if loc.scheme == "s3":
        return s3_endpoint() or f"https://{loc.bucket}.s3.amazonaws.com"
    return (os.environ.get("TENSORSTORE_GCS_HTTP_URL") or "https://storage.googleapis.com")


def _fix_hint(loc: Location) -> str:
    if loc.scheme == "s3":
        return ("Set config.storage.s3_endpoint (or AWS_ENDPOINT_URL_S3) to the server's URL, "
                "and credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or "
                "~/.aws/credentials.")
    return ("Log in with `gcloud auth application-default login` or set "
            "GOOGLE_APPLICATION_CREDENTIALS (TENSORSTORE_GCS_HTTP_URL names an emulator).")


def check(location: str, timeout_s: float | None = None) -> None:
    """Fails fast, with one paragraph, if a bucket location cannot be used: the endpoint does
    not answer within `timeout_s` (config.storage.timeout_s), the bucket does not exist, or
    the credentials are refused. Local paths and memory:// pass. Called once before a run
    relies on a location, so a typo is not a retry loop that never ends."""
    loc = parse(location)
    if not loc.remote:
        return
    import tensorstore as ts

    timeout = _settings.timeout_s if timeout_s is None else timeout_s
    endpoint = _endpoint_of(loc)
    _connect(location, endpoint, timeout)
    try:
        kv = ts.KvStore.open(kvstore_spec(location)).result(timeout=timeout)
        # A listing, not a read: a read of a missing key in a missing bucket is "absent".
        kv.list(ts.KvStore.KeyRange(".jaxscale-probe", ".jaxscale-probf")).result(
            timeout=timeout)
    except TimeoutError:
        raise StorageError(paragraph(
            f"Storage location {location!r}: the endpoint {endpoint} did not answer within "
            f"{timeout:g} s.", "Check that the server is up and the URL is right, or raise "
            "config.storage.timeout_s.", _fix_hint(loc))) from None
    except ValueError as e:
        raise classify(location, e) from None


# S3 error codes that mean the credentials, not the bucket, are wrong -> what to tell the user.
# Checked before "does the bucket exist": an unknown key's message ("The access key ID you
# provided does not exist") would otherwise read as a missing bucket.
CREDENTIAL_ERRORS = (
    ("invalidaccesskeyid", "the server does not know this access key id"),
    ("signaturedoesnotmatch", "the secret key does not match the access key id"),
    ("expiredtoken", "the session token has expired"),
    ("invalidtoken", "the session token is not valid"),
    ("accessdenied", "the credentials are valid but may not use this bucket"),
    ("access denied", "the credentials are valid but may not use this bucket"),
)
_OTHER_REFUSALS = ("permission_denied", "403", "401", "unauthenticated", "permission",
                   "credentials")


def classify(location: str, error: Exception) -> Exception:
    """A tensorstore error on `location` as a one-paragraph StorageError where the cause is
    known (refused credentials, missing bucket), else the error unchanged."""
    loc = parse(location)
    text = str(error)
    lower = text.lower()
    why = next((w for code, w in CREDENTIAL_ERRORS if code in lower), None)
    if why is None and "nosuchbucket" not in lower and any(w in lower for w in _OTHER_REFUSALS):
        why = "access was refused"
    if why is not None:
        return StorageError(paragraph(
            f"Storage location {location!r}: {_endpoint_of(loc)} refused the credentials: "
            f"{why} ({text.split(' [')[0][:160]}). They came from {_credential_source(loc)}.",
            _fix_hint(loc)))
    if "nosuchbucket" in lower or "bucket" in lower and ("not found" in lower
                                                         or "does not exist" in lower):
        return StorageError(paragraph(
            f"Storage location {location!r}: the bucket {loc.bucket!r} does not exist at "
            f"{_endpoint_of(loc)}.", "Create it first (e.g. `aws s3 mb s3://"
            f"{loc.bucket}` / `gcloud storage buckets create gs://{loc.bucket}`) or fix the "
            "name."))
    return error


def _credential_source(loc: Location) -> str:
    """Where the credentials of a request to `loc` came from (never their values)."""
    if loc.scheme != "s3":
        return ("GOOGLE_APPLICATION_CREDENTIALS" if os.environ.get(
            "GOOGLE_APPLICATION_CREDENTIALS") else "the application-default credentials")
    if _env_credentials():
        return "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    return (f"the {os.environ.get('AWS_PROFILE', 'default')!r} profile of ~/.aws/credentials "
            "or the machine's role")


def _env_credentials() -> bool:
    return bool(os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"))


def _connect(location: str, endpoint: str, timeout: float) -> None:
    """A TCP connect to the endpoint, bounded by `timeout` (tensorstore would retry for
    minutes against a host that does not answer)."""
    url = urllib.parse.urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as e:
        raise StorageError(paragraph(
            f"Storage location {location!r}: cannot connect to the endpoint {endpoint} "
            f"within {timeout:g} s ({e.strerror or e}).", "Start the server or fix the URL "
            "(config.storage.s3_endpoint, AWS_ENDPOINT_URL_S3, TENSORSTORE_GCS_HTTP_URL); "
            "config.storage.timeout_s bounds the wait.")) from None
