"""A run that is refused, or has nothing to train, leaves its workdir as it was: a mesh or data
error before the first step writes no config.json, and a resume whose `train.steps` is below
the step it resumes at is refused by name without rewriting config.json (at that step, one
line says there is nothing to train)."""

import os

import pytest

from configs.tiny_lm import get_config
from jaxscale.errors import JaxscaleError
from jaxscale.train.loop import train


def _config(steps: int):
    c = get_config("test")
    c.train.update(steps=steps, log_every=1, eval_every=0)
    c.checkpoint.every = 2
    return c


def test_a_refused_fresh_run_writes_nothing(tmp_path):
    bad_mesh = _config(2)
    bad_mesh.mesh.fsdp = 3  # 8 devices
    with pytest.raises(JaxscaleError, match="not divisible"):
        train(bad_mesh, str(tmp_path / "mesh"))
    bad_data = _config(2)
    bad_data.data.sources = f"jsonl={tmp_path}/none/*.jsonl"
    with pytest.raises(JaxscaleError, match="matches no file"):
        train(bad_data, str(tmp_path / "data"))
    assert not os.path.exists(tmp_path / "mesh") and not os.path.exists(tmp_path / "data")


def test_steps_at_or_below_the_resumed_step(tmp_path, capsys):
    workdir = str(tmp_path / "run")
    train(_config(2), workdir)
    config_json = os.path.join(workdir, "config.json")
    before = open(config_json).read()
    with pytest.raises(JaxscaleError, match=r"train.steps=1, but .* resumed at step 2.*"
                                            r"--config.train.steps=3"):
        train(_config(1), workdir)
    assert open(config_json).read() == before
    assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]
    capsys.readouterr()
    again = _config(2)
    again.optim.lr = 0.5  # no step runs with it: config.json keeps what the steps ran with
    train(again, workdir)  # the same command again: nothing to train, said once
    assert capsys.readouterr().out.count("is already at step 2 = train.steps; nothing") == 1
    assert open(config_json).read() == before
