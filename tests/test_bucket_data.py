"""Data sources in buckets: `data.sources` globs on s3:// (SeaweedFS) and gs:// (fake-gcs-server)
give exactly the batches of the same files on a local disk, read by range requests; a glob
matching nothing and ArrayRecord shards in a bucket are one-paragraph errors."""

import random

import numpy as np
import pytest

from jaxscale.config import base_config
from jaxscale.data.mixture import files_data, validate_files
from jaxscale.data.prepare import prepare
from jaxscale.data.tokenizer import load_tokenizer
from jaxscale.errors import ConfigError
from tests.text_corpus import write_corpus

WORDS = "the quick brown fox jumps over lazy dog data model token train jax grain".split()
FORMATS = {"jsonl": "*.jsonl", "parquet": "*.parquet", "tokens": "flat.bin", "text": "text/*.txt"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two jsonl files, the same documents as parquet, text files and a token file, and a
    trained tokenizer (kept local: only the data goes to the bucket)."""
    root = tmp_path_factory.mktemp("bucket-corpus")
    rng = random.Random(0)
    docs = [[" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60))) for _ in range(80)]
            for _ in range(2)]
    write_corpus(root, docs, row_group_size=30, text_files=40)
    prepare([str(root / "*.jsonl")], "jsonl", str(root / "prep"), train_vocab=300,
            num_shards=1, workers=1)
    tok = load_tokenizer(str(root / "prep"))
    flat = np.concatenate([np.append(tok.encode(t), tok.eos_id) for t in docs[0]])
    flat.astype(np.uint16).tofile(root / "flat.bin")
    return root


def _config(root, fmt: str, where: str):
    c = base_config()
    c.model.vocab_size = 320
    sources = f"{fmt}={where}/{FORMATS[fmt]}"
    c.data.update(sources=sources, eval_sources=sources, tokenizer=str(root / "prep"),
                  seq_len=32, batch_size=8, packing="concat" if fmt == "tokens" else "pack",
                  eval_batches=1)
    return c


def _upload_s3(server, bucket: str, root) -> None:
    client = server.client()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "prep" not in p.parts):
        client.put_object(Bucket=bucket, Key=f"corpus/{path.relative_to(root)}",
                          Body=path.read_bytes())


def _first_batches(config, n: int = 3) -> list[dict]:
    batches, _ = files_data(config, 0, 1)
    it = batches.iterator()
    return [next(it) for _ in range(n)]


def _assert_same_batches(got: list[dict], want: list[dict]) -> None:
    for a, b in zip(got, want):
        assert sorted(a) == sorted(b)
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.xdist_group("seaweedfs")
def test_s3_sources_give_the_batches_of_the_same_local_files(seaweedfs, corpus, tmp_path):
    server, bucket = seaweedfs
    _upload_s3(server, bucket, corpus)
    for fmt in FORMATS:
        bucket_config = _config(corpus, fmt, f"s3://{bucket}/corpus")
        bucket_config.data.index_cache = str(tmp_path / "index")  # keyed by ETag in a bucket
        validate_files(bucket_config)  # the glob is expanded in the bucket before compiling
        _assert_same_batches(_first_batches(bucket_config),
                             _first_batches(_config(corpus, fmt, str(corpus))))
    assert list((tmp_path / "index").glob("*.npz"))  # on-the-fly formats were cached
    _assert_same_batches(_first_batches(bucket_config), _first_batches(bucket_config))


@pytest.mark.xdist_group("seaweedfs")
def test_bucket_globs_matching_nothing_and_array_record_are_one_paragraph(seaweedfs, corpus):
    _, bucket = seaweedfs
    c = _config(corpus, "jsonl", f"s3://{bucket}/nothing-here")
    with pytest.raises(ConfigError, match=r"matches no file") as err:
        validate_files(c)
    assert "\n" not in str(err.value) and f"s3://{bucket}/nothing-here" in str(err.value)
    c.data.sources = f"array_record=s3://{bucket}/prep/*.array_record"
    c.data.eval_sources = ""
    with pytest.raises(ConfigError, match=r"reads local files only.*gcsfuse"):
        validate_files(c)
    with pytest.raises(ConfigError, match=r"--out=s3://.*local files only"):
        prepare([f"s3://{bucket}/corpus/*.jsonl"], "jsonl", f"s3://{bucket}/prep")


@pytest.mark.xdist_group("seaweedfs")
def test_prepare_reads_its_sources_from_a_bucket(seaweedfs, corpus, tmp_path):
    server, bucket = seaweedfs
    _upload_s3(server, bucket, corpus)
    meta = prepare([f"s3://{bucket}/corpus/*.jsonl"], "jsonl", str(tmp_path / "prep"),
                   tokenizer=str(corpus / "prep"), workers=2)  # worker processes read too
    local = prepare([str(corpus / "*.jsonl")], "jsonl", str(tmp_path / "local"),
                    tokenizer=str(corpus / "prep"), workers=1)
    assert (meta["documents"], meta["tokens"]) == (local["documents"], local["tokens"])


@pytest.mark.xdist_group("fake-gcs")
def test_gs_sources_on_a_gcs_emulator(fake_gcs, corpus):
    server, bucket = fake_gcs
    from jaxscale.storage import locations
    for name in ("part0.jsonl", "part1.jsonl"):
        locations.epath(f"gs://{bucket}/corpus/{name}").write_bytes((corpus / name).read_bytes())
    _assert_same_batches(_first_batches(_config(corpus, "jsonl", f"gs://{bucket}/corpus")),
                         _first_batches(_config(corpus, "jsonl", str(corpus))))


@pytest.mark.xdist_group("seaweedfs")
def test_a_tokenizer_in_a_bucket_is_the_local_one(seaweedfs, corpus, tmp_path, monkeypatch):
    """A converted model written to a bucket carries its tokenizer.json there: naming the
    bucket directory as data.tokenizer loads it (cached locally) with the same hash."""
    from jaxscale.data import tokenizer as T
    server, bucket = seaweedfs
    monkeypatch.setattr(T, "CACHE_DIR", str(tmp_path / "cache"))
    client = server.client()
    client.put_object(Bucket=bucket, Key="model/tokenizer.json",
                      Body=(corpus / "prep" / "tokenizer.json").read_bytes())
    remote = f"s3://{bucket}/model"
    assert T.file_hash(remote) == T.file_hash(str(corpus / "prep"))
    c = _config(corpus, "jsonl", str(corpus))
    c.data.tokenizer = remote
    _assert_same_batches(_first_batches(c), _first_batches(_config(corpus, "jsonl", str(corpus))))
    with pytest.raises(ConfigError, match=r"no tokenizer.json or tokenizer.model there"):
        T.load_tokenizer(f"s3://{bucket}/nothing")


@pytest.mark.xdist_group("seaweedfs")
def test_lines_are_read_by_ranges_across_request_boundaries(seaweedfs, monkeypatch):
    """A jsonl line longer than one range request, and a last line without a newline that
    ends exactly on a request boundary, read back whole."""
    from jaxscale.storage import data_files
    server, bucket = seaweedfs
    monkeypatch.setattr(data_files, "LINE_READ", 16)
    lines = [b'{"text": "a"}\n', b'{"text": "' + b"x" * 40 + b'"}\n', b'{"text": "bcde"}']
    assert len(lines[-1]) == 16
    server.client().put_object(Bucket=bucket, Key="lines.jsonl", Body=b"".join(lines))
    url, offset = f"s3://{bucket}/lines.jsonl", 0
    for line in lines:
        assert data_files.read_line(url, offset) == line
        offset += len(line)
    assert data_files.size(url) == offset
