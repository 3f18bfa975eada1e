"""jaxscale/storage/locations.py against real servers: the kvstore spec and the epath of one location
reach the same bytes on SeaweedFS, moto and fake-gcs-server; a bad scheme, an unreachable
or silent endpoint, a missing bucket and refused credentials are one-paragraph errors; and
which servers honour conditional writes (recorded in docs/object-stores.md) is measured here."""

import socket
import threading

import pytest
import tensorstore as ts

from jaxscale.storage import locations as storage
from jaxscale.storage.locations import StorageError


@pytest.fixture(autouse=True)
def _default_settings():
    storage.configure()
    yield
    storage.configure()


def test_parse_and_specs_of_every_scheme(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1/")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    assert storage.kvstore_spec("gs://b/runs/1/") == {"driver": "gcs", "bucket": "b",
                                                       "path": "runs/1/"}
    assert storage.kvstore_spec("s3://b/p") == {"driver": "s3", "bucket": "b", "path": "p/",
                                                 "endpoint": "http://127.0.0.1:1",
                                                 "aws_region": "us-east-1"}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")  # with a secret: those variables alone
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    assert storage.kvstore_spec("s3://b/p")["aws_credentials"] == {"type": "environment"}
    storage.configure(dict(s3_endpoint="http://10.0.0.1:8333", s3_region="eu-west-1"))
    spec = storage.kvstore_spec("s3://b")
    assert (spec["endpoint"], spec["aws_region"], spec["path"]) == (
        "http://10.0.0.1:8333", "eu-west-1", "")
    assert storage.kvstore_spec("file:///tmp/x/") == {"driver": "file", "path": "/tmp/x/"}
    assert storage.join("s3://b/p", "checkpoints", "3") == "s3://b/p/checkpoints/3"
    assert storage.join("/tmp/w", "c") == "/tmp/w/c"
    assert str(storage.epath("gs://b/p/q")) == "gs://b/p/q"


def test_unsupported_scheme_and_missing_bucket_name_are_one_paragraph():
    with pytest.raises(StorageError, match=r"(?s)hdfs://.*does not support.*s3://bucket") as e:
        storage.kvstore_spec("hdfs://namenode/runs")
    assert "\n" not in str(e.value)
    with pytest.raises(StorageError, match="names no bucket"):
        storage.parse("s3:///prefix")


def _roundtrip(location: str) -> None:
    """Bytes written through the kvstore spec are read through epath, and back."""
    kv = ts.KvStore.open(storage.kvstore_spec(location)).result()
    kv.write("a/b.txt", b"through tensorstore").result()
    path = storage.epath(location)
    assert (path / "a" / "b.txt").read_bytes() == b"through tensorstore"
    (path / "c.json").write_text('{"x": 1}')
    assert kv.read("c.json").result().value == b'{"x": 1}'
    assert sorted(k.decode() for k in kv.list().result()) == ["a/b.txt", "c.json"]
    storage.check(location)


@pytest.mark.xdist_group("seaweedfs")
def test_s3_location_on_seaweedfs(seaweedfs):
    _, bucket = seaweedfs
    _roundtrip(f"s3://{bucket}/run")


@pytest.mark.xdist_group("moto")
def test_s3_location_on_moto_from_config_endpoint(moto, monkeypatch):
    server, bucket = moto
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    storage.configure(dict(s3_endpoint=server.endpoint))  # config.storage, not the env
    _roundtrip(f"s3://{bucket}/run")


@pytest.mark.xdist_group("fake-gcs")
def test_gs_location_on_fake_gcs(fake_gcs):
    _, bucket = fake_gcs
    _roundtrip(f"gs://{bucket}/run")


@pytest.mark.xdist_group("seaweedfs")
def test_missing_bucket_and_denied_credentials_are_one_paragraph(seaweedfs, monkeypatch):
    server, bucket = seaweedfs
    with pytest.raises(StorageError, match=r"bucket 'jaxscale-no-such-bucket' does not exist "
                       rf"at {server.endpoint}") as e:
        storage.check("s3://jaxscale-no-such-bucket/run", timeout_s=10)
    assert "\n" not in str(e.value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match=r"refused the credentials: the secret key does not "
                       r"match the access key id.*AWS_ACCESS_KEY_ID"):
        storage.check(f"s3://{bucket}/run", timeout_s=10)


