"""Lo-Fi store and averager: exact aggregates, faults and hostile input leave the store sane."""

import json
import re

import ml_dtypes
import numpy as np
import pytest

from jaxscale.lofi import aggregate
from jaxscale.lofi import store as S
from jaxscale.lofi.averager import AveragerConfig, latest_average, publish_initial, run_round
from jaxscale.weights import snapshot as W
from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import CHUNK, StoreError
from jaxscale.weights.push_codec import dequantize_blockwise, quantize_blockwise
from tests.lofi_common import TINY_BUDGET, _params, _push, _reference, data_dir, tamper, uncommit


def test_mean_equals_numpy_reference_for_leaves_larger_than_budget(store):
    base = _params(0)
    ws = {w: _params(w + 1) for w in range(3)}
    samples = {0: 100, 1: 300, 2: 600}
    for w, p in ws.items():
        _push(store, w, 10, p, samples[w])
    report = run_round(store, AveragerConfig(chunk_budget_bytes=1, min_workers=3))
    assert report.published and report.used == {0: 10, 1: 10, 2: 10}
    avg = latest_average(store)
    wts = np.array([samples[w] for w in range(3)], np.float64) / 1000
    for leaf in base:
        deltas = np.stack([ws[w][leaf].astype(np.float32) - base[leaf] for w in range(3)])
        expected = base[leaf] + np.tensordot(wts.astype(np.float32), deltas, axes=1)
        np.testing.assert_allclose(avg.params[leaf], expected, rtol=1e-6, atol=1e-6)
    again = run_round(store, AveragerConfig(chunk_budget_bytes=1, min_workers=3))
    assert not again.published and again.note == "nothing new: no complete push since round 1"


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "centered_clip"])
def test_robust_aggregators_match_numpy_and_resist_a_hostile_worker(tmp_path, name):
    st = Store(str(tmp_path / name))
    publish_initial(st, _params(0))
    base = _params(0)
    honest = {w: {k: v + 0.01 * (w + 1) for k, v in base.items()} for w in range(4)}
    for w, p in honest.items():
        _push(st, w, 5, p)
    _push(st, 4, 5, {k: v + 1e6 for k, v in base.items()})  # huge but finite
    cfg = AveragerConfig(aggregator=name, chunk_budget_bytes=1, tau=0.05, trim=0.2)
    assert run_round(st, cfg).published
    got = latest_average(st).params
    pushed = [honest[w] for w in range(4)] + [{k: v + 1e6 for k, v in base.items()}]
    ref = _reference(name, base, pushed, np.ones(5), trim=0.2, tau=0.05)
    for leaf in base:
        np.testing.assert_allclose(got[leaf], ref[leaf], rtol=1e-5, atol=1e-5)
        honest_mean = np.mean([honest[w][leaf] for w in range(4)], axis=0)
        assert np.abs(got[leaf] - honest_mean).max() < 0.05


def test_mean_is_not_robust(store):
    _push(store, 0, 5, _params(0))
    _push(store, 1, 5, {k: v + 1e6 for k, v in _params(0).items()})
    run_round(store, TINY_BUDGET)
    assert np.abs(latest_average(store).params["b"] - _params(0)["b"]).min() > 1e5


def test_bfloat16_pushes_are_reduced_in_float32(tmp_path):
    st = Store(str(tmp_path / "bf16"))
    base = _params(0, dtype=ml_dtypes.bfloat16)
    publish_initial(st, base)
    a = {k: (v.astype(np.float32) + 1).astype(ml_dtypes.bfloat16) for k, v in base.items()}
    b = {k: (v.astype(np.float32) + 2).astype(ml_dtypes.bfloat16) for k, v in base.items()}
    _push(st, 0, 1, a)
    _push(st, 1, 1, b)
    run_round(st, TINY_BUDGET)
    got = latest_average(st).params["b"]
    ref = (base["b"].astype(np.float32) + ((a["b"].astype(np.float32) - base["b"].astype(np.float32))
           + (b["b"].astype(np.float32) - base["b"].astype(np.float32))) / 2)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, ref.astype(ml_dtypes.bfloat16))


