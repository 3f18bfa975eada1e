"""A step directory created on a bucket while its server comes back from an outage, against a
real SeaweedFS of its own (killed and restarted on the same ports and data).

orbax creates a step directory with `mkdir(parents=True, exist_ok=False)`, which s3fs turns
into "does the bucket exist? if not, create it". s3fs reads any failure of its bucket probes
(head_bucket, get_bucket_location) as "no such bucket", so a server that is down for the probes
and back for the create_bucket that follows answers BucketAlreadyOwnedByYou, which s3fs raised
as FileExistsError: a save, and the run, died at the end of an outage it should have ridden
out. Here the server is killed, and restarted exactly between the probes and create_bucket (a
hook on s3fs's own S3 call), so that order is met every time, not by chance. The bucket is then
probed again, and the directory created; the bucket itself, created again, is still a
FileExistsError (it does exist), and so is an existing directory, raised at once, not retried
as an outage. On moto (as on AWS's
us-east-1) the same order ends in create_bucket refusing the region s3fs names: the bucket is
then probed again, and the directory created."""

import asyncio
import logging
import threading

import pytest
import s3fs

from jaxscale.storage import locations, orbax_paths
from jaxscale.storage.retry import for_workdir, is_outage
from tests import servers

pytestmark = [pytest.mark.xdist_group("seaweedfs-storage-outage")]
# create_bucket's answers for our own bucket: SeaweedFS says the first right after a restart.
BUCKET_EXISTS = (["BucketAlreadyExists"], ["BucketAlreadyOwnedByYou"])


@pytest.fixture(scope="module")
def own_seaweedfs():
    yield from servers.own(servers.SeaweedFS)


@pytest.fixture
def bucket(own_seaweedfs, monkeypatch):
    for key, value in own_seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    locations.configure(retry_s=30.0)  # and a fresh s3fs: nothing it knows of the bucket
    yield own_seaweedfs.make_bucket()
    locations.configure()


class _BackForBucketCreation:
    """s3fs with a hook on its S3 calls: `run(op)` kills the server, runs `op` in a thread and
    restarts the server (from the main thread, which it must not outlive) when s3fs, its bucket
    probes failed, is about to call create_bucket; `answers`: what create_bucket got."""

    def __init__(self, server: servers.Server, patch: pytest.MonkeyPatch):
        self.server, self.answers = server, []
        self.reached, self.back = threading.Event(), threading.Event()
        call = s3fs.S3FileSystem._call_s3

        async def call_s3(fs, method, *args, **kwargs):
            if method != "create_bucket":
                return await call(fs, method, *args, **kwargs)
            self.reached.set()
            await asyncio.to_thread(self.back.wait, 120)
            try:
                result = await call(fs, method, *args, **kwargs)
            except Exception as e:
                answer = getattr(e.__cause__, "response", {}).get("Error", {})  # botocore's
                self.answers.append(answer.get("Code", type(e).__name__))
                raise
            self.answers.append("created")
            return result
        patch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)

    def run(self, op) -> BaseException | None:
        """What `op` raised, if anything."""
        raised: list[BaseException] = []

        def target():
            try:
                op()
            except BaseException as e:  # returned to the test
                raised.append(e)
        self.server.kill()
        worker = threading.Thread(target=target)
        worker.start()
        if self.reached.wait(120):
            self.server.start()
        self.back.set()
        worker.join(300)
        assert not worker.is_alive()
        if self.server.proc is None or self.server.proc.poll() is not None:
            self.server.start()
        return raised[0] if raised else None


def test_a_step_directory_created_as_the_server_comes_back(own_seaweedfs, bucket, monkeypatch,
                                                           caplog):
    caplog.set_level(logging.WARNING, logger="jaxscale.storage")
    root = f"s3://{bucket}/run/checkpoints"
    step = orbax_paths.path(f"{root}/4")
    restart = _BackForBucketCreation(own_seaweedfs, monkeypatch)
    # As Checkpointer.save runs orbax's creation of a step directory: under the retry policy.
    error = restart.run(lambda: for_workdir(root).call(
        "saving checkpoint step 4", lambda _: step.mkdir(parents=True, exist_ok=False)))
    assert restart.answers in BUCKET_EXISTS  # the order of the bug was met
    assert error is None, repr(error)
    (step / "commit_success.txt").write_text("ok")  # the directory is usable
    assert [p.name for p in orbax_paths.path(root).iterdir()] == ["4"]
    assert (step / "commit_success.txt").read_text() == "ok"


def test_the_bucket_itself_and_an_existing_directory_still_exist(own_seaweedfs, bucket,
                                                                 monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="jaxscale.storage")
    with monkeypatch.context() as patch:
        restart = _BackForBucketCreation(own_seaweedfs, patch)
        error = restart.run(lambda: orbax_paths.path(f"s3://{bucket}").mkdir(
            parents=True, exist_ok=False))
    assert restart.answers in BUCKET_EXISTS
    assert isinstance(error, FileExistsError) and not is_outage(error), repr(error)

    root = f"s3://{bucket}/run/checkpoints"  # s3fs as it is from here; the server is up
    (orbax_paths.path(f"{root}/4") / "commit_success.txt").write_text("ok")
    attempts = []

    def mkdir(_):  # as orbax creates a step's subdirectory
        attempts.append(1)
        orbax_paths.path(f"{root}/4").mkdir(parents=False, exist_ok=False)
    with pytest.raises(FileExistsError):
        for_workdir(root).call("saving checkpoint step 4", mkdir)
    assert len(attempts) == 1  # not retried as an outage
    assert servers.outage_lines(caplog, "jaxscale.storage") == ([], [])


def test_a_refused_bucket_creation_is_answered_by_the_probe_again(moto, monkeypatch):
    """moto, like AWS's us-east-1, refuses create_bucket's LocationConstraint (s3fs sends the
    region): the same outage order there ends in EINVAL, not "it exists". The probes fail as in
    an outage until s3fs calls create_bucket (a hook on s3fs's S3 call; moto keeps its buckets
    in memory, so a restart would lose them); the directory is then created, the bucket's
    second probe answering."""
    from botocore.exceptions import EndpointConnectionError

    _, bucket = moto
    locations.configure(retry_s=30.0)  # a fresh s3fs: nothing it knows of the bucket
    answers: list[str] = []
    call = s3fs.S3FileSystem._call_s3

    async def call_s3(fs, method, *args, **kwargs):
        if not answers and method in ("head_bucket", "get_bucket_location"):
            raise EndpointConnectionError(endpoint_url="http://down")
        try:
            return await call(fs, method, *args, **kwargs)
        except Exception as e:
            if method == "create_bucket":
                answers.append(getattr(e.__cause__, "response", {}).get("Error", {})
                               .get("Code", type(e).__name__))
            raise
    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
    try:
        root = f"s3://{bucket}/run/checkpoints"
        step = orbax_paths.path(f"{root}/4")
        for_workdir(root).call("saving checkpoint step 4",
                               lambda _: step.mkdir(parents=True, exist_ok=False))
        assert answers == ["InvalidLocationConstraint"]  # the order was met
        (step / "commit_success.txt").write_text("ok")
        assert [p.name for p in orbax_paths.path(root).iterdir()] == ["4"]
    finally:
        locations.configure()
