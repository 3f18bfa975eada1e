"""File sources: every format, packing, per-host reading, mixtures, resume and the prepare step."""

import json
import random

import numpy as np
import pytest

from jaxscale.config import base_config, validate
from jaxscale.data.mixture import files_data
from jaxscale.data.packing import first_fit
from jaxscale.data.prepare import prepare
from jaxscale.data.tokenizer import load_tokenizer
from jaxscale.errors import ConfigError, JaxscaleError
from tests.text_corpus import write_corpus

WORDS = "the quick brown fox jumps over lazy dog data model token train jax grain".split()


def _docs(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 70))) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two jsonl files, the same documents as text / parquet / tokens, and a prepared dataset."""
    root = tmp_path_factory.mktemp("corpus")
    docs = [_docs(0, 150), _docs(1, 150)]
    write_corpus(root, docs, parquet_field="body")
    meta = prepare([str(root / "*.jsonl")], "jsonl", str(root / "prep"), train_vocab=300,
                   num_shards=3, workers=1)
    tok = load_tokenizer(str(root / "prep"))
    flat = np.concatenate([np.append(tok.encode(t), tok.eos_id) for t in docs[0]])
    flat.astype(np.uint16).tofile(root / "flat.bin")
    return root, docs, meta


def _config(root, sources: str, packing: str = "pack", **data) -> object:
    c = base_config()
    c.model.vocab_size = 320
    c.data.update(sources=sources, tokenizer=str(root / "prep"), seq_len=32, batch_size=8,
                  packing=packing, eval_batches=2, **data)
    return c


FORMATS = {
    "jsonl": lambda r: f"jsonl={r}/*.jsonl",
    "text": lambda r: f"text={r}/text/*.txt",
    "parquet": lambda r: f"parquet={r}/*.parquet",
    "array_record": lambda r: f"array_record={r}/prep/*.array_record",
    "tokens": lambda r: f"tokens={r}/flat.bin",
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_gives_real_documents(corpus, fmt):
    root, docs, _ = corpus
    packing = "concat" if fmt == "tokens" else "pack"
    c = _config(root, FORMATS[fmt](root), packing, text_field="body" if fmt == "parquet" else "text",
                eval_fraction=0.3 if fmt == "text" else 0.05,
                eval_sources=FORMATS[fmt](root) if fmt == "tokens" else "")  # one 64Ki block
    batches, evals = files_data(c, 0, 1)
    batch = next(batches.iterator())
    assert batch["tokens"].shape == (8, 33) and len(evals) == 2
    tok = load_tokenizer(str(root / "prep"))
    text = tok.decode(batch["tokens"][0].tolist())
    every = " ".join(docs[0] + docs[1])
    words = text.split()
    assert len(words) > 3 and all(w in WORDS or w in every for w in words[1:-1])


def test_pack_rows_hold_whole_documents_with_segments(corpus):
    root, docs, _ = corpus
    c = _config(root, FORMATS["jsonl"](root), "pack", eval_fraction=0.0, eval_sources=
                FORMATS["jsonl"](root))
    batches, _ = files_data(c, 0, 1)
    rows = batches.rows[0]
    tok = load_tokenizer(str(root / "prep"))
    texts = set(docs[0] + docs[1])
    for r in range(rows.num_rows):
        row = rows.row(r)
        seg, pos, ids = row["segment_ids"], row["positions"], row["tokens"]
        for s in range(1, seg.max() + 1):
            at = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(pos[at], np.arange(len(at)))  # restarts per document
            piece = ids[at]
            _, start, n = rows.plan[r][s - 1]
            if start == 0 and n < 33:  # a whole document (not a piece of a long one)
                assert piece[-1] == tok.eos_id and tok.decode(piece.tolist()) in texts
        assert (ids[seg == 0] == tok.pad_id).all()
    # first-fit: every token of every document placed exactly once, long documents split
    lengths = np.asarray([5, 40, 33, 12, 70, 1, 20])
    plan = first_fit(lengths, 33)
    placed = sorted((d, s, n) for row in plan for d, s, n in row)
    assert sum(n for _, _, n in placed) == lengths[lengths > 1].sum()
    assert all(sum(n for _, _, n in row) <= 33 for row in plan)
    assert [p for p in placed if p[0] == 4] == [(4, 0, 33), (4, 33, 33), (4, 66, 4)]


class CountingReader:
    """Wraps a reader and records which documents were read."""

    def __init__(self, reader):
        self.reader, self.read = reader, set()

    def __getattr__(self, name):
        return getattr(self.reader, name)

    def doc(self, i):
        self.read.add(i)
        return self.reader.doc(i)


def _instrument(batches):
    """Per source: (reader recording document reads, set recording the row ids gathered)."""
    counters = []
    for rows in batches.rows:
        rows.source.reader = CountingReader(rows.source.reader)
        gathered, row = set(), rows.row
        rows.row = lambda i, row=row, gathered=gathered: gathered.add(i) or row(i)
        counters.append((rows, rows.source.reader, gathered))
    return counters


@pytest.mark.parametrize("packing", ["pack", "concat"])
def test_global_batch_identical_for_any_process_count_and_hosts_read_own_rows(corpus, packing):
    root, _, _ = corpus
    sources = f"{FORMATS['jsonl'](root)}@1;{FORMATS['array_record'](root)}@3"
    c = _config(root, sources, packing)
    for count in (2, 4):
        its = [files_data(c, p, count)[0].iterator() for p in range(count)]
        fresh = files_data(c, 0, 1)[0].iterator()
        for _ in range(3):
            full = next(fresh)
            parts = [next(it) for it in its]
            for key in full:
                np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), full[key])
    if packing == "pack":  # each process reads exactly the documents of its own rows
        built = [files_data(c, p, 2)[0] for p in range(2)]
        counters = [_instrument(b) for b in built]
        for b in built:  # synchronously (the iterators read ahead in threads)
            ds = b.dataset()
            [ds[i] for i in range(3)]
        for k in range(2):
            assert all(cs[k][2] for cs in counters)
            for rows, reader, gathered in (cs[k] for cs in counters):
                planned = {int(rows.source.ids[d]) for r in gathered for d, _, _ in rows.plan[r]}
                assert reader.read == planned
            assert not counters[0][k][2] & counters[1][k][2]  # disjoint rows


def test_mixture_weights_and_resume_mid_epoch(corpus):
    root, _, _ = corpus
    c = _config(root, f"{FORMATS['jsonl'](root)}@1;{FORMATS['array_record'](root)}@3", "pack")
    batches, _ = files_data(c, 0, 1)
    ds = batches.dataset()
    it = batches.iterator()
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(2)]
    resumed = files_data(c, 0, 1)[0].iterator(json.loads(json.dumps(state)))
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    del ds
    # weights 1:3 -> a quarter of the rows from the first source
    import grain
    parts = [grain.MapDataset.range(10 ** 6).map(lambda i, k=k: k) for k in range(2)]
    mixed = grain.MapDataset.mix(parts, [1, 3])
    assert sum(mixed[i] == 0 for i in range(400)) == 100


def test_prepare_metadata_and_records_match_the_sources(corpus):
    root, docs, meta = corpus
    tok = load_tokenizer(str(root / "prep"))
    assert meta["documents"] == 300 and len(meta["shards"]) == 3
    assert meta["tokens"] == sum(len(tok.encode(t)) + 1 for part in docs for t in part)
    on_disk = json.loads((root / "prep" / "metadata.json").read_text())
    assert on_disk["tokenizer_hash"] == meta["tokenizer_hash"] and on_disk["sources"]
    import grain
    src = grain.sources.ArrayRecordDataSource(sorted(str(p) for p in
                                                     (root / "prep").glob("*.array_record")))
    first = np.frombuffer(src[0], np.uint32)
    assert first[-1] == tok.eos_id and tok.decode(first.tolist()) == docs[0][0]
    with pytest.raises(ConfigError, match="never overwritten"):
        prepare([str(root / "*.jsonl")], "jsonl", str(root / "prep"), train_vocab=300)


def test_prepare_with_worker_processes_equals_one_process(corpus, tmp_path):
    root, _, meta = corpus
    again = prepare([str(root / "*.jsonl")], "jsonl", str(tmp_path / "p2"),
                    tokenizer=str(root / "prep"), num_shards=3, workers=2)
    assert again["tokens"] == meta["tokens"] and again["tokenizer_hash"] == meta["tokenizer_hash"]
    for shard in meta["shards"]:
        a = (root / "prep" / shard["file"]).read_bytes()
        assert a == (tmp_path / "p2" / shard["file"]).read_bytes()


def _bad_config(root, tmp_path, **data):
    c = _config(root, data.pop("sources", FORMATS["jsonl"](root)), "pack", **data)
    return c


@pytest.mark.parametrize("case,match", [
    ("no_match", "matches no file"),
    ("zero_weight", "mixture weight '0'"),
    ("negative_weight", "mixture weight '-1'"),
    ("bad_format", "FORMAT=GLOB"),
    ("missing_tokenizer", "does not exist"),
    ("small_vocab", "model.vocab_size=100 is smaller than the 300 tokens"),
    ("hash_mismatch", "was prepared with tokenizer"),
    ("bad_packing", "data.packing='tight'"),
])
def test_config_errors_before_anything_builds(corpus, tmp_path, case, match):
    root, _, _ = corpus
    c = _config(root, FORMATS["jsonl"](root))
    if case == "no_match":
        c.data.sources = f"jsonl={tmp_path}/nothing/*.jsonl"
    elif case == "zero_weight":
        c.data.sources = FORMATS["jsonl"](root) + "@0"
    elif case == "negative_weight":
        c.data.sources = FORMATS["jsonl"](root) + "@-1"
    elif case == "bad_format":
        c.data.sources = f"csv={root}/*.jsonl"
    elif case == "missing_tokenizer":
        c.data.tokenizer = str(tmp_path / "nope.json")
    elif case == "small_vocab":
        c.model.vocab_size = 100
    elif case == "hash_mismatch":
        c.data.sources = FORMATS["array_record"](root)
        c.data.tokenizer, c.model.vocab_size = "bytes", 320
    elif case == "bad_packing":
        c.data.packing = "tight"
    with pytest.raises(ConfigError, match=match) as err:
        validate(c)
    assert "\n" not in str(err.value)


def _write(path, text):
    path.write_text(text)
    return path


def test_bad_records_name_file_and_line_or_are_skipped_and_counted(corpus, tmp_path):
    root, _, _ = corpus
    good = json.dumps({"text": "the quick brown fox " * 20})
    _write(tmp_path / "bad.jsonl", "\n".join([good] * 30 + ["{not json"] + [good] * 30) + "\n")
    c = _config(root, f"jsonl={tmp_path}/bad.jsonl", eval_sources=FORMATS["jsonl"](root))
    with pytest.raises(JaxscaleError, match=r"bad.jsonl line 31 is not valid JSON.*skip_bad"):
        files_data(c, 0, 1)
    c.data.skip_bad_records = True
    batches, _ = files_data(c, 0, 1)
    assert batches.rows[0].source.reader.skipped == 1
    _write(tmp_path / "nofield.jsonl", "\n".join([good] * 3 + ['{"body": "x"}']) + "\n")
    c = _config(root, f"jsonl={tmp_path}/nofield.jsonl", eval_sources=FORMATS["jsonl"](root))
    with pytest.raises(JaxscaleError, match=r"nofield.jsonl line 4 has no string field 'text'"):
        files_data(c, 0, 1)
    _write(tmp_path / "empty.jsonl", "\n".join([good] * 3 + ['{"text": ""}']) + "\n")
    c = _config(root, f"jsonl={tmp_path}/empty.jsonl", eval_sources=FORMATS["jsonl"](root))
    with pytest.raises(JaxscaleError, match=r"empty.jsonl line 4 is an empty document"):
        files_data(c, 0, 1)


def test_truncated_parquet_and_array_record_are_clear_errors(corpus, tmp_path):
    root, _, _ = corpus
    whole = (root / "part0.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[:len(whole) // 2])
    c = _config(root, f"parquet={tmp_path}/cut.parquet", text_field="body")
    with pytest.raises(JaxscaleError, match=r"cut.parquet cannot be read as parquet"):
        files_data(c, 0, 1)
    prep = tmp_path / "prep"
    prep.mkdir()
    shard = sorted((root / "prep").glob("*.array_record"))[0]
    (prep / shard.name).write_bytes(shard.read_bytes()[:200])
    c = _config(root, f"array_record={prep}/*.array_record", eval_sources=FORMATS["jsonl"](root))
    with pytest.raises(JaxscaleError, match=r"truncated|cannot be"):
        batches, _ = files_data(c, 0, 1)
        next(batches.iterator())
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    c = _config(root, f"tokens={tmp_path}/odd.bin", "concat")
    with pytest.raises(JaxscaleError, match=r"odd.bin has 3 bytes, not a multiple of 2"):
        files_data(c, 0, 1)


class ThreadExchange:
    """`count` simulated processes (threads) summing int32 arrays, as the all-gather does."""

    def __init__(self, count: int):
        import threading
        self.barrier, self.parts = threading.Barrier(count, timeout=120), {}

    def __call__(self, p: int, x):
        self.parts[p] = x.copy()
        self.barrier.wait()
        total = sum(self.parts.values())
        self.barrier.wait()
        return total.astype(np.int32)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "text"])
def test_length_index_each_process_tokenizes_only_its_own_files(corpus, fmt):
    """The index of on-the-fly formats: process p scans and tokenizes only files p, p+P, ...,
    and after the exchange every process holds the single-process table exactly."""
    import threading

    from jaxscale.data.doc_index import build_index
    from jaxscale.data.readers import JsonlReader, ParquetReader, TextReader
    from jaxscale.data.sources import expand, parse_sources
    root, _, _ = corpus
    tok = load_tokenizer(str(root / "prep"))
    files = expand(parse_sources(FORMATS[fmt](root))[0])
    make = {"jsonl": lambda: JsonlReader(files, tok, False, "text"),
            "parquet": lambda: ParquetReader(files, tok, False, "body"),
            "text": lambda: TextReader(files, tok, False)}[fmt]
    alone = make()
    build_index(alone, 0, 1)
    count = 2
    readers, exchange = [make() for _ in range(count)], ThreadExchange(count)
    threads = [threading.Thread(target=build_index, args=(readers[p], p, count,
                                                         lambda x, p=p: exchange(p, x)))
               for p in range(count)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for p, r in enumerate(readers):
        assert r.locs == alone.locs
        np.testing.assert_array_equal(r.lengths(), alone.lengths())
        own = [i for i, loc in enumerate(alone.locs) if loc[0] % count == p]
        assert r.tokenized == len(own) > 0  # its own files' documents, nothing else
        assert r.tokenized < alone.tokenized
    assert sum(r.tokenized for r in readers) == alone.tokenized == len(alone.locs)


def test_lofi_workers_read_disjoint_covering_shards_of_files(corpus):
    """Each Lo-Fi worker (config.lofi.worker_id of num_workers) opens and tokenizes only its
    own files; together the workers' training documents are every training document once."""
    from jaxscale.data.registry import build_data
    root, docs, _ = corpus
    # the same held-out documents for every worker
    c = _config(root, FORMATS["jsonl"](root), eval_sources=FORMATS["jsonl"](root))
    whole = files_data(c, 0, 1)[0].rows[0].source
    seen = []
    for w in range(2):
        c.lofi.update(enabled=True, worker_id=w, num_workers=2)
        batches, _ = build_data(c, 0, 1, c.lofi.worker_id, c.lofi.num_workers)
        src = batches.rows[0].source
        assert src.reader.files == whole.reader.files[w::2]
        assert src.reader.tokenized == len(src)  # only its shard was tokenized
        tok_texts = [src.reader.text_of(int(i)) for i in src.ids]
        assert set(tok_texts) == set(docs[w]) and len(tok_texts) == len(docs[w])
        next(batches.iterator())
        seen += tok_texts
    assert sorted(seen) == sorted(docs[0] + docs[1])
    c.lofi.update(worker_id=0, num_workers=3)
    with pytest.raises(ConfigError, match="matches 2 jsonl files but lofi.num_workers=3"):
        build_data(c, 0, 1, 0, 3)


def test_index_cache_skips_tokenizing_again_and_notices_changed_files(corpus, tmp_path):
    import shutil
    root, _, _ = corpus
    for k in range(2):
        shutil.copy(root / f"part{k}.jsonl", tmp_path / f"part{k}.jsonl")
    c = _config(root, f"jsonl={tmp_path}/*.jsonl", eval_sources=FORMATS["jsonl"](root),
                index_cache=str(tmp_path / "cache"))
    first = files_data(c, 0, 1)[0]
    again = files_data(c, 0, 1)[0]
    a, b = first.rows[0].source.reader, again.rows[0].source.reader
    assert a.tokenized == 300 and b.tokenized == 0  # the second run only reads the cache
    assert a.locs == b.locs and (a.lengths() == b.lengths()).all()
    np.testing.assert_array_equal(next(first.iterator())["tokens"],
                                  next(again.iterator())["tokens"])
    with open(tmp_path / "part1.jsonl", "a") as f:  # a changed file is indexed afresh
        f.write(json.dumps({"text": "the quick brown fox"}) + "\n")
    changed = files_data(c, 0, 1)[0].rows[0].source.reader
    assert changed.tokenized == 151 and changed.num_docs == 301