def test_partial_push_is_ignored(store):
    _push(store, 0, 5, _params(1))
    _push(store, 1, 5, _params(2))
    uncommit(store, "workers/1/5")  # killed before the marker
    report = run_round(store, TINY_BUDGET)
    assert report.used == {0: 5} and 1 not in report.used


def test_corrupt_chunk_on_disk_is_detected_and_worker_skipped(store, tmp_path):
    _push(store, 0, 5, _params(1))
    _push(store, 1, 5, _params(2))
    chunk = tmp_path / "store" / data_dir(store, "workers/1/5") / "arrays" / "layers" / "w" / "c" / "1"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    report = run_round(store, TINY_BUDGET)
    assert report.used == {0: 5}
    assert "checksum mismatch" in report.skipped[1] and "layers/w" in report.skipped[1]
    assert "c/1" in report.skipped[1]  # tensorstore's crc32c check names the chunk


@pytest.mark.parametrize("damage", ["truncate", "delete", "crc"])
def test_damaged_chunk_file_is_a_read_error_not_garbage(tmp_path, damage):
    """A truncated chunk fails to decode, a deleted one is missing (never read as zeros), one
    whose stored crc32c has a flipped bit fails the check."""
    st = Store(str(tmp_path))
    S.push(st, 0, 1, {"w": np.arange(1, 3 * CHUNK + 5, dtype=np.float32)}, samples_seen=1)
    ckpt = W.load_snapshot(st, S.worker_prefix(0, 1))
    chunks = tmp_path / ckpt.data / "arrays" / "w" / "c"
    if damage == "truncate":
        (chunks / "1").write_bytes((chunks / "1").read_bytes()[:100])
    elif damage == "delete":
        (chunks / "1").unlink()
    else:
        data = bytearray((chunks / "1").read_bytes())
        data[-1] ^= 0x01  # the chunk's last 4 bytes are its crc32c
        (chunks / "1").write_bytes(bytes(data))
    expected = "checksum mismatch" if damage == "crc" else "cannot read its data"
    with pytest.raises(StoreError, match=expected):
        W.read_leaf(st, ckpt, "w")


def test_array_metadata_that_disagrees_with_the_manifest_is_refused(store):
    _push(store, 0, 5, _params(1))
    _push(store, 1, 5, _params(2))
    tamper(store, "workers/1/5", lambda m: m["leaves"]["b"].update(dtype="float16"))
    report = run_round(store, TINY_BUDGET)  # the zarr array says float32: refused at open
    assert report.used == {0: 5} and "leaf b" in report.skipped[1]


def test_nonfinite_push_rejected(store):
    bad = _params(2)
    bad["layers/w"][5] = np.nan
    _push(store, 0, 5, _params(1))
    _push(store, 1, 5, bad)
    report = run_round(store, TINY_BUDGET)
    assert report.used == {0: 5} and "non-finite" in report.skipped[1]
    assert np.isfinite(latest_average(store).params["layers/w"]).all()


def test_nonfinite_value_deep_in_a_block_is_found_in_its_piece(store):
    from jaxscale.lofi.stream import piece_size
    piece = piece_size(2)
    assert piece < CHUNK  # a one-chunk block (TINY_BUDGET) holds several pieces
    where = CHUNK + piece + 17  # second block, second piece: pieces are checked one by one
    bad = _params(2)
    bad["layers/w"][where] = np.inf
    _push(store, 0, 5, _params(1))
    _push(store, 1, 5, bad)
    report = run_round(store, TINY_BUDGET)
    start = CHUNK + piece
    assert report.used == {0: 5}
    assert f"(values {start}..{start + piece})" in report.skipped[1], report.skipped


def test_allowed_workers_quorum_and_wrong_structure(store):
    _push(store, 0, 5, _params(1))
    _push(store, 7, 5, _params(2))
    wrong = _params(3)
    wrong["b"] = np.zeros(8, np.float32)
    _push(store, 2, 5, wrong)
    report = run_round(store, AveragerConfig(allowed_workers=(0, 2), min_workers=2,
                                             chunk_budget_bytes=1))
    assert not report.published and "min_workers=2" in report.note
    assert report.skipped[7] == "not in allowed_workers"
    assert "leaf b" in report.skipped[2] and "[8]" in report.skipped[2]
    assert W.average_rounds(store) == [0]