@pytest.mark.xdist_group("seaweedfs")
def test_unknown_access_key_is_a_credentials_error_not_a_missing_bucket(seaweedfs, monkeypatch,
                                                                      tmp_path):
    """Issue 33, item 4: SeaweedFS's "The access key ID you provided does not exist" read as a
    missing bucket; and every s3:// command printed ~10 `AuthCredentialsProvider ...
    .aws/config` lines when the credentials come from the environment."""
    server, bucket = seaweedfs
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody-knows-me")
    with pytest.raises(StorageError, match=r"refused the credentials: the server does not know "
                       r"this access key id .*InvalidAccessKeyId.*AWS_ACCESS_KEY_ID") as e:
        storage.check(f"s3://{bucket}/run", timeout_s=10)
    assert "does not exist at" not in str(e.value) and "Create it" not in str(e.value)
    from tests.test_bad_input import cli, one_paragraph
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws files, as on a fresh machine
    out = cli("train", "--config=tiny_lm:test", f"--workdir=s3://{bucket}/run")
    one_paragraph(out, "refused the credentials: the server does not know this access key id")
    assert "AuthCredentialsProvider" not in out.stderr and ".aws/config" not in out.stderr, (
        out.stderr[-3000:])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.env()["AWS_ACCESS_KEY_ID"])
    storage.check(f"s3://{bucket}/run", timeout_s=10)  # the right key passes, silently


def test_unreachable_and_silent_endpoints_fail_within_the_timeout(monkeypatch):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    storage.configure(dict(s3_endpoint=f"http://127.0.0.1:{dead}", timeout_s=2))
    with pytest.raises(StorageError, match=rf"cannot connect to the endpoint "
                       rf"http://127.0.0.1:{dead} within 2 s"):
        storage.check("s3://bucket/run")
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        storage.configure(dict(s3_endpoint=url))
        with pytest.raises(StorageError, match=rf"endpoint {url} did not answer within 1 s"):
            storage.check("s3://bucket/run", timeout_s=1)


def _race_create_if_absent(location: str, writers: int = 8) -> int:
    """How many of `writers` concurrent create-if-absent writes of one key succeed."""
    kv = ts.KvStore.open(storage.kvstore_spec(location)).result()
    barrier, wins = threading.Barrier(writers), []

    def write(i: int) -> None:
        barrier.wait()
        stamp = kv.write("COMMIT", f"writer {i}".encode(), if_equal=b"\x02").result()
        wins.append(stamp.generation != b"")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(wins)


def _conditional_writes_honoured(location: str) -> bool:
    kv = ts.KvStore.open(storage.kvstore_spec(location)).result()
    kv.write("k", b"1").result()
    absent = kv.write("k", b"2", if_equal=b"\x02").result().generation != b""
    stale = kv.read("k").result().stamp.generation
    kv.write("k", b"3").result()
    swapped = kv.write("k", b"4", if_equal=stale).result().generation != b""
    return not absent and not swapped and kv.read("k").result().value == b"3"


@pytest.mark.xdist_group("seaweedfs")
def test_seaweedfs_honours_conditional_writes_and_one_racer_wins(seaweedfs):
    _, bucket = seaweedfs
    assert _conditional_writes_honoured(f"s3://{bucket}/cond")
    assert _race_create_if_absent(f"s3://{bucket}/race") == 1


@pytest.mark.xdist_group("moto")
def test_moto_honours_conditional_writes_and_one_racer_wins(moto):
    _, bucket = moto
    assert _conditional_writes_honoured(f"s3://{bucket}/cond")
    assert _race_create_if_absent(f"s3://{bucket}/race") == 1


@pytest.mark.xdist_group("fake-gcs")
def test_fake_gcs_ignores_generation_preconditions(fake_gcs):
    """Recorded, not relied on: fake-gcs-server accepts a write whose ifGenerationMatch
    fails, so it tests the gs:// data path only (real GCS honours it)."""
    _, bucket = fake_gcs
    assert not _conditional_writes_honoured(f"gs://{bucket}/cond")


@pytest.mark.parametrize("name", [
    pytest.param("seaweedfs", marks=pytest.mark.xdist_group("seaweedfs")),
    pytest.param("moto", marks=pytest.mark.xdist_group("moto"))])
def test_s3_servers_refuse_stale_preconditions_on_the_wire(name, request):
    """The protocol itself, without tensorstore: PUT with If-None-Match: * on an existing key
    and If-Match with a stale ETag are refused with 412 (docs/object-stores.md: conditional writes)."""
    import botocore.exceptions

    server, bucket = request.getfixturevalue(name)
    client = server.client()
    client.put_object(Bucket=bucket, Key="k", Body=b"1")
    for condition in ({"IfNoneMatch": "*"}, {"IfMatch": '"0123456789abcdef0123456789abcdef"'}):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            client.put_object(Bucket=bucket, Key="k", Body=b"2", **condition)
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"1"
