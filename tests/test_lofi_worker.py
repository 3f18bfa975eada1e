"""Lo-Fi workers: 1 worker == plain training, restarts after a killed push, the launchers."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from child_env import child_env
from configs.tiny_lm import get_config
from hooks_common import SigtermAt
from jaxscale.errors import ConfigError
from jaxscale.inference.evaluate import evaluate_params, evaluate_workdir, read_config
from jaxscale.interop.convert import workdir_to_hf
from jaxscale.lofi import store as S
from jaxscale.lofi.accounting import accounting_lines, export_final
from jaxscale.lofi.averager import AveragerConfig, latest_average, run_round
from jaxscale.lofi.worker import train_worker
from jaxscale.runtime.preemption import Preempted
from jaxscale.train import loop
from jaxscale.weights import snapshot as W
from jaxscale.weights.kv import Store, kvstore_spec
from jaxscale.weights.sources import open_weights
from jaxscale.weights.tree import flatten
from tests.lofi_common import KILL_MID_PUSH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_env()


def train(c, workdir, hooks=()):
    """A plain run or a Lo-Fi worker, as `launch.train` picks them by `lofi.enabled`."""
    return (train_worker if c.lofi.enabled else loop.train)(c, workdir, hooks)


def test_plain_train_refuses_a_lofi_config_in_one_paragraph(tmp_path):
    c = get_config("test")
    c.lofi.update(enabled=True, store=str(tmp_path / "store"))
    with pytest.raises(ConfigError, match=r"lofi.enabled=True.*train_worker\(config"):
        loop.train(c, str(tmp_path / "w0"))
    assert not (tmp_path / "store").exists() and not (tmp_path / "w0").exists()


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.mark.slow
def test_one_worker_lofi_equals_plain_training(tmp_path):
    c = get_config("test")
    c.train.steps = 4
    plain = train(c, str(tmp_path / "plain"))
    c.lofi.update(enabled=True, store=str(tmp_path / "store"), push_every="2")
    train(c, str(tmp_path / "lofi"))
    np.testing.assert_array_equal(_losses(tmp_path / "plain"), _losses(tmp_path / "lofi"))
    assert S.worker_pushes(Store(c.lofi.store)) == {0: [2, 4]}
    run_round(c.lofi.store, AveragerConfig())
    average = latest_average(c.lofi.store).params
    for leaf, value in flatten(plain.params).items():
        np.testing.assert_allclose(average[leaf], np.asarray(value), rtol=1e-6, atol=1e-7)
    # The final export is a workdir that evaluation, HF export and init_from accept.
    final = str(tmp_path / "final")
    export_final(c.lofi.store, final)
    got = evaluate_workdir(final, max_batches=1)
    want = evaluate_params(read_config(str(tmp_path / "plain")), plain.params, max_batches=1)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    hf_dir = workdir_to_hf(final, str(tmp_path / "hf"))
    assert os.path.exists(os.path.join(hf_dir, "config.json"))
    loaded = open_weights(final).arrays()
    assert set(loaded) == set(flatten(plain.params))


class _Recorder:
    """Hook recording host params and optimizer step counts after every step."""

    def __init__(self):
        self.params, self.counts = {}, {}

    def after_step(self, info):
        self.params[info.step] = {k: np.asarray(v) for k, v in flatten(info.state.params).items()}
        leaves = jax.tree_util.tree_flatten_with_path(info.state.opt_state)[0]
        self.counts[info.step] = {int(v) for p, v in leaves
                                  if "count" in jax.tree_util.keystr(p)}

    def at_end(self, info):
        pass


def _averaging_thread(store, cfg):
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            run_round(store, cfg)
            time.sleep(0.05)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return stop, thread


def _train_with_watching_averager(c, workdir: str) -> _Recorder:
    """Trains a periodic Lo-Fi worker while a thread runs averaging rounds on its store."""
    stop, thread = _averaging_thread(c.lofi.store, AveragerConfig())
    rec = _Recorder()
    try:
        train(c, workdir, hooks=[rec])
    finally:
        stop.set()
        thread.join()
    return rec


@pytest.mark.slow
def test_periodic_worker_pushes_ema_resets_optimizer_and_continues_from_average(tmp_path):
    c = get_config("test")
    c.train.steps = 4
    store = str(tmp_path / "store")
    c.lofi.update(enabled=True, store=store, push_every="2", sync="periodic", sync_every=2,
                  push_ema=0.5, reset_optimizer_on_sync=True, sync_timeout_s=300.0)
    c.checkpoint.update(every=2, keep=5)
    rec = _train_with_watching_averager(c, str(tmp_path / "w0"))
    st = Store(store)
    p0 = W.read_params(st, W.load_snapshot(st, "average/0"))
    ema = {k: 0.25 * p0[k] + 0.25 * rec.params[1][k] + 0.5 * rec.params[2][k] for k in p0}
    pushed = W.read_params(st, W.load_snapshot(st, "workers/0/2"))
    round1 = W.read_params(st, W.load_snapshot(st, "average/1"))
    for k in p0:  # the push is the EMA, and (1 worker, mean) round 1 is that push
        np.testing.assert_allclose(pushed[k], ema[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(round1[k], pushed[k], rtol=1e-6, atol=1e-7)
    assert rec.counts[2] == {2} and rec.counts[3] == {1}  # fresh optimizer after the sync
    assert W.load_snapshot(st, "workers/0/4").manifest["synced_round"] == 1
    # The checkpoint of sync step 2 holds the average the run continued with (round 1, the
    # EMA push), not the raw pre-sync weights: a run resumed from it misses no average.
    shutil.rmtree(tmp_path / "w0" / "checkpoints" / "4")
    saved = open_weights(str(tmp_path / "w0")).arrays()
    for k in p0:
        np.testing.assert_allclose(saved[k], round1[k], rtol=1e-6, atol=1e-7)
        assert not np.allclose(saved[k], rec.params[2][k])
    assert any("Lo-Fi total" in line for line in accounting_lines(store))


@pytest.mark.slow
def test_restarted_worker_continues_from_its_last_complete_push(tmp_path):
    c = get_config("test")
    c.train.steps = 6
    c.lofi.update(enabled=True, store=str(tmp_path / "store"), push_every="2")
    with pytest.raises(Preempted):
        train(c, str(tmp_path / "w0"), hooks=[SigtermAt(4)])
    store = Store(c.lofi.store)
    store.delete(W.commit_key("workers/0/4"))  # the push of step 4 was cut off
    shutil.rmtree(tmp_path / "w0" / "checkpoints")  # and the VM's disk, with its save, is lost
    os.remove(tmp_path / "w0" / "metrics.jsonl")
    train(c, str(tmp_path / "w0"))
    steps = [json.loads(l)["step"] for l in open(tmp_path / "w0" / "metrics.jsonl")]
    assert steps == [3, 4, 5, 6]  # resumed after step 2, the last complete push
    assert S.worker_pushes(store)[0] == [2, 4, 6]


@pytest.mark.slow
def test_worker_resumed_from_its_own_checkpoint_reports_the_round_it_continued_from(tmp_path):
    """sync=end loads no average mid-run: rounds a watching averager published from its pushes
    must not count as synced (the averager measures staleness by it)."""
    c = get_config("test")
    c.train.steps = 6
    c.checkpoint.update(every=2, keep=5)
    c.lofi.update(enabled=True, store=str(tmp_path / "store"), push_every="2")
    with pytest.raises(Preempted):
        train(c, str(tmp_path / "w0"), hooks=[SigtermAt(4)])
    assert run_round(c.lofi.store, AveragerConfig()).round == 1  # covers step 4, not loaded
    train(c, str(tmp_path / "w0"))  # resumes from its own checkpoint of step 4
    store = Store(c.lofi.store)
    assert S.worker_pushes(store)[0] == [2, 4, 6]
    assert W.load_snapshot(store, "workers/0/6").manifest["synced_round"] == 0


def test_worker_killed_mid_push_leaves_no_visible_checkpoint(tmp_path):
    store_dir = str(tmp_path / "store")
    S.push(store_dir, 3, 5, {"a": np.zeros(10, np.float32), "b": np.zeros(5, np.float32)}, 1)
    proc = subprocess.run([sys.executable, "-c", KILL_MID_PUSH, store_dir], env=ENV, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL
    store = Store(store_dir)
    assert S.worker_pushes(store) == {3: [5]}  # step 7 is partial: invisible
    assert store.read(W.commit_key("workers/3/7")) is None


def test_lofi_vm_dry_run_prints_one_valid_worker_per_vm_and_the_averager():
    out = subprocess.run([sys.executable, "-m", "launch.lofi_local", "--num_workers=3",
                          "--store=gs://bucket/run1", "--dry_run", "--sync=diloco", "--",
                          "--config=configs/tiny_lm.py", "--config.train.steps=50"],
                         env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    commands = [l for l in out.stdout.splitlines() if l and not l.startswith("#")]
    workers = [c for c in commands if c.startswith("jaxscale train ")]
    assert len(workers) == 3 and len(commands) == 5
    # each command parses and validates as a real run would
    check = subprocess.run([sys.executable, "-m", "tests.check_worker_flags", *workers],
                           env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stderr[-2000:]
    lofis = [json.loads(line) for line in check.stdout.splitlines() if line.startswith("{")]
    assert len(lofis) == len(workers), check.stdout[-2000:]
    for i, lofi in enumerate(lofis):
        assert (lofi["enabled"], lofi["worker_id"], lofi["num_workers"], lofi["sync"],
                lofi["min_workers"], lofi["store"]) == (True, i, 3, "diloco", 3, "gs://bucket/run1")
    assert kvstore_spec("gs://bucket/run1") == {"driver": "gcs", "bucket": "bucket",
                                                   "path": "run1/"}
    assert "--watch" in commands[3] and "--outer=diloco" in commands[3]
    assert "--final=" in commands[4]


def _lofi_local(store_dir, devices_per_worker: int, sync: str, *train_flags: str) -> list[str]:
    """launch.lofi_local with 2 workers of the test tiny LM, syncing every 2 steps."""
    return [sys.executable, "-m", "launch.lofi_local", "--num_workers=2",
            f"--devices_per_worker={devices_per_worker}", f"--store={store_dir}",
            f"--sync={sync}", "--", "--config=configs/tiny_lm.py:test",
            "--config.lofi.sync_every=2", *train_flags]


@pytest.mark.slow
def test_lofi_local_diloco_end_to_end_leaves_final_average(tmp_path):
    store_dir = tmp_path / "store"
    cmd = _lofi_local(store_dir, 2, "diloco", "--config.train.steps=4")
    out = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "round 1: averaged w0@2, w1@2" in out.stdout
    assert "[lofi] w0 4/4" in out.stdout and "w1 4/4" in out.stdout  # combined progress
    assert "data-parallel all-reduce" in out.stdout and "lofi worker 1: wrote" in out.stdout
    store = Store(str(store_dir))
    rounds = W.average_rounds(store)
    assert len(rounds) >= 3  # initial, step 2, final
    last = W.load_snapshot(store, W.average_prefix(rounds[-1]))
    assert last.manifest["outer"] == "diloco" and last.manifest["contributors"] == {"0": 4, "1": 4}
    assert all(e["momentum"] for e in last.leaves.values())
    final = store_dir / "runs" / "final"
    assert (final / "commits" / "params").exists() and (final / "config.json").exists()
    init = subprocess.run([sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py:test",
                           f"--workdir={tmp_path / 'ft'}", "--cpu_devices=2",
                           f"--config.init_from={final}",
                           "--config.train.steps=1"], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert init.returncode == 0, init.stderr[-3000:]


@pytest.mark.slow
def test_lofi_local_sigterm_stops_every_process_and_leaves_store_consistent(tmp_path):
    store_dir = tmp_path / "store"
    cmd = _lofi_local(store_dir, 1, "periodic", "--config.train.steps=100000",
                      "--config.train.eval_every=0")
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, pids = [], []
    for line in proc.stdout:  # until both workers have synced at least once
        lines.append(line)
        if "started" in line and "(pid" in line:
            pids.append(int(line.rsplit("pid ", 1)[1].rstrip(")\n")))
        if "round 2: averaged" in line or len(lines) > 5000:
            break
    proc.send_signal(signal.SIGTERM)
    drain = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    drain.start()
    assert proc.wait(timeout=600) == 128 + signal.SIGTERM, "".join(lines[-50:])
    drain.join(timeout=10)
    assert len(pids) == 3
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read()
    store = Store(str(store_dir))
    for r in W.average_rounds(store):
        W.read_params(store, W.load_snapshot(store, W.average_prefix(r)))
    for w, steps in S.worker_pushes(store).items():
        for step in steps:
            W.load_snapshot(store, S.worker_prefix(w, step))
    claims = {k.split("/")[1] for k in store.keys("average/") if k.endswith("/CLAIM")}
    committed = {str(r) for r in W.average_rounds(store)}
    assert claims <= committed  # the averager released any claim it held




def test_watching_averager_started_before_round_0_waits_for_the_job_quorum(tmp_path):
    """The averager may start before any worker: it must still honour config.lofi.min_workers
    recorded later with round 0, not publish a round from the first push alone."""
    from jaxscale.lofi.averager import publish_initial
    store_dir = str(tmp_path / "store")
    proc = subprocess.Popen([sys.executable, "-m", "launch.lofi_average", f"--store={store_dir}",
                             "--watch", "--interval_s=0.05"], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:  # its first poll of the still empty store is done
            seen.append(line)
            if line.startswith("watching "):
                break
        assert seen and seen[-1].startswith(f"watching {store_dir} "), "".join(seen)
        params = {"w": np.zeros(10, np.float32)}
        publish_initial(Store(store_dir), params, job={"allowed_workers": [0, 1],
                                                         "min_workers": 2, "max_staleness": 0})
        S.push(store_dir, 0, 5, {"w": np.ones(10, np.float32)}, 10)
        time.sleep(3)
        assert W.average_rounds(Store(store_dir)) == [0]  # one push < quorum of 2
        S.push(store_dir, 1, 5, {"w": np.full(10, 3.0, np.float32)}, 10)
        deadline = time.monotonic() + 60
        while W.average_rounds(Store(store_dir)) == [0] and time.monotonic() < deadline:
            time.sleep(0.2)
        np.testing.assert_allclose(latest_average(store_dir).params["w"], 2.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=600)  # its few lines fit in the pipe
    out = "".join(seen) + proc.stdout.read()  # through the buffer the loop above read into
    assert "round 1: averaged w0@5, w1@5" in out


def test_lofi_average_repair_index_is_refused_as_no_longer_needed(tmp_path):
    """Stores have no index any more (pushes are found by their COMMIT markers): the old flag
    is still accepted by the parser but stops with one paragraph saying so, touching nothing."""
    from jaxscale.lofi.averager import publish_initial
    store_dir = str(tmp_path / "store")
    store = Store(store_dir)
    publish_initial(store, {"w": np.zeros(10, np.float32)})
    S.push(store, 0, 5, {"w": np.ones(10, np.float32)}, 10)
    out = subprocess.run([sys.executable, "-m", "launch.lofi_average", f"--store={store_dir}",
                          "--repair_index"], env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--repair_index is no longer needed" in out.stderr and "commits/" in out.stderr
    assert "Traceback" not in out.stderr
    assert W.average_rounds(store) == [0]  # no round was run


def test_lofi_average_takes_diloco_from_the_job_and_rejects_bad_flags(tmp_path):
    """An averager started by hand for a `sync=diloco` job applies the outer optimizer
    without being told (`--outer=none` still overrides); impossible flags fail in one line."""
    from jaxscale.lofi.averager import publish_initial
    store_dir = str(tmp_path / "store")
    publish_initial(Store(store_dir), {"w": np.zeros(10, np.float32)},
                    job={"allowed_workers": [0], "min_workers": 1, "max_staleness": 0,
                         "sync": "diloco"})
    S.push(store_dir, 0, 5, {"w": np.ones(10, np.float32)}, 10)
    run = lambda *flags: subprocess.run(
        [sys.executable, "-m", "launch.lofi_average", f"--store={store_dir}", *flags],
        env=ENV, cwd=ROOT, capture_output=True, text=True)
    out = run()
    assert out.returncode == 0, out.stderr[-2000:]
    np.testing.assert_allclose(latest_average(store_dir).params["w"], 0.7 * (1 + 0.9 * 1),
                               rtol=1e-6)  # DiLoCo's Nesterov step, not the plain mean (1.0)
    bad = run("--min_workers=0")
    assert bad.returncode == 2 and "min_workers=0 (at least 1" in bad.stderr
    bad = run("--watch", "--final=" + str(tmp_path / "final"))
    assert bad.returncode != 0 and "--final runs one last round" in bad.stderr


def test_push_every_counts_steps_or_minutes():
    import ml_collections

    from jaxscale.lofi.worker import LofiWorker
    by_steps = LofiWorker(ml_collections.ConfigDict({"push_every": "100", "sync": "end"}),
                          total_steps=1000, batch_size=8, last_push_time=0.0)
    assert [s for s in range(1, 301) if by_steps.push_due(s, now=1e9)] == [100, 200, 300]
    by_time = LofiWorker(ml_collections.ConfigDict({"push_every": "30m", "sync": "end"}),
                         total_steps=1000, batch_size=8, last_push_time=50.0)
    assert not by_time.push_due(100, now=50.0 + 1799.0)  # the step count plays no part
    assert by_time.push_due(7, now=50.0 + 1800.0)         # 30 minutes after the last push


@pytest.mark.slow
def test_worker_that_lost_its_workdir_continues_from_the_newest_average(tmp_path):
    """A worker restarted on a fresh VM (no local checkpoint) starts from the newest average
    when it is at least as new as its own last push, and says which round it synced to."""
    c = get_config("test")
    c.train.steps = 5
    c.lofi.update(enabled=True, store=str(tmp_path / "store"), push_every="2", num_workers=2)
    with pytest.raises(Preempted):
        train(c, str(tmp_path / "w0"), hooks=[SigtermAt(4)])
    store = Store(c.lofi.store)
    own = W.read_params(store, W.load_snapshot(store, "workers/0/4"))
    S.push(store, 1, 4, {k: v + 1.0 for k, v in own.items()}, 64)  # a second worker's push
    assert run_round(store, AveragerConfig()).used == {0: 4, 1: 4}
    average = latest_average(store)
    rec = _Recorder()
    train(c, str(tmp_path / "w0_new_vm"), hooks=[rec])
    assert list(rec.params) == [5]                       # continued after step 4
    assert W.load_snapshot(store, "workers/0/5").manifest["synced_round"] == 1
    first_step = {k: rec.params[5][k] - average.params[k] for k in own}
    assert all(np.abs(d).max() < 0.1 for d in first_step.values())  # one step from round 1,
    assert any(np.abs(average.params[k] - own[k]).max() > 0.4 for k in own)  # not its own push


@pytest.mark.slow
def test_worker_with_compression_pushes_int8_deltas_the_averager_reads_back(tmp_path):
    c = get_config("test")
    c.train.steps = 4
    c.lofi.update(enabled=True, store=str(tmp_path / "store"), push_every="2", compress=True)
    rec = _Recorder()
    train(c, str(tmp_path / "w0"), hooks=[rec])
    store = Store(c.lofi.store)
    push = W.load_snapshot(store, "workers/0/4")
    assert {e["encoding"] for e in push.leaves.values()} == {"q8delta"}
    p0 = W.read_params(store, W.load_snapshot(store, "average/0"))
    back = W.read_params(store, push)
    for k, trained in rec.params[4].items():  # within half an int8 step of each block's scale
        np.testing.assert_allclose(back[k], trained, atol=np.abs(trained - p0[k]).max() / 254
                                   + 1e-6)
    assert run_round(store, AveragerConfig()).published
    average = latest_average(store).params  # one worker, mean: its dequantized push
    for k in back:
        np.testing.assert_allclose(average[k], back[k], rtol=1e-6, atol=1e-6)
    text = "\n".join(accounting_lines(c.lofi.store))
    assert "compression: pushes stored" in text


@pytest.mark.slow
def test_periodic_worker_keeps_its_optimizer_state_across_syncs_by_default(tmp_path):
    """reset_optimizer_on_sync defaults to False (DiLoCo's finding): after loading an average
    the worker's Adam step count (and moments) carry on."""
    c = get_config("test")
    c.train.steps = 3
    store = str(tmp_path / "store")
    c.lofi.update(enabled=True, store=store, push_every="2", sync="periodic", sync_every=2,
                  sync_timeout_s=300.0)
    assert not c.lofi.reset_optimizer_on_sync
    rec = _train_with_watching_averager(c, str(tmp_path / "w0"))
    assert W.average_rounds(Store(store))[:2] == [0, 1]  # step 2 synced through round 1
    assert rec.counts[2] == {2} and rec.counts[3] == {3}    # not restarted at the sync