def test_late_joiner_and_leaver(store):
    _push(store, 0, 5, _params(1))
    assert run_round(store, TINY_BUDGET).used == {0: 5}
    _push(store, 1, 10, _params(2))  # joins late; worker 0 has left
    report = run_round(store, TINY_BUDGET)
    assert report.used == {1: 10}
    assert not run_round(store, TINY_BUDGET).published  # nothing new: no duplicate round


def test_manifest_escaping_the_store_is_rejected(store):
    _push(store, 0, 5, _params(1))
    tamper(store, "workers/0/5",
           lambda m: m["leaves"].__setitem__("../../outside", m["leaves"].pop("b")))
    with pytest.raises(StoreError, match="escape the store"):
        W.load_snapshot(store, "workers/0/5")
    assert "escape" in run_round(store, TINY_BUDGET).skipped[0]


def test_killed_averager_leaves_previous_average_newest_and_racers_publish_once(store):
    _push(store, 0, 5, _params(1))
    assert run_round(store, TINY_BUDGET).round == 1
    _push(store, 0, 10, _params(2))
    store.write("average/2/CLAIM", json.dumps({"time": 9e9, "token": "x"}).encode())
    report = run_round(store, TINY_BUDGET)
    assert not report.published and "another averager" in report.note
    assert latest_average(store).round == 1  # a reader still gets the complete round 1
    store.kv.write("average/2/CLAIM", json.dumps({"time": 0, "token": "x"}).encode()).result()
    assert run_round(store, TINY_BUDGET).round == 2


def test_diloco_momentum_persisted_and_restart_idempotent(store):
    cfg = AveragerConfig(outer="diloco", outer_lr=0.7, outer_momentum=0.9, chunk_budget_bytes=1)
    base = _params(0)
    _push(store, 0, 5, {k: v + 1 for k, v in base.items()})
    run_round(store, cfg)
    first = latest_average(store).params["b"].copy()
    np.testing.assert_allclose(first, base["b"] + 0.7 * (1 + 0.9 * 1), rtol=1e-6)
    _push(store, 0, 10, {k: v + 1 for k, v in latest_average(store).params.items()})
    run_round(store, cfg)
    second = latest_average(store).params["b"].copy()
    m2 = 0.9 * 1 + 1  # momentum carried over from round 1
    np.testing.assert_allclose(second, first + 0.7 * (1 + 0.9 * m2), rtol=1e-5)
    for key in store.keys("average/2/") + [W.commit_key("average/2")]:
        store.kv.write(key, None).result()  # the averager "restarts" and redoes round 2
    run_round(store, cfg)
    np.testing.assert_array_equal(latest_average(store).params["b"], second)


def test_quantization_error_bound_and_compressed_push(store):
    x = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    q, scale = quantize_blockwise(x)
    err = np.abs(dequantize_blockwise(q, scale, x.shape) - x)
    assert (err <= np.repeat(scale, 256)[:1000] / 2 + 1e-7).all()
    run_round(store, TINY_BUDGET)
    pushed = {k: v + np.float32(0.01) * np.sin(np.arange(v.size)).reshape(v.shape).astype(np.float32)
              for k, v in _params(0).items()}
    report = S.push(store, 0, 5, pushed, 1, compress=True)
    assert report.bytes_written < 0.3 * report.raw_bytes
    back = W.read_params(store, W.load_snapshot(store, "workers/0/5"))
    for k in pushed:
        np.testing.assert_allclose(back[k], pushed[k], atol=0.01 / 127)


# ------------------------------------------------------------------ format and durability
def test_arrays_are_zarr3_with_crc32c_and_older_formats_are_named(store):
    _push(store, 0, 5, _params(1))
    zarr = json.loads(store.read(f"{data_dir(store, 'workers/0/5')}/arrays/b/zarr.json"))
    assert {"name": "crc32c"} in zarr["codecs"]
    assert W.load_snapshot(store, "workers/0/5").chunk == CHUNK == 1 << 18
    tamper(store, "workers/0/5", lambda m: m.update(format=1))
    with pytest.raises(StoreError, match="format 1, but this jaxscale reads format 2"):
        W.load_snapshot(store, "workers/0/5")


