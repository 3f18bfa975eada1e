"""Bad input, round three (issue 33): token ids past the vocabulary, parquet files without the
text column or with unreadable data, prepare_data's output directory and counts, empty corpora
and odd values. Each case uses real files and the real commands where a user would meet it, and
must end in one paragraph naming the culprit, with exit status 2 and no traceback."""

import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from child_env import child_env
from jaxscale.config import base_config
from jaxscale.data.mixture import files_data
from jaxscale.data.prepare import prepare
from jaxscale.errors import JaxscaleError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the quick brown fox jumps over lazy dog data model token train jax grain".split()


def _text(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(20 + i % 30))


def cli(*args: str, cwd: str = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m jaxscale ARGS` on the CPU, as a user would run it."""
    env = child_env(JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxscale", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_paragraph(out: subprocess.CompletedProcess, *parts: str) -> str:
    """The error paragraph of a command that must have exited 2 without a traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("jaxscale: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    for part in parts:
        assert part in errors[0], (part, errors[0])
    return errors[0]


def _train(workdir, *overrides: str) -> subprocess.CompletedProcess:
    return cli("train", "--config=tiny_lm:test", f"--workdir={workdir}",
               "--config.train.steps=3", *overrides)


# 1. Token ids outside the vocabulary.

def test_token_file_ids_past_the_vocabulary_stop_naming_file_id_and_size(tmp_path):
    ids = np.random.RandomState(0).randint(0, 256, 200_000).astype(np.uint16)
    ids[150_000] = 300
    ids.tofile(tmp_path / "flat.bin")
    out = _train(tmp_path / "run", f"--config.data.sources=tokens={tmp_path}/flat.bin",
                 "--config.data.packing=concat", "--config.data.eval_fraction=0.5")
    one_paragraph(out, f"{tmp_path}/flat.bin holds token id 300", "token 150000",
                  "model.vocab_size=256", "--config.model.vocab_size")


def test_prepared_shards_of_a_larger_tokenizer_stop_naming_the_shard(tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": _text(i)}) + "\n"
                                                 for i in range(200)))
    prepare([str(tmp_path / "docs.jsonl")], "jsonl", str(tmp_path / "prep"), train_vocab=400,
            num_shards=2)
    os.remove(tmp_path / "prep" / "metadata.json")  # copied shards: no tokenizer hash to check
    c = base_config()
    c.data.update(sources=f"array_record={tmp_path}/prep/*.array_record", seq_len=32,
                  batch_size=8, packing="pack", eval_fraction=0.2, eval_batches=1)
    with pytest.raises(JaxscaleError, match=r"prep/data-0000[01]-of-00002.array_record record "
                       r"\d+ holds token id \d+ .*model.vocab_size=256.*data.tokenizer") as e:
        batches, _ = files_data(c, 0, 1)
        next(batches.iterator())
    assert "\n" not in str(e.value)


def test_a_workdir_json_file_cut_short_names_the_command_that_writes_it(tmp_path):
    from jaxscale.storage.workdir_files import read_json

    (tmp_path / "config.json").write_text('{"model": {"embed": 6')
    with pytest.raises(JaxscaleError, match=r"config\.json is not valid JSON .* rerun the "
                       r"command that wrote it \(`jaxscale train` writes config\.json, "
                       r"`jaxscale convert --from_hf` writes model_config\.json\)\."):
        read_json(str(tmp_path / "config.json"))
    assert read_json(str(tmp_path / "missing.json")) is None


# 8. Empty corpora and odd values.

@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_a_jsonl_source_without_documents_is_named(tmp_path, content):
    (tmp_path / "empty.jsonl").write_text(content)
    out = _train(tmp_path / "run", f"--config.data.sources=jsonl={tmp_path}/*.jsonl")
    one_paragraph(out, "no documents in jsonl=", "empty.jsonl", "blank lines")


def test_every_record_skipped_is_no_documents_and_skips_are_reported(tmp_path, capsys):
    good = json.dumps({"text": _text(3)})
    (tmp_path / "bad.jsonl").write_text("{not json\n[1]\n")
    (tmp_path / "ok.jsonl").write_text("\n".join([good] * 200 + ["{not json"]) + "\n")
    c = base_config()
    c.data.update(sources=f"jsonl={tmp_path}/bad.jsonl", seq_len=32, batch_size=8,
                  eval_sources=f"jsonl={tmp_path}/ok.jsonl", skip_bad_records=True)
    with pytest.raises(JaxscaleError, match=r"no documents in jsonl=.*every one of its 2 records"
                       r" was skipped as bad"):
        files_data(c, 0, 1)
    c.data.update(sources=f"jsonl={tmp_path}/*.jsonl", eval_sources="")
    capsys.readouterr()
    batches, _ = files_data(c, 0, 1)
    assert batches.skipped_records == 3
    assert capsys.readouterr().out.count("data.skip_bad_records: skipped 3 bad records") == 1


def test_an_infinite_mixture_weight_is_refused(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": _text(1)}) + "\n")
    out = _train(tmp_path / "run", f"--config.data.sources=jsonl={tmp_path}/a.jsonl@inf")
    one_paragraph(out, "mixture weight 'inf'", "positive finite")


def test_zero_cpu_devices_is_refused(tmp_path):
    one_paragraph(_train(tmp_path / "run", "--cpu_devices=0"), "--cpu_devices=0", "at least 1")


def test_a_batch_the_data_axis_does_not_divide_is_refused(tmp_path):
    """Sharded over fewer devices, the others would repeat the work: refused, with the waste."""
    out = _train(tmp_path / "run", "--cpu_devices=3", "--config.mesh.data=3",
                 "--config.data.batch_size=16")
    one_paragraph(out, "data.batch_size=16", "3 devices", "data=3", "67%", "e.g. 18")
    assert not (tmp_path / "run" / "checkpoints").exists()


# 6. prepare_data: the output directory and the counts.

@pytest.fixture
def docs(tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": _text(i)}) + "\n"
                                                 for i in range(40)))
    return str(tmp_path / "docs.jsonl")


def _prepare(docs: str, out, *flags: str) -> subprocess.CompletedProcess:
    return cli("prepare-data", f"--sources={docs}", "--format=jsonl", "--tokenizer=bytes",
               f"--out={out}", *flags)


@pytest.mark.parametrize("flag", ["--num_shards=0", "--workers=0"])
def test_prepare_refuses_zero_shards_or_workers_and_creates_nothing(docs, tmp_path, flag):
    one_paragraph(_prepare(docs, tmp_path / "out", flag), flag, "at least 1")
    assert not (tmp_path / "out").exists()


def test_prepare_refuses_a_vocabulary_no_larger_than_the_bytes_and_notes_a_short_one(
        docs, tmp_path, capfd):
    from jaxscale.data.prepare import check_args
    with pytest.raises(JaxscaleError, match=r"--train_tokenizer=258: .* starts with 258 ids"):
        check_args(str(tmp_path / "out"), "", 1, 1, 258)
    check_args(str(tmp_path / "out"), "", 1, 1, 259)
    # 40 short documents offer a few hundred merges, not 50,000: said once, and the size given
    prepare([docs], "jsonl", str(tmp_path / "big"), train_vocab=50_000)
    from tokenizers import Tokenizer
    size = Tokenizer.from_file(str(tmp_path / "big" / "tokenizer.json")).get_vocab_size()
    assert 258 < size < 50_000
    assert capfd.readouterr().err.count(f"has {size:,} ids, fewer than the 50,000 asked") == 1


def test_prepare_out_below_a_file_or_on_a_read_only_filesystem(docs, tmp_path):
    (tmp_path / "file.txt").write_text("mine")
    one_paragraph(_prepare(docs, tmp_path / "file.txt" / "out"), f"{tmp_path}/file.txt/out",
                  "cannot be written")
    if os.geteuid() != 0:  # permissions bind a user; as root, /sys is a read-only filesystem
        (tmp_path / "ro").mkdir(mode=0o555)
        read_only = tmp_path / "ro" / "out"
    else:
        read_only = "/sys/jaxscale-prepare-test"
    one_paragraph(_prepare(docs, read_only), f"--out={read_only} cannot be written")


def test_prepare_never_overwrites_a_file_it_did_not_write(docs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "data-00000-of-00001.array_record").write_text("my own notes")
    one_paragraph(_prepare(docs, out), "not a prepare output", "data-00000-of-00001")
    assert (out / "data-00000-of-00001.array_record").read_text() == "my own notes"


def test_prepare_reruns_over_its_own_interrupted_output(docs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # an empty directory is fine
    (out / ".jaxscale-prepare").write_text(json.dumps(["data-00000-of-00004.array_record"]))
    (out / "data-00000-of-00004.array_record").write_text("an interrupted run's shard")
    meta = prepare([docs], "jsonl", str(out), tokenizer="bytes", num_shards=2)
    assert meta["documents"] == 40
    assert sorted(os.listdir(out)) == sorted(
        ["metadata.json"] + [f"data-0000{k}-of-00002.array_record{x}" for k in range(2)
                             for x in ("", ".lengths.npy")])
    one_paragraph(_prepare(docs, out), "already holds a prepared dataset")


# 3. Parquet: a missing text column, a column of integers, corrupted data pages.

@pytest.fixture
def parquets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = [_text(i) for i in range(400)]
    pq.write_table(pa.table({"body": docs, "id": list(range(400))}), tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"text": list(range(400))}), tmp_path / "ints.parquet",
                   row_group_size=50)
    pq.write_table(pa.table({"text": docs}), tmp_path / "good.parquet", row_group_size=50)
    raw = bytearray((tmp_path / "good.parquet").read_bytes())
    first = pq.ParquetFile(tmp_path / "good.parquet").metadata.row_group(0).column(0)
    start = first.dictionary_page_offset or first.data_page_offset
    for at in range(start, start + first.total_compressed_size, 3):
        raw[at] ^= 0xA5  # the pages of the first row group; the footer is intact
    (tmp_path / "corrupt.parquet").write_bytes(bytes(raw))
    return tmp_path


def test_a_parquet_file_without_the_text_column_names_the_columns_present(parquets):
    c = base_config()
    c.data.update(sources=f"parquet={parquets}/nocol.parquet", seq_len=32, batch_size=8)
    with pytest.raises(JaxscaleError, match=r"nocol.parquet has no column 'text'; its columns are "
                       r"'body', 'id'.*--config.data.text_field"):
        files_data(c, 0, 1)
    out = cli("prepare-data", f"--sources={parquets}/nocol.parquet", "--format=parquet",
              "--tokenizer=bytes", f"--out={parquets}/out")
    one_paragraph(out, "nocol.parquet has no column 'text'", "'body', 'id'", "--text_field")


@pytest.mark.parametrize("name,says", [("ints", "row 0 has no text in column 'text'"),
                                       ("corrupt", "row group 0 cannot be read")])
def test_unreadable_parquet_text_exits_2_every_time_with_no_reader_thread_left(parquets, name,
                                                                                says):
    # An arrow thread pool still starting when the error ended the process aborted it at exit
    # (status 134, "terminate called without an active exception") in about half the runs.
    for attempt in range(10):
        out = cli("prepare-data", f"--sources={parquets}/{name}.parquet", "--format=parquet",
                  "--tokenizer=bytes", f"--out={parquets}/out{attempt}")
        assert "terminate called" not in out.stderr, (attempt, out.stderr[-2000:])
        one_paragraph(out, f"{name}.parquet {says}")


def test_a_run_that_never_evaluates_needs_no_held_out_split(tmp_path):
    (tmp_path / "few.jsonl").write_text("".join(json.dumps({"text": _text(i)}) + "\n"
                                                for i in range(30)))
    c = base_config()
    c.data.update(sources=f"jsonl={tmp_path}/few.jsonl", seq_len=32, batch_size=8,
                  eval_fraction=0.01)  # no document hashes below 1%: an empty held-out split
    with pytest.raises(JaxscaleError, match=r"held-out split has 0 rows"):
        files_data(c, 0, 1)
    c.train.eval_every = 0
    batches, evals = files_data(c, 0, 1)
    assert evals == [] and next(batches.iterator())["tokens"].shape == (8, 33)
    from jaxscale.data.registry import heldout_batches
    with pytest.raises(JaxscaleError, match=r"held-out split has 0 rows"):  # launch.evaluate
        heldout_batches(c, 0, 1)


def test_skipped_records_reach_metrics_and_no_eval_run_trains(tmp_path):
    """The end-to-end run of the two cases above: a run that never evaluates trains without a
    held-out split, and the records it skipped are in metrics.jsonl."""
    good = [json.dumps({"text": _text(i)}) for i in range(30)]
    (tmp_path / "few.jsonl").write_text("\n".join(good + ["{not json"]) + "\n")
    out = _train(tmp_path / "run", f"--config.data.sources=jsonl={tmp_path}/few.jsonl",
                 "--config.data.eval_fraction=0.001", "--config.train.eval_every=0",
                 "--config.data.skip_bad_records=True", "--config.train.log_every=1",
                 "--cpu_devices=1")
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["skipped_records"] for r in records if "loss" in r] == [1, 1, 1]


@contextlib.contextmanager
def _small_tmpfs(tmp_path, size: str):
    """A tmpfs of `size` (mount's notation) at tmp_path/small, unmounted afterwards; the test
    is skipped where mounting needs a root this process is not."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(small)],
                             capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode()}")
    try:
        yield small
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_a_full_disk_during_a_checkpoint_save_is_one_paragraph(tmp_path):
    """A workdir on a 3 MiB filesystem fills while step 12 is saved: one paragraph (exit 2, no
    orbax traceback), the unfinished step removed, every listed step still restores."""
    with _small_tmpfs(tmp_path, "3m") as small:
        out = _train(small / "run", "--config.train.steps=24", "--config.train.eval_every=0",
                     "--config.checkpoint.every=4", "--cpu_devices=1")
        one_paragraph(out, "ran out of space while writing a checkpoint", "nothing was committed")
        from jaxscale.weights.restore import restore_params, saved_steps
        root = str(small / "run" / "checkpoints")
        steps = saved_steps(root)
        assert steps and not [p for p in os.listdir(root) if "tmp" in p]
        for step in steps:
            assert restore_params(root, step)["params"]


def test_a_disk_full_at_the_first_metrics_line_is_one_paragraph(tmp_path):
    """A 16 KiB workdir holds run.lock, events.jsonl (a page each) and config.json (2), nothing
    more: the first metrics.jsonl line meets the full disk, as the loggers did when a
    checkpoint's background commit filled it. One paragraph naming the file (it was a raw
    OSError, exit 1, then TensorBoard's exit hook and writer thread printed tracebacks through
    multiprocessing). With 8 KiB, config.json is the file that meets it (a raw OSError too)."""
    with _small_tmpfs(tmp_path, "16k") as small:
        out = _train(small / "run", "--cpu_devices=1")
        one_paragraph(out, f"{small}/run/metrics.jsonl is full", "run it again")
    (tmp_path / "8k").mkdir()
    with _small_tmpfs(tmp_path / "8k", "8k") as small:
        out = _train(small / "run", "--cpu_devices=1")
        one_paragraph(out, f"{small}/run/config.json is full", "run it again")


def test_convert_flags_the_conversion_would_ignore_or_cannot_parse_write_nothing(tmp_path):
    one_paragraph(cli("convert", f"--from_workdir={tmp_path}", f"--to_hf={tmp_path}/hf",
                      "--max_shard_size=5XB"), "max_shard_size='5XB'")
    one_paragraph(cli("convert", f"--from_hf={tmp_path}", f"--out={tmp_path}/out",
                      "--max_shard_size=1MB"), "--max_shard_size=1MB", "--to_hf", "Drop the flag")
    one_paragraph(cli("convert", f"--from_workdir={tmp_path}", f"--to_peft={tmp_path}/peft",
                      "--mtp"), "Drop --mtp")
    assert os.listdir(tmp_path) == []
