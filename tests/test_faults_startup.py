"""Pre-emption during start-up (issue 33, item 5): a SIGTERM while the train step compiles, or
while a checkpoint restores, used to end `train` with 143 (SIGTERM's default action), which the
relaunch loop of docs/observability.md reads as a crash. It must exit 75 at once with nothing to
save, leave the workdir as it was, and the same command must then resume."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from child_env import child_env
from jaxscale.runtime.preemption import INTERRUPTED_EXIT, PREEMPTED_EXIT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_env(JAX_PLATFORMS="cpu")
# Unrolled layers make the compile last a few seconds, so the signal lands inside it.
TRAIN = [sys.executable, "-m", "jaxscale", "train", "--config=tiny_lm:test",
         "--config.train.log_every=1", "--config.train.eval_every=0",
         "--config.model.num_layers=8", "--config.checkpoint.every=2"]


def _sigterm_when(cmd: list[str], ready, signum: int = signal.SIGTERM) -> tuple[int, str, float]:
    """Runs `cmd`, sends `signum` once `ready(output so far)` is true; (status, output, seconds
    from the signal to the exit)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    deadline, signalled_at = time.monotonic() + 600, None
    while proc.poll() is None and time.monotonic() < deadline:
        if ready("".join(out)):
            signalled_at = time.monotonic()
            proc.send_signal(signum)
            break
        time.sleep(0.01)
    proc.wait(timeout=600)
    reader.join(timeout=60)
    assert signalled_at is not None, "".join(out)[-3000:]
    return proc.returncode, "".join(out), time.monotonic() - signalled_at


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory) -> str:
    """A finished 2-step run (its checkpoint of step 2), which each test that restores copies:
    one compile of the 2-step run for the module."""
    workdir = str(tmp_path_factory.mktemp("faults_startup") / "run")
    first = subprocess.run([*TRAIN, "--config.train.steps=2", f"--workdir={workdir}"],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]
    return workdir


@pytest.mark.slow
def test_sigterm_while_compiling_or_restoring_exits_75_and_the_rerun_resumes(tmp_path,
                                                                            saved_at_2):
    workdir = str(shutil.copytree(saved_at_2, tmp_path / "run"))
    cmd = [*TRAIN, "--config.train.steps=4", f"--workdir={workdir}"]
    # The banner is printed after the restore, right before the step compiles.
    status, out, took = _sigterm_when(cmd, lambda out: "jaxscale: mesh " in out)
    assert status == PREEMPTED_EXIT, out[-3000:]
    assert "Pre-empted (SIGTERM) during start-up, before the first step" in out
    assert "compiled the train step" not in out and "Traceback" not in out, out[-3000:]
    assert took < 5, took  # at once, not after the compile
    assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]
    again = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "/checkpoints/2" in again.stdout
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]


@pytest.mark.slow
def test_sigterm_while_the_state_is_built_or_restored_exits_75(tmp_path, saved_at_2):
    workdir = str(shutil.copytree(saved_at_2, tmp_path / "run"))
    events = os.path.join(workdir, "events.jsonl")
    size = os.path.getsize(events)
    # A run appends its start to events.jsonl once the state is built, then restores it.
    status, out, _ = _sigterm_when([*TRAIN, "--config.train.steps=4", f"--workdir={workdir}"],
                                   lambda out: os.path.getsize(events) != size)
    assert status == PREEMPTED_EXIT, out[-3000:]
    assert "before the first step" in out and "Traceback" not in out, out[-3000:]
    assert "jaxscale: mesh " not in out, out[-3000:]  # stopped before the loop's banner
    assert os.listdir(os.path.join(workdir, "checkpoints")) == ["2"]


@pytest.mark.slow
def test_ctrl_c_while_compiling_exits_130_at_once_in_one_line(tmp_path):
    workdir = str(tmp_path / "run")
    status, out, took = _sigterm_when([*TRAIN, "--config.train.steps=4", f"--workdir={workdir}"],
                                      lambda out: "jaxscale: mesh " in out, signal.SIGINT)
    assert status == INTERRUPTED_EXIT, out[-3000:]
    assert "Stopped by Ctrl-C (SIGINT) during start-up, before the first step" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert took < 5, took  # at once, not after the compile
    assert not os.path.exists(os.path.join(workdir, "checkpoints", "1"))