@pytest.mark.parametrize("chunk", [1000, 1 << 25, True, "big"])
def test_bad_chunk_size_is_rejected(store, chunk):
    _push(store, 0, 5, _params(1))
    tamper(store, "workers/0/5", lambda m: m.update(chunk=chunk))
    with pytest.raises(StoreError, match="chunk = .*power of two"):
        W.load_snapshot(store, "workers/0/5")


def test_arrays_are_complete_before_any_commit_names_them(store, monkeypatch):
    """Every array write has completed (tensorstore: fsynced and renamed into place) when a
    COMMIT is written: a fresh reader at that moment reads the whole checkpoint."""
    commits = []
    write = Store.write

    def checked(self, key, data, **kw):
        if key.startswith("commits/"):
            prefix = key[len("commits/"):]
            relative = data.decode().split(" ", 1)[1]
            manifest = json.loads(self.read(f"{prefix}/{relative}"))
            fresh = Store(self.location)
            ckpt = W.Snapshot(prefix, manifest)
            commits.append((key, {leaf: W.read_leaf(fresh, ckpt, leaf) for leaf in ckpt.leaves}))
        return write(self, key, data, **kw)
    monkeypatch.setattr(Store, "write", checked)
    _push(store, 0, 5, _params(1))
    assert run_round(store, TINY_BUDGET).published
    assert [k for k, _ in commits] == ["commits/workers/0/5", "commits/average/1"]
    np.testing.assert_array_equal(commits[0][1]["b"], _params(1)["b"])
    np.testing.assert_array_equal(commits[1][1]["layers/w"],
                                  latest_average(store).params["layers/w"])
    assert "file_io_sync" not in json.dumps(store.array("x", 1, "float32").spec().to_json())


def test_finite_rows_fast_path_keeps_huge_finite_rows_and_flags_nonfinite():
    rows = np.ones((5, 1000), np.float32)
    rows[1] *= 3e38            # finite, but its sum overflows: must still count as finite
    rows[2, 17] = np.inf
    rows[3, 499] = np.nan
    rows[4, 3], rows[4, 4] = np.inf, -np.inf  # its sum is nan, not inf
    assert aggregate.finite_rows(rows).tolist() == [True, True, False, False, False]
    # a piece narrower than its buffer (strided rows), as the averager's last piece is
    assert aggregate.finite_rows(rows[:, :500]).tolist() == [True, True, False, False, False]
    assert aggregate.finite_rows(rows[:, :10]).tolist() == [True, True, True, True, False]


def test_checkpoints_are_found_by_listing_commits_without_listing_chunks(store, monkeypatch):
    _push(store, 0, 5, _params(1))
    _push(store, 1, 5, _params(2))
    _push(store, 1, 7, _params(3))
    uncommit(store, "workers/1/7")  # died between its manifest and its COMMIT
    store.write("commits/workers/1/notastep", b"")  # not a checkpoint: ignored
    listed = []
    keys = Store.keys
    monkeypatch.setattr(Store, "keys", lambda self, p: listed.append(p) or keys(self, p))
    assert S.worker_pushes(store) == {0: [5], 1: [5]}
    assert W.average_rounds(store) == [0]
    assert listed == ["commits/workers/", "commits/average/"]  # no chunk key was listed


def test_budget_below_one_block_is_warned_with_the_fix(caplog):
    from jaxscale.lofi.stream import block_size
    assert block_size(64, 64 << 20, CHUNK) == CHUNK  # one chunk per block: over budget
    assert "raise --chunk_budget_mb to at least 198" in caplog.text
    caplog.clear()
    assert block_size(4, 64 << 20, CHUNK) == 3 * CHUNK and not caplog.text


