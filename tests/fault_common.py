"""Launching the 2-process fault runs (`tests/fault_worker.py`, or `launch.train` for a rerun)."""

import json
import os
import subprocess
import sys

from child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8  # conftest.TINY_STEPS: the 2 x 4 fault runs share one compile
TRAIN = ["--config=configs/tiny_lm.py:test", f"--config.train.steps={STEPS}",
         "--config.train.log_every=1", "--config.train.eval_every=0",
         "--config.checkpoint.every=2"]


def losses_by_step(workdir) -> dict[int, float]:
    """A run's `metrics.jsonl` losses by step."""
    lines = open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()
    return {row["step"]: row["loss"] for row in map(json.loads, lines)}


def launch_two(args: list[str], module: str = "tests.fault_worker", traceback: bool = False
               ) -> tuple[subprocess.CompletedProcess, str]:
    """Runs `module` on 2 processes x 4 CPU devices with `args`; returns the run and its text.
    The launcher's grace period is 300 s, so a process it had to stop would be named in its
    "stopped ... later" line: asserted absent, with any traceback (unless `traceback`: the
    fault is a plain error, which prints one)."""
    run = subprocess.run(
        [sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
         "--devices_per_process=4", "--grace_s=300", f"--module={module}", "--", *args],
        cwd=ROOT, env=child_env(),
        capture_output=True, text=True, timeout=600)
    text = run.stdout + run.stderr
    assert " later" not in run.stderr, text[-3000:]  # none stopped
    assert traceback or "Traceback" not in text, text[-3000:]
    return run, text
