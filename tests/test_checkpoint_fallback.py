"""A corrupt newest checkpoint: evaluate, generate, export and a resuming train fall back to the
newest step that restores, with one warning naming the broken one (never a traceback)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from child_env import child_env
from configs.tiny_lm import get_config
from jaxscale.train.loop import train
from jaxscale.weights.restore import BrokenCheckpointWarning
from jaxscale.weights.sources import open_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_env()


def _truncate_arrays(step_dir: str) -> None:
    """Cuts every array data file of a saved step to a quarter of its length (a torn copy)."""
    files = [os.path.join(root, name) for root, _, names in os.walk(step_dir)
             for name in names if "ocdbt.process_" in root and root.endswith(os.sep + "d")]
    assert files, f"no array files found under {step_dir}"
    for path in files:
        os.truncate(path, os.path.getsize(path) // 4)


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory):
    """A tiny run with checkpoints at steps 2 and 4, step 4's arrays truncated; also returns
    the parameters of step 2 (the one that must be used)."""
    workdir = str(tmp_path_factory.mktemp("run"))
    c = get_config("test")
    c.train.update(steps=2, log_every=1, eval_every=0)
    c.checkpoint.update(every=2, keep=3)
    at_2 = jax.device_get(train(c, workdir).params)
    c.train.steps = 4
    train(c, workdir)
    _truncate_arrays(os.path.join(workdir, "checkpoints", "4"))
    return workdir, at_2


def test_open_weights_falls_back_with_one_warning(broken_run):
    workdir, at_2 = broken_run
    with pytest.warns(BrokenCheckpointWarning, match=r"step 4.*step 2") as caught:
        weights = open_weights(workdir)
    assert len([w for w in caught if w.category is BrokenCheckpointWarning]) == 1
    assert weights.step == 2
    from jaxscale.weights.tree import flatten
    for k, v in flatten(at_2).items():
        np.testing.assert_array_equal(np.asarray(weights.leaves[k]), v)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("module, args", [
    ("launch.evaluate", ["--max_batches=1"]),
    ("launch.generate", ["--prompt=ab", "--steps=2"]),
    ("launch.train", ["--config=configs/tiny_lm.py:test", "--config.train.steps=5",
                      "--config.train.eval_every=0", "--config.checkpoint.every=2"]),
])
def test_cli_falls_back_past_a_truncated_checkpoint(broken_run, tmp_path, module, args):
    import shutil
    workdir = str(tmp_path / "w")
    shutil.copytree(broken_run[0], workdir)
    run = _cli(module, f"--workdir={workdir}", "--cpu_devices=8", *args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    warnings = [line for line in run.stderr.splitlines() if "BrokenCheckpointWarning" in line]
    assert len(warnings) == 1 and "step 4" in warnings[0] and "step 2" in warnings[0], run.stderr
    if module == "launch.train":
        steps = [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl"))]
        assert steps[-3:] == [3, 4, 5]  # resumed from step 2, not from the broken step 4
        ckpts = os.listdir(os.path.join(workdir, "checkpoints"))
        assert "4.broken" in ckpts and {"4", "5"} <= set(ckpts), ckpts  # kept, then re-saved


def test_a_resume_that_cannot_restore_says_why(broken_run, tmp_path):
    """No step restores: with every step truncated the error says so (not that the config
    differs); with the LoRA settings changed it names those (the files are fine)."""
    import shutil

    from jaxscale.weights.restore import CheckpointError
    workdir = str(tmp_path / "w")
    shutil.copytree(broken_run[0], workdir)
    c = get_config("test")
    c.train.update(steps=6, log_every=1, eval_every=0)
    c.checkpoint.update(every=2, keep=3)
    c.lora.rank = 4
    with pytest.raises(CheckpointError, match=r"step 4 .*another structure.*config\.lora"):
        train(c, workdir)
    _truncate_arrays(os.path.join(workdir, "checkpoints", "2"))
    c.lora.rank = 0
    with pytest.raises(CheckpointError, match=r"step 4 .*truncated or corrupt") as error:
        train(c, workdir)
    assert "config" not in str(error.value).split("corrupt")[0]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]  # kept


def test_a_step_without_its_state_directory_is_named(broken_run, tmp_path):
    import shutil

    from jaxscale.weights.restore import CheckpointError
    workdir = str(tmp_path / "w")
    shutil.copytree(broken_run[0], workdir)
    for step in ("2", "4"):
        shutil.rmtree(os.path.join(workdir, "checkpoints", step, "state"))
    with pytest.raises(CheckpointError, match=r"step 4 fails with .*/checkpoints/4/state holds "
                                              r"no checkpoint metadata"):
        open_weights(workdir)
