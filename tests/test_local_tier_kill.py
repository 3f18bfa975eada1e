"""Proof under kill -9 (issue 44 item 5): a two-process run (2 x 4 simulated CPU devices) with
a local tier every step and persistent saves every 4 steps is killed with SIGKILL between
them. Restarted, it resumes from the newest step complete on both processes' local tiers; with
one host's local tier wiped (a replaced host), or both, from the persistent step; and each
resumed run's losses equal an uninterrupted run's."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": ROOT}
STEPS = 12
TRAIN = ["--config=configs/tiny_lm.py:test", f"--config.train.steps={STEPS}",
         "--config.train.log_every=1", "--config.train.eval_every=0",
         "--config.checkpoint.every=4", "--config.checkpoint.local_every=1",
         "--config.checkpoint.local_keep=2"]
MULTIHOST = [sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
             "--devices_per_process=4", "--"]


def _losses(workdir) -> list[float]:
    return [json.loads(line)["loss"] for line in
            open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()]


def _steps(path) -> list[int]:
    return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if os.path.isdir(path) else []


def _kill_when(cmd: list[str], ready) -> None:
    """Runs `cmd` in its own process group and SIGKILLs the whole group (launcher and both
    training processes) once `ready()` holds."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _resume(tmp, name: str) -> subprocess.CompletedProcess:
    run = subprocess.run([*MULTIHOST, *TRAIN, f"--workdir={tmp / name / 'run'}",
                          f"--config.checkpoint.local_dir={tmp / name / 'local-{process}'}"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return run


@pytest.mark.slow
def test_sigkill_between_local_and_persistent_saves_then_restart_from_each_tier(tmp_path):
    whole = subprocess.run([sys.executable, "-m", "launch.train", *TRAIN[:4], "--cpu_devices=8",
                            f"--workdir={tmp_path / 'whole'}"], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=900)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = tmp_path / "killed"
    # Once both local tiers hold step 5 or 6: after the persistent save of step 4, before 8.
    _kill_when([*MULTIHOST, *TRAIN, f"--workdir={killed / 'run'}",
                f"--config.checkpoint.local_dir={killed / 'local-{process}'}"],
               lambda: all({5, 6} & set(_steps(killed / f"local-{p}")) for p in (0, 1)))
    persistent = _steps(killed / "run" / "checkpoints")
    local = [_steps(killed / f"local-{p}") for p in (0, 1)]
    newest_local = max(set(local[0]) & set(local[1]))
    assert persistent and newest_local > persistent[-1] and newest_local < STEPS, (
        persistent, local)  # killed between a local and the next persistent save
    for name in ("one_wiped", "both_wiped"):
        shutil.copytree(killed, tmp_path / name)
    shutil.rmtree(tmp_path / "one_wiped" / "local-1")
    for p in (0, 1):
        shutil.rmtree(tmp_path / "both_wiped" / f"local-{p}")

    cases = {"killed": f"resumed from step {newest_local} of the local tier "
                       f"{killed / 'local-0'}",
             "one_wiped": f"resumed from {tmp_path / 'one_wiped' / 'run' / 'checkpoints'}/"
                          f"{persistent[-1]} (persistent tier; the local tier has no step "
                          "complete on every process)",
             "both_wiped": f"resumed from {tmp_path / 'both_wiped' / 'run' / 'checkpoints'}/"
                           f"{persistent[-1]} (persistent tier"}
    want = _losses(tmp_path / "whole")
    for name, line in cases.items():
        run = _resume(tmp_path, name)
        assert f"[p0] jaxscale: {line}" in run.stdout, (name, run.stdout[-3000:])
        got = _losses(tmp_path / name / "run")
        assert len(got) == STEPS, name
        for step, (a, b) in enumerate(zip(want, got), 1):  # 2x4 devices equal 1x8 (test_multihost)
            assert b == pytest.approx(a, rel=1e-5), (name, step)
