"""Lo-Fi workers: 1 worker == plain training, restarts after a killed push, the launchers."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from configs.tiny_lm import get_config
from jaxscale.lofi import store as S
from jaxscale.lofi.averager import AveragerConfig, latest_average, run_round
from jaxscale.train.loop import train
from jaxscale.train.state import flatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": ROOT}


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_one_worker_lofi_equals_plain_training(tmp_path):
    c = get_config("test")
    c.train.steps = 4
    plain = train(c, str(tmp_path / "plain"))
    c.lofi.update(enabled=True, store=str(tmp_path / "store"), push_every="2")
    lofi = train(c, str(tmp_path / "lofi"))
    np.testing.assert_array_equal(_losses(tmp_path / "plain"), _losses(tmp_path / "lofi"))
    assert S.worker_checkpoints(S.Store(c.lofi.store)) == {0: [2, 4]}
    run_round(c.lofi.store, AveragerConfig())
    average = latest_average(c.lofi.store).params
    for leaf, value in flatten(plain.params).items():
        np.testing.assert_allclose(average[leaf], np.asarray(value), rtol=1e-6, atol=1e-7)


def test_restarted_worker_continues_from_its_last_complete_push(tmp_path):
    c = get_config("test")
    c.train.steps = 4
    c.lofi.update(enabled=True, store=str(tmp_path / "store"), push_every="2")
    train(c, str(tmp_path / "w0"))
    store = S.Store(c.lofi.store)
    store.kv.write("workers/0/4/COMMIT", None).result()  # the push of step 4 was cut off
    c.train.steps = 6
    os.remove(tmp_path / "w0" / "metrics.jsonl")
    train(c, str(tmp_path / "w0"))
    steps = [json.loads(l)["step"] for l in open(tmp_path / "w0" / "metrics.jsonl")]
    assert steps == [3, 4, 5, 6]  # resumed after step 2, the last complete push
    assert S.worker_checkpoints(store)[0] == [2, 4, 6]


KILL_MID_PUSH = """
import os, signal, sys, numpy as np
from jaxscale.lofi import store as S
real = S._write_leaf
calls = []
def dying(*a, **k):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
S._write_leaf = dying
S.push(sys.argv[1], 3, 7, {"a": np.ones(10, np.float32), "b": np.ones(5, np.float32)}, 1)
"""


def test_worker_killed_mid_push_leaves_no_visible_checkpoint(tmp_path):
    store_dir = str(tmp_path / "store")
    S.push(store_dir, 3, 5, {"a": np.zeros(10, np.float32), "b": np.zeros(5, np.float32)}, 1)
    proc = subprocess.run([sys.executable, "-c", KILL_MID_PUSH, store_dir], env=ENV, cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL
    store = S.Store(store_dir)
    assert S.worker_checkpoints(store) == {3: [5]}  # step 7 is partial: invisible
    assert store.read("workers/3/7/COMMIT") is None


def test_lofi_vm_dry_run_prints_one_worker_per_vm():
    out = subprocess.run([sys.executable, "-m", "launch.lofi_local", "--num_workers=3",
                          "--store=gs://bucket/run1", "--dry_run", "--",
                          "--config=configs/tiny_lm.py"], env=ENV, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3
    for i, line in enumerate(lines):
        assert f"--config.lofi.worker_id={i}" in line
        assert "--config.lofi.store=gs://bucket/run1" in line and "launch.train" in line


@pytest.mark.slow
def test_lofi_local_runs_workers_and_leaves_final_average(tmp_path):
    store_dir = tmp_path / "store"
    cmd = [sys.executable, "-m", "launch.lofi_local", "--num_workers=2",
           "--devices_per_worker=2", f"--store={store_dir}", "--sync=periodic", "--",
           "--config=configs/tiny_lm.py:test", "--config.train.steps=4",
           "--config.lofi.sync_every=2"]
    out = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "round 1: averaged w0@2, w1@2" in out.stdout
    assert "data-parallel all-reduce" in out.stdout
    final = store_dir / "runs" / "final" / "params" / "COMMIT"
    assert final.exists()
    init = subprocess.run([sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py:test",
                           f"--workdir={tmp_path / 'ft'}", "--cpu_devices=2",
                           f"--config.init_from={store_dir / 'runs' / 'final'}",
                           "--config.train.steps=1"], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert init.returncode == 0, init.stderr[-3000:]
