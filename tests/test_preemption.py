"""Pre-emption (issue 21, item 4): on SIGTERM every process finishes its step, saves at the same
step on all hosts and exits with status 75; the same command resumes, and the resumed loss
series equals an uninterrupted run's. Two processes with a local tier that has no step yet
(its first save would be at step 100) agree that it offers none and resume from the
persistent step (as after both hosts' tiers are lost: test_local_tier_kill)."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from child_env import child_env
from configs.tiny_lm import get_config
from hooks_common import SigtermAt
from jaxscale.observe.metrics import read_metrics
from jaxscale.runtime.preemption import INTERRUPTED_EXIT, PREEMPTED_EXIT, Preempted, PreemptionWatch
from jaxscale.train.loop import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_watch_turns_sigterm_into_a_flag_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatch() as watch:
        assert not watch.reached(1)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not watch.reached(2) and time.monotonic() < deadline:
            time.sleep(0.01)  # Python runs the handler between bytecodes of the main thread
        assert watch.reached(2)
    assert signal.getsignal(signal.SIGTERM) is before


def test_first_ctrl_c_is_a_flag_and_the_second_interrupts():
    before = signal.getsignal(signal.SIGINT)
    with PreemptionWatch() as watch:
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 60
        while not watch.reached(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.reached(1) and watch.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)  # the second Ctrl-C ends this at once
    assert signal.getsignal(signal.SIGINT) is before
    error = Preempted(3, True, signal.SIGINT)
    assert error.exit_code == INTERRUPTED_EXIT and str(error).startswith(
        "Stopped by Ctrl-C (SIGINT): stopped after step 3 and saved a checkpoint")


def _config(steps: int):
    c = get_config("test")
    c.train.update(steps=steps, log_every=1, eval_every=0)
    c.checkpoint.every = 0  # no periodic saves: the pre-emption save alone must suffice
    return c


@pytest.mark.slow
def test_sigterm_saves_that_step_and_the_rerun_matches_an_uninterrupted_run(tmp_path):
    train(_config(5), str(tmp_path / "whole"))
    with pytest.raises(Preempted) as stopped:
        train(_config(5), str(tmp_path / "cut"), hooks=[SigtermAt(2)])
    assert stopped.value.step == 2 and stopped.value.saved
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["2"]
    assert [r["step"] for r in read_metrics(str(tmp_path / "cut"))] == [1, 2]
    train(_config(5), str(tmp_path / "cut"))  # the relaunched command resumes from step 2
    whole, cut = read_metrics(str(tmp_path / "whole")), read_metrics(str(tmp_path / "cut"))
    assert [r["step"] for r in cut] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in cut] == [r["loss"] for r in whole]


STEPS = 8  # conftest.TINY_STEPS: the uninterrupted run is its `tiny_losses`, and the 2 x 4
# runs share one compile of the train step with the other multi-process tests
TRAIN = ["--config=configs/tiny_lm.py:test", f"--config.train.steps={STEPS}",
         "--config.train.log_every=1", "--config.train.eval_every=0"]
MULTIHOST = [sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
             "--devices_per_process=4", "--"]
ENV = child_env()


def _sigterm_after(cmd: list[str], metrics: str, lines: int,
                   signum: int = signal.SIGTERM) -> tuple[int, str]:
    """Runs `cmd`, sends it `signum` once `metrics` has `lines` lines; (status, output)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= lines:
            proc.send_signal(signum)
            break
        time.sleep(0.02)
    proc.wait(timeout=600)
    reader.join(timeout=60)
    return proc.returncode, "".join(out)


@pytest.mark.slow
def test_two_processes_save_at_the_same_step_and_resume_exactly(tmp_path, tiny_losses):
    workdir = tmp_path / "multi"
    flags = [*TRAIN, f"--workdir={workdir}", "--config.checkpoint.local_every=100",
             f"--config.checkpoint.local_dir={tmp_path / 'local-{process}'}"]
    cmd = [*MULTIHOST, *flags]
    # Steps slowed (tests/slow_steps.py) so that JAX's sync service agrees on a step before
    # the last one; the resume below is the plain command.
    slowed = [*MULTIHOST[:-1], "--module=tests.slow_steps", "--", *flags]
    status, out = _sigterm_after(slowed, str(workdir / "metrics.jsonl"), lines=2)
    assert status == PREEMPTED_EXIT, out[-3000:]
    # JAX's sync service picked one step for both processes; orbax saved it once, whole.
    stops = {line.split("] ")[0] + "]": line.split("stopped after step ")[1].split()[0]
             for line in out.splitlines() if "stopped after step" in line}
    assert set(stops) == {"[p0]", "[p1]"} and len(set(stops.values())) == 1, out[-3000:]
    step = int(stops["[p0]"])
    assert os.listdir(workdir / "checkpoints") == [str(step)] and 2 <= step < STEPS
    again = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert (f"[p0] jaxscale: resumed from {workdir / 'checkpoints'}/{step} (persistent tier; "
            "the local tier has no step complete on every process)") in again.stdout
    two = read_metrics(str(workdir))
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    # 2x4 devices equal 1x8 (conftest's uninterrupted run) up to reduction order (test_multihost)
    for step, (a, b) in enumerate(zip(tiny_losses, two), 1):
        assert b["loss"] == pytest.approx(a, rel=1e-5), step


@pytest.mark.slow
def test_ctrl_c_saves_that_step_and_exits_130_in_one_line(tmp_path):
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxscale", "train", *TRAIN[:1], "--config.train.steps=400",
           *TRAIN[2:], f"--workdir={workdir}", "--config.checkpoint.every=0"]
    status, out = _sigterm_after(cmd, str(workdir / "metrics.jsonl"), 2, signal.SIGINT)
    assert status == INTERRUPTED_EXIT, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    step = int(out.split("Stopped by Ctrl-C (SIGINT): stopped after step ")[1].split()[0])
    assert os.listdir(workdir / "checkpoints") == [str(step)] and 2 <= step < 400