def test_polling_the_newest_average_reads_each_commit_once(store):
    _push(store, 0, 5, _params(1))
    assert run_round(store, TINY_BUDGET).round == 1
    reads = []

    class Counting:  # the kvstore, recording the keys read
        def __init__(self, kv):
            self.kv = kv

        def read(self, key, *a, **k):
            reads.append(key)
            return self.kv.read(key, *a, **k)

        def __getattr__(self, name):
            return getattr(self.kv, name)
    store.kv = Counting(store.kv)
    assert W.latest_average_snapshot(store).manifest["round"] == 1
    assert reads.count("commits/average/1") == 1 and "commits/average/0" not in reads


def test_final_export_never_writes_over_a_training_workdir(tmp_path):
    from jaxscale.lofi.accounting import check_final_dir
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(StoreError, match=r"--final=.*/run holds checkpoints, metrics.jsonl, "
                                         r"which an export .* Nothing was written"):
        check_final_dir(str(run))
    assert (run / "config.json").read_text() == "{}"
    earlier = tmp_path / "final"  # an earlier export is replaced, as a rerun of the job does
    (earlier / "params").mkdir(parents=True)
    (earlier / "commits").mkdir()
    (earlier / "config.json").write_text("{}")
    (earlier / "params" / "manifest.json").write_text("{}")
    check_final_dir(str(earlier))
    check_final_dir(str(tmp_path / "new"))


def test_lofi_local_never_turns_a_training_workdir_into_a_store(tmp_path, store):
    """`lofi-local --store`: a training workdir (or any other non-empty directory without a
    Lo-Fi job) is refused before anything is written; a new or empty directory, a job's store
    and a job stopped before round 0 (its config.json, lofi-local's runs/) are taken."""
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"lofi": {"enabled": False}}))
    (run / "metrics.jsonl").write_text("")
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(StoreError, match=rf"--store={re.escape(str(run))} holds checkpoints, config.json, "
                                         r"metrics.jsonl and no Lo-Fi job.* new or empty "
                                         r"directory, or an existing Lo-Fi store"):
        S.check_new_store(str(run))
    assert sorted(p.name for p in run.iterdir()) == before
    other = tmp_path / "other"  # lofi-local's own runs/ names only
    (other / "runs" / "my_experiment").mkdir(parents=True)
    with pytest.raises(StoreError, match=r"holds runs and no Lo-Fi job"):
        S.check_new_store(str(other))
    started = tmp_path / "started"  # stopped after the first worker recorded the job
    (started / "runs" / "worker0").mkdir(parents=True)
    (started / "runs" / "final").mkdir()
    (started / "config.json").write_text(json.dumps({"lofi": {"enabled": True}}))
    (tmp_path / "empty").mkdir()
    for ok in (store.location, started, tmp_path / "empty", tmp_path / "new"):
        S.check_new_store(str(ok))


def test_a_worker_refuses_a_training_workdir_store_but_never_a_siblings_files(tmp_path):
    """`jaxscale train --config.lofi.store=DIR` run directly: the worker checks the store as
    lofi-local does, before anything is written; its first write then marks the store as the
    job's, so a sibling starting on the same fresh store takes what it finds there afterwards
    (the first worker's workdir inside the store, the job's config.json)."""
    from configs import tiny_lm
    from jaxscale.lofi.worker import export_config, train_worker

    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    config = tiny_lm.get_config("test")
    config.lofi.update(enabled=True, store=str(run))
    with pytest.raises(StoreError, match=rf"--config\.lofi\.store={re.escape(str(run))} holds "
                                         r"checkpoints, metrics\.jsonl and no Lo-Fi job"):
        train_worker(config, str(tmp_path / "w0"))
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert not (tmp_path / "w0").exists()
    fresh = tmp_path / "fresh"
    S.claim_store(str(fresh), "--config.lofi.store")  # worker 0, first on an empty store
    (fresh / "w0" / "checkpoints").mkdir(parents=True)  # its workdir, then the job's config
    (fresh / "config.json").write_bytes(export_config(config))
    S.claim_store(str(fresh), "--config.lofi.store")  # worker 1 joins: no refusal
    stopped = tmp_path / "stopped"  # a job stopped before round 0 holds the job's config only
    stopped.mkdir()
    (stopped / "config.json").write_bytes(export_config(config))
    S.check_new_store(str(stopped))
