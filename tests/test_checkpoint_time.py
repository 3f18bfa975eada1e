"""Time-based saves (`checkpoint.every_minutes`, issue 44 item 2): the run saves after each
interval of training time, beside the step interval, with the time decided by an injected
clock (no wall-clock thresholds), and a resume from such a save continues exactly."""

import os
import shutil

import pytest

from child_env import child_env
from configs.tiny_lm import get_config
from jaxscale import config as config_lib
from jaxscale.errors import ConfigError
from jaxscale.observe.metrics import read_metrics
from jaxscale.train.hooks import CheckpointHook
from jaxscale.train.loop import prepare, train


class Minutes:
    """A clock that advances one minute each time it is read (once per step)."""

    def __init__(self) -> None:
        self.t = -60.0

    def __call__(self) -> float:
        self.t += 60.0
        return self.t


def _config(steps: int, every: int = 0, minutes: float = 0.0):
    c = get_config("test")
    c.train.update(steps=steps, log_every=1, eval_every=0)
    c.checkpoint.update(every=every, every_minutes=minutes, keep=10)
    return c


def _run_with_clock(config, workdir: str) -> None:
    trainer = prepare(config, workdir)
    [hook] = [h for h in trainer.hooks if isinstance(h, CheckpointHook)]
    hook.interval.clock = Minutes()
    trainer.run()


def _steps(workdir) -> list[int]:
    return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())


def test_saves_after_each_interval_of_training_time_and_at_the_end(tmp_path):
    # Step 1 starts the timer at minute 0; step s is read at minute s-1: 2.5 minutes have
    # passed at step 4 (minute 3), then again at step 7 (minute 6); the end saves step 8.
    _run_with_clock(_config(8, minutes=2.5), str(tmp_path))
    assert _steps(tmp_path) == [4, 7, 8]


def test_step_and_time_intervals_combine_and_a_step_save_restarts_the_timer(tmp_path):
    # every=4 saves 4 (minute 3) and 8 (minute 7); the timer saves 7 (minute 6, 3 minutes
    # after 4) and, restarted by step 8's save, 11 (minute 10) but not 10 (minute 9).
    _run_with_clock(_config(11, every=4, minutes=2.5), str(tmp_path))
    assert _steps(tmp_path) == [4, 7, 8, 11]


def test_resume_from_a_time_based_save_matches_an_uninterrupted_run(tmp_path):
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    train(_config(6), whole)
    _run_with_clock(_config(6, minutes=1.5), cut)  # minutes 2, 4, 5: steps 3, 5 and the end
    assert _steps(cut) == [3, 5, 6]
    for step in ("5", "6"):  # as if killed after step 3's save
        shutil.rmtree(os.path.join(cut, "checkpoints", step))
    train(_config(6), cut)
    assert [r["step"] for r in read_metrics(cut)] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in read_metrics(cut)] == [r["loss"] for r in read_metrics(whole)]


@pytest.mark.parametrize("minutes", [-1.0, float("inf"), float("nan")])
def test_a_bad_interval_is_one_paragraph(minutes):
    c = _config(2, minutes=minutes)
    with pytest.raises(ConfigError, match="checkpoint.every_minutes=") as e:
        config_lib.validate(c)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_two_processes_with_skewed_clocks_save_at_the_same_steps(tmp_path):
    """2 processes x 4 devices whose clocks run at 1 and 5 minutes per step: every time-based
    save, persistent and local, happens at the steps process 0's clock decides, on both
    processes (decided collectively: process 1 alone would save at every step, and a
    persistent save that one host starts alone would hang the collective write)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    local = tmp_path / "local-{process}"
    run = subprocess.run(
        [sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
         "--devices_per_process=4", "--module=tests.skewed_clocks", "--",
         "--config=configs/tiny_lm.py:test", "--config.train.steps=8",
         "--config.train.eval_every=0", "--config.checkpoint.every=0",
         "--config.checkpoint.every_minutes=2.5", "--config.checkpoint.keep=10",
         f"--config.checkpoint.local_dir={local}", "--config.checkpoint.local_every=0",
         "--config.checkpoint.local_every_minutes=1.5", "--config.checkpoint.local_keep=10",
         f"--workdir={tmp_path / 'run'}"],
        cwd=root, env=child_env(),
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert _steps(tmp_path / "run") == [4, 7, 8]  # as on one process (the test above)
    for p in (0, 1):  # process 0's minute 2, 4, 6: steps 3, 5, 7 (1.5 minutes after each)
        tier = tmp_path / f"local-{p}"
        assert sorted(int(n) for n in os.listdir(tier) if n.isdigit()) == [3, 5, 7], p
