"""Checkpoints: bit-exact resume after SIGKILL, re-sharding onto another mesh, NaN safety."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from child_env import child_env
from configs.tiny_lm import get_config
from jaxscale.errors import short_error
from jaxscale.train.checkpoint import Checkpointer
from jaxscale.train.hooks import NonFiniteError
from jaxscale.train.loop import Trainer, train
from jaxscale.train.resume import attach_checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_env()


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _config(steps, every):
    c = get_config("test")
    c.train.update(steps=steps, log_every=1, eval_every=0)
    c.checkpoint.every = every
    return c


def test_restore_on_another_mesh_continues_with_the_same_loss(tmp_path):
    c = _config(4, 4)
    c.mesh.update(data=8)
    train(c, str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    c.train.steps = 6
    train(c, str(tmp_path / "a"))                       # continue on data=8
    c.mesh.update(data=1, fsdp=4, tensor=2)
    train(c, str(tmp_path / "b"))                       # continue on fsdp=4, tensor=2
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([m["loss"] for m in b], [m["loss"] for m in a], rtol=1e-5)


def test_nonfinite_stops_naming_the_step_and_keeps_the_good_checkpoint(tmp_path):
    c = _config(6, 2)
    trainer = Trainer.build(c, str(tmp_path))
    attach_checkpoints(trainer)
    bad = jax.tree.map(lambda x: x * np.nan, trainer.state.params)
    trainer.state = trainer.state.replace(params=bad)
    with pytest.raises(NonFiniteError, match="at step 1"):
        trainer.run()
    checkpointer = Checkpointer(str(tmp_path), 2, 3)
    assert checkpointer.latest_step() is None  # nothing saved from a non-finite state


def test_skip_nonfinite_counts_and_keeps_training(tmp_path):
    c = _config(2, 0)
    c.train.skip_nonfinite = True
    trainer = Trainer.build(c, str(tmp_path))
    good = trainer.state.params
    it = trainer.batches.iterator()
    poisoned = trainer.state.replace(params=jax.tree.map(lambda x: x * np.nan, good))
    state, m = trainer.train_fn(poisoned, trainer.to_global(next(it)))
    assert int(m["nonfinite_steps"]) == 1


def test_interrupted_save_is_never_picked_up_but_removed_at_the_next_start_and_no_pickle(
        tmp_path, capfd):
    train(_config(2, 2), str(tmp_path))
    ckpts = tmp_path / "checkpoints"
    (ckpts / "7.orbax-checkpoint-tmp-1234" / "state").mkdir(parents=True)  # killed before its
    (ckpts / "7.orbax-checkpoint-tmp-1234" / "state" / "x").write_bytes(b"0" * 64)  # rename
    capfd.readouterr()
    assert Checkpointer(str(tmp_path), 2, 3).latest_step() == 2
    assert sorted(os.listdir(ckpts)) == ["2"]  # nothing else reclaims its space
    assert "removed 1 unfinished checkpoint step(s)" in capfd.readouterr().err
    for root, _, files in os.walk(ckpts):
        for name in files:
            assert not name.endswith((".pkl", ".pickle"))
            with open(os.path.join(root, name), "rb") as f:
                assert not f.read(2).startswith(b"\x80\x04"), name  # pickle protocol 4 magic


def test_short_names_the_read_error_that_orbax_wraps():
    """orbax formats a bound method ("See full TensorStore details: <bound method ...>")
    where the read's own error belongs; that error (its `__context__`) is shown instead."""
    read = 'NOT_FOUND: Error reading "params.w/0": CURL error Could not connect to server'
    try:
        try:
            raise ValueError(read)
        except ValueError:
            raise ValueError("Encountered error while reading array index 0. See full "
                             "TensorStore details: <bound method Future.exception of "
                             "<Future at 0x7f finished>>") from None
    except ValueError as e:
        assert e.__context__ is not None and e.__context__.args == (read,)
        assert short_error(e) == f"Encountered error while reading array index 0. {read}"


@pytest.mark.slow
def test_sigkill_mid_training_then_resume_matches_uninterrupted(tmp_path, tiny_metrics):
    """Killed between two saves (once step 3's checkpoint is committed and 4 of the 8 steps
    are logged), resumed: the losses of conftest's uninterrupted run (the same command, but
    for evaluations, which leave the losses alone), bit for bit."""
    steps = len(tiny_metrics)
    args = [sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py:test",
            "--cpu_devices=8", f"--config.train.steps={steps}", "--config.train.log_every=1",
            "--config.train.eval_every=0", "--config.checkpoint.every=3"]
    workdir = tmp_path / "killed"
    proc = subprocess.Popen(args + [f"--workdir={workdir}"], env=ENV, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        if (workdir / "checkpoints" / "3").is_dir() and len(_metrics(workdir)) >= 4:
            break  # orbax renames the step's directory into place when the save commits
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(_metrics(workdir)) < steps  # really interrupted
    resumed = subprocess.run(args + [f"--workdir={workdir}"], env=ENV, cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    got = _metrics(workdir)
    assert [m["step"] for m in got] == list(range(1, steps + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in tiny_metrics]
