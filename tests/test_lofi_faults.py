"""Lo-Fi faults: hostile manifests, exact global centered clip, store integrity under restarts,
racing and killed averagers. The shared fixtures live in test_lofi_store.py."""

import dataclasses
import os
import signal
import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

from jaxscale.errors import ConfigError
from jaxscale.lofi import aggregate
from jaxscale.lofi import store as S
from jaxscale.lofi.averager import (
    AveragerConfig,
    job_settings,
    latest_average,
    publish_initial,
    run_round,
)
from jaxscale.weights import snapshot as W
from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import CHUNK, StoreError
from tests.lofi_common import (
    ROOT,
    TINY_BUDGET,
    _params,
    _push,
    _reference,
    race_two_averagers,
    tamper,
    uncommit,
)

# ------------------------------------------------------------------ hostile or broken manifests
_tamper = tamper


HOSTILE = {
    "samples_seen": (lambda m: m.update(samples_seen=-5), "samples_seen"),
    "samples_float": (lambda m: m.update(samples_seen=1e300), "samples_seen"),
    "samples_str": (lambda m: m.update(samples_seen="lots"), "samples_seen"),
    "step_bool": (lambda m: m.update(step=True), "step"),
    "kind": (lambda m: m.update(kind="pickle"), "kind"),
    "shape": (lambda m: m["leaves"]["b"].update(shape=[-7]), "shape"),
    "dtype": (lambda m: m["leaves"]["b"].update(dtype="object"), "dtype"),
    "encoding": (lambda m: m["leaves"]["b"].update(encoding="pickle"), "encoding"),
    "momentum": (lambda m: m["leaves"]["b"].update(momentum="yes"), "momentum"),
    "chunk": (lambda m: m.pop("chunk"), "chunk"),
    "data_dir": (lambda m: m.update(data="../../etc"), "data"),
    "abs_leaf": (lambda m: m["leaves"].update({"/etc/passwd": m["leaves"].pop("b")}), "escape"),
    "contributors": (lambda m: m.update(contributors={"0": "x"}), "contributors"),
    "leaves": (lambda m: m.update(leaves=[]), "leaves"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_fields_are_rejected_naming_the_field(store, case):
    edit, field = HOSTILE[case]
    _push(store, 0, 5, _params(1))
    _push(store, 1, 5, _params(2))
    _tamper(store, "workers/1/5", edit)
    with pytest.raises(StoreError, match=field):
        W.load_snapshot(store, "workers/1/5")
    report = run_round(store, TINY_BUDGET)
    assert report.used == {0: 5} and field in report.skipped[1]


def test_unparseable_manifest_is_rejected(store):
    _push(store, 0, 5, _params(1))
    store.kv.write("workers/0/5/manifest.json", b"{not json").result()
    store.kv.write(W.commit_key("workers/0/5"), W._sha(b"{not json").encode()).result()
    with pytest.raises(StoreError, match="not valid JSON"):
        W.load_snapshot(store, "workers/0/5")


def test_sample_weights_must_be_finite_and_non_negative():
    deltas = np.ones((2, 3), np.float32)
    for bad in ([-1.0, 2.0], [np.nan, 1.0], [np.inf, 1.0], [0.0, 0.0]):
        with pytest.raises(ValueError, match="finite, non-negative"):
            aggregate.mean(deltas, np.array(bad))


def test_zero_samples_everywhere_means_equal_weights(store):
    _push(store, 0, 5, {k: v + 1 for k, v in _params(0).items()}, samples=0)
    _push(store, 1, 5, {k: v + 3 for k, v in _params(0).items()}, samples=0)
    assert run_round(store, TINY_BUDGET).published
    np.testing.assert_allclose(latest_average(store).params["b"], _params(0)["b"] + 2, rtol=1e-6)


# ------------------------------------------------------------------ exact global centered clip
def test_centered_clip_uses_whole_model_norms_exactly(tmp_path):
    st = Store(str(tmp_path / "cc"))
    base = _params(0)
    publish_initial(st, base)
    rng = np.random.default_rng(7)
    pushed = [{k: v + rng.normal(scale=0.1 * (w + 1), size=v.shape).astype(np.float32)
               for k, v in base.items()} for w in range(4)]
    samples = [100, 200, 300, 400]
    for w, p in enumerate(pushed):
        _push(st, w, 5, p, samples[w])
    cfg = AveragerConfig(aggregator="centered_clip", tau=20.0, chunk_budget_bytes=1)
    assert run_round(st, cfg).published
    got = latest_average(st).params
    ref = _reference("centered_clip", base, pushed, np.array(samples, np.float64), tau=20.0)
    for leaf in base:
        np.testing.assert_allclose(got[leaf], ref[leaf], rtol=1e-5, atol=1e-6)
    # Clipping each chunk-sized block on its own norm gives a visibly different answer.
    w_delta = pushed[3]["layers/w"].ravel()[:CHUNK] - base["layers/w"].ravel()[:CHUNK]
    deltas = np.stack([p["layers/w"].ravel()[:CHUNK] - base["layers/w"].ravel()[:CHUNK]
                       for p in pushed])
    per_block = aggregate.centered_clip(deltas, np.array(samples), tau=20.0)
    assert np.abs(per_block - (got["layers/w"].ravel()[:CHUNK]
                               - base["layers/w"].ravel()[:CHUNK])).max() > 1e-3
    assert w_delta.size == CHUNK


# ------------------------------------------------------------------ store integrity
def test_committed_push_is_never_overwritten_and_partial_push_is_redone(store):
    first = _params(1)
    _push(store, 0, 5, first)
    again = S.push(store, 0, 5, _params(2), samples_seen=1)
    assert again.skipped and again.bytes_written == 0
    back = W.read_params(store, W.load_snapshot(store, "workers/0/5"))
    np.testing.assert_array_equal(back["b"], first["b"])
    _push(store, 0, 6, _params(3))
    uncommit(store, "workers/0/6")  # killed between manifest and COMMIT
    assert not S.push(store, 0, 6, _params(4), samples_seen=1).skipped
    back = W.read_params(store, W.load_snapshot(store, "workers/0/6"))
    np.testing.assert_array_equal(back["b"], _params(4)["b"])


def test_staleness_is_measured_in_rounds_against_the_base_average(store):
    cfg = AveragerConfig(max_staleness=1, chunk_budget_bytes=1)
    for r in (1, 2):  # worker 0 drives the rounds, syncing each time
        S.push(store, 0, 10 * r, _params(r), 100, synced_round=r - 1)
        assert run_round(store, cfg).round == r
    S.push(store, 0, 30, _params(3), 100, synced_round=2)
    S.push(store, 1, 30, _params(4), 100, synced_round=0)   # 2 rounds behind base round 2
    S.push(store, 2, 30, _params(5), 100, synced_round=1)   # 1 round behind: accepted
    report = run_round(store, cfg)
    assert report.used == {0: 30, 2: 30}
    assert "stale" in report.skipped[1] and "2 rounds behind" in report.skipped[1]


def test_job_settings_from_round_0_are_the_averager_defaults(tmp_path):
    st = Store(str(tmp_path / "job"))
    publish_initial(st, _params(0), job={"allowed_workers": [0, 1], "min_workers": 2,
                                         "max_staleness": 3})
    cfg = AveragerConfig().with_job(st)
    assert (cfg.allowed_workers, cfg.min_workers, cfg.max_staleness) == ((0, 1), 2, 3)
    assert AveragerConfig(min_workers=1).with_job(st, frozenset({"min_workers"})).min_workers == 1
    _push(st, 0, 5, _params(1))
    _push(st, 5, 5, _params(2))
    report = run_round(st, dataclasses.replace(cfg, chunk_budget_bytes=1))
    assert not report.published and "min_workers=2" in report.note
    assert report.skipped[5] == "not in allowed_workers"
    assert cfg.outer == "none"  # a store from before the sync mode was recorded
    bare = Store(str(tmp_path / "bare"))  # round 0 published without job settings
    publish_initial(bare, _params(0))
    assert job_settings(bare) == {}


def test_a_worker_with_other_job_settings_is_refused_by_name(tmp_path):
    from ml_collections import ConfigDict

    from jaxscale.lofi.jobcheck import check_same_job
    from jaxscale.lofi.worker import job_of
    lofi = ConfigDict(dict(allowed_workers="", num_workers=2, min_workers=2, max_staleness=0,
                           sync="end"))
    st = Store(str(tmp_path / "job"))
    check_same_job(st, job_of(lofi, 4, 8), 0)  # no round 0 yet: this worker publishes it
    publish_initial(st, _params(0), job=job_of(lofi, 4, 8))
    check_same_job(st, job_of(lofi, 4, 8), 1)  # a (re)started worker of the same job
    with pytest.raises(ConfigError, match=r"worker 1 joins .* train.steps: 3 here, 4 in the "
                                          r"job.*new lofi.store"):
        check_same_job(st, job_of(lofi, 3, 8), 1)
    with pytest.raises(ConfigError, match=r"data.batch_size: 16 here, 8 in the job"):
        check_same_job(st, job_of(lofi, 4, 16), 1)
    with pytest.raises(ConfigError, match=r"train.steps: 6 here, 4 in the job.*train a "
                                          r"finished job further, start a new job"):
        check_same_job(st, job_of(lofi, 6, 8), 1)  # its pushes past step 4 would be rejected
    lofi.num_workers = 3
    with pytest.raises(ConfigError, match=r"lofi.num_workers / lofi.allowed_workers: \[0, 1, "
                                          r"2\] here, \[0, 1\] in the job"):
        check_same_job(st, job_of(lofi, 4, 8), 2)


def test_job_sync_mode_sets_the_outer_optimizer_and_bad_settings_are_named(tmp_path):
    st = Store(str(tmp_path / "job"))
    publish_initial(st, _params(0), job={"allowed_workers": None, "min_workers": 1,
                                         "max_staleness": 0, "sync": "diloco"})
    assert AveragerConfig().with_job(st).outer == "diloco"
    assert AveragerConfig().with_job(st, frozenset({"outer"})).outer == "none"  # flag wins
    with pytest.raises(ConfigError, match=r"min_workers=0 \(at least 1.*outer='sgd'"):
        AveragerConfig(min_workers=0, outer="sgd")
    bad = Store(str(tmp_path / "bad"))
    publish_initial(bad, _params(0), job={"allowed_workers": None, "min_workers": 1,
                                          "max_staleness": 0, "sync": "sometimes"})
    with pytest.raises(StoreError, match="job settings .* malformed"):
        AveragerConfig().with_job(bad)


def test_diloco_momentum_is_checksummed(store, tmp_path):
    cfg = AveragerConfig(outer="diloco", chunk_budget_bytes=1)
    _push(store, 0, 5, {k: v + 1 for k, v in _params(0).items()})
    assert run_round(store, cfg).round == 1
    data = W.load_snapshot(store, "average/1").data
    chunk = tmp_path / "store" / data / "momentum" / "b" / "c" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[-1] ^= 0x01
    chunk.write_bytes(bytes(raw))
    _push(store, 0, 10, {k: v + 2 for k, v in _params(0).items()})
    report = run_round(store, cfg)
    assert not report.published and "momentum" in report.note and "checksum" in report.note
    assert W.average_rounds(store) == [0, 1]
    assert store.read("average/2/CLAIM") is None  # released: a repaired store can go on


def test_nonfinite_average_is_not_published_and_claim_released(store):
    huge = {k: np.full_like(v, 3e38) for k, v in _params(0).items()}
    _push(store, 0, 5, huge)
    report = run_round(store, AveragerConfig(outer="diloco", chunk_budget_bytes=1))
    assert not report.published and "non-finite" in report.note and "robust" in report.note
    assert W.average_rounds(store) == [0]
    assert store.keys("average/1/") == []  # no claim, no half-written data left


def test_claim_and_data_released_on_unexpected_error(store, monkeypatch):
    import jaxscale.lofi.averager as A

    def boom(inputs):
        inputs.store.array(f"{inputs.data}/arrays/b", 7, "float32")  # some data written
        raise RuntimeError("disk on fire")

    _push(store, 0, 5, _params(1))
    monkeypatch.setattr(A, "stream_round", boom)
    with pytest.raises(RuntimeError):
        run_round(store, TINY_BUDGET)
    assert store.keys("average/1/") == []
    monkeypatch.undo()
    assert run_round(store, TINY_BUDGET).round == 1


# ------------------------------------------------------------------ racing and killed averagers
def test_two_racing_averagers_publish_the_round_once(store):
    for w in range(3):
        _push(store, w, 5, _params(w + 1))
    reports = race_two_averagers(store.location, TINY_BUDGET)
    assert sorted(r.published for r in reports) == [False, True]
    assert W.average_rounds(store) == [0, 1]
    avg = W.load_snapshot(store, "average/1")
    W.read_params(store, avg)  # every chunk verifies
    dirs = {k.split("/")[2] for k in store.keys("average/1/") if k.count("/") > 2}
    assert dirs == {avg.manifest["data"]}  # the loser left nothing behind


def _stall_a_then_run_b(store, monkeypatch, attr, stall):
    """Averager A runs in a thread until `stall` (called in place of averager.<attr>, which then
    proceeds) holds it; averager B, seeing A's claim expired, takes round 1 over; then A
    resumes. Returns A's report, B's report and round 1's params as B published them."""
    import jaxscale.lofi.averager as A
    real, stalled, resume = getattr(A, attr), threading.Event(), threading.Event()

    def wrapped(*args, **kwargs):
        if threading.current_thread().name == "A":
            stall(*args, **kwargs)
            stalled.set()
            resume.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(A, attr, wrapped)
    out = {}
    a = threading.Thread(name="A", target=lambda: out.update(
        a=run_round(Store(store.location), TINY_BUDGET)))
    a.start()
    stalled.wait(60)
    b = run_round(store, dataclasses.replace(TINY_BUDGET, claim_timeout_s=0.0))
    expected = W.read_params(store, W.load_snapshot(store, "average/1"))
    resume.set()
    a.join()
    return out["a"], b, expected


def test_presumed_dead_averager_waking_up_cannot_damage_the_round(store, monkeypatch):
    """A takes round 1 and stalls past the claim timeout; B takes over and publishes; A wakes,
    finishes writing into its own directory and fails to commit: round 1 stays B's, intact."""
    _push(store, 0, 5, _params(1))
    a, b, expected = _stall_a_then_run_b(store, monkeypatch, "stream_round", lambda inp: None)
    assert b.round == 1
    assert not a.published and "another averager" in a.note
    got = W.read_params(store, W.load_snapshot(store, "average/1"))
    np.testing.assert_array_equal(got["layers/w"], expected["layers/w"])


def test_averager_stalled_between_manifest_and_commit_cannot_damage_the_round(store,
                                                                               monkeypatch):
    """The window the single-key commit closes: A has written its manifest but not COMMIT when
    B takes over and publishes; A's late COMMIT loses, A removes only its own attempt, and
    round 1 stays B's, readable, with the next round building on it."""
    _push(store, 0, 5, _params(1))

    def half_commit(st, prefix, manifest, exclusive=True):
        st.write(f"{prefix}/{manifest['data']}/manifest.json", b"{}")

    a, b, expected = _stall_a_then_run_b(store, monkeypatch, "commit", half_commit)
    assert b.published and b.round == 1 and not a.published
    ours = W.committed_data(store, "average/1")
    assert {k.split("/")[2] for k in store.keys("average/1/") if k.count("/") > 2} == {ours}
    got = W.read_params(store, W.load_snapshot(store, "average/1"))
    np.testing.assert_array_equal(got["layers/w"], expected["layers/w"])
    _push(store, 0, 6, _params(3))
    assert run_round(store, TINY_BUDGET).round == 2


def test_interrupt_after_commit_never_unpublishes_the_round(store, monkeypatch):
    """SystemExit (a SIGTERM'd watcher) right after the commit, while tidying scratch space:
    the published round's data stays; workers can read it."""
    _push(store, 0, 5, _params(1))
    real = Store.delete_prefix

    def interrupted(self, prefix):
        if prefix.endswith("/scratch"):
            raise SystemExit(143)
        return real(self, prefix)

    monkeypatch.setattr(Store, "delete_prefix", interrupted)
    with pytest.raises(SystemExit):
        run_round(store, TINY_BUDGET)
    average = latest_average(store)
    assert average.round == 1 and np.all(np.isfinite(average.params["layers/w"]))


def test_two_processes_pushing_one_worker_step_keep_the_first(store):
    first = _push(store, 0, 5, _params(1))
    second = _push(store, 0, 5, _params(2))
    assert not first.skipped and second.skipped
    got = W.read_params(store, W.load_snapshot(store, "workers/0/5"))
    np.testing.assert_array_equal(got["b"], _params(1)["b"])


KILL_MID_AVERAGE = """
import os, signal, sys
import jaxscale.lofi.stream as R
from jaxscale.lofi.averager import AveragerConfig, run_round
real, calls = R._write_block, []
def dying(*args):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args)
R._write_block = dying
run_round(sys.argv[1], AveragerConfig(chunk_budget_bytes=1))
"""


def test_averager_killed_mid_write_leaves_previous_average_newest(store):
    _push(store, 0, 5, _params(1))
    assert run_round(store, TINY_BUDGET).round == 1
    before = latest_average(store)
    _push(store, 0, 10, _params(2))
    proc = subprocess.run([sys.executable, "-c", KILL_MID_AVERAGE, store.location], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == -signal.SIGKILL
    assert store.read("average/2/CLAIM") is not None and store.keys("average/2/")  # half done
    assert W.average_rounds(store) == [0, 1]
    reloaded = latest_average(store)  # what a worker reloading now gets
    assert reloaded.round == 1
    np.testing.assert_array_equal(reloaded.params["layers/w"], before.params["layers/w"])
    assert "another averager" in run_round(store, TINY_BUDGET).note  # claim still fresh
    report = run_round(store, dataclasses.replace(TINY_BUDGET, claim_timeout_s=0.0))
    assert report.round == 2 and report.used == {0: 10}
    W.read_params(store, W.load_snapshot(store, "average/2"))


def test_wrong_dtype_or_tree_is_rejected_naming_the_leaf(store):
    _push(store, 0, 5, _params(1))
    _push(store, 1, 5, {**_params(2), "b": _params(2)["b"].astype(ml_dtypes.bfloat16)})
    _push(store, 2, 5, {**_params(3), "extra/leaf": np.zeros(3, np.float32)})
    report = run_round(store, TINY_BUDGET)
    assert report.used == {0: 5}
    assert "leaf b" in report.skipped[1] and "bfloat16" in report.skipped[1]
    assert "extra leaves ['extra/leaf']" in report.skipped[2]


def test_accounting_reports_ddp_equivalent_and_compression_savings(store):
    from jaxscale.lofi.accounting import accounting_lines, store_totals
    run_round(store, TINY_BUDGET)
    S.push(store, 0, 100, {k: v + np.float32(0.01) for k, v in _params(0).items()}, 1,
           compress=True)
    S.push(store, 1, 100, {k: v - np.float32(0.01) for k, v in _params(0).items()}, 1)
    assert run_round(store, TINY_BUDGET).published
    t = store_totals(store.location)
    param_bytes = sum(v.nbytes for v in _params(0).values())
    assert t["param_bytes"] == param_bytes
    assert t["ddp_allreduce"] == 2 * (2 - 1) / 2 * param_bytes * (100 + 100)
    assert t["pushed"] < 0.3 * param_bytes + param_bytes  # one 8-bit push, one raw
    text = "\n".join(accounting_lines(store.location))
    assert "data-parallel all-reduce" in text and "compression: pushes stored" in text


def test_corrupt_committed_round_is_reported_not_waited_for(store):
    _push(store, 0, 5, _params(1))
    assert run_round(store, TINY_BUDGET).round == 1
    tamper(store, "average/1", lambda m: None)  # re-signed, still valid ...
    store.kv.write(W.commit_key("average/1"), b"0" * 64 + b" " + W.committed_data(
        store, "average/1").encode() + b"/manifest.json").result()  # ... now it is not
    _push(store, 0, 6, _params(2))
    report = run_round(store, TINY_BUDGET)  # built on round 0, the newest that verifies
    assert report.round == 2 and "average/1 is committed but does not verify" in report.fallback
    assert "built on the previous good average (round 0)" in report.fallback
