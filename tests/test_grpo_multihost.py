"""GRPO across real processes (jax.distributed, gloo CPU collectives): 2 processes x 2 simulated
devices run `train_grpo` exactly like 1 process x 4 devices (same global mesh data=4): the same
losses, gradient norms, KL, rewards and held-out rewards, step by step; the reward function
runs on process 0 only (its rewards are broadcast); only process 0 writes metrics; a checkpoint
taken between two updates of a rollout resumes on 2 processes to the uninterrupted run's
losses; and a reward function that fails on process 0 stops every process with one paragraph,
none left waiting.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTIHOST = [sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
             "--devices_per_process=2", "--"]
# The reward records which process called it, so the test can see that only process 0 did.
REWARD = '''import jax

def digits(prompts, completions, records):
    with open("calls.txt", "a") as f:
        f.write(f"{jax.process_index()}\\n")
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]

def broken(prompts, completions, records):
    raise KeyError("answer")
'''
# 4 prompts x 4 completions; steps 1-2 train on rollout 0 (the second with ratios off 1), step
# 3 on rollout 1, sampled with the weights two updates made; then the held-out prompts (4 of
# the 16) are decoded greedily and rewarded.
GRPO = ["--config=tiny_lm:test", "--config.data.sources=prompts=prompts.jsonl",
        "--config.data.batch_size=16", "--config.objective.name=grpo",
        "--config.objective.rewards=toy_reward:digits", "--config.objective.num_generations=4",
        "--config.objective.max_new_tokens=8", "--config.objective.beta=0.05",
        "--config.objective.updates_per_rollout=2", "--config.objective.epsilon=0.1",
        "--config.optim.lr=3e-2", "--config.optim.warmup_steps=0", "--config.train.steps=3",
        "--config.train.log_every=1", "--config.train.eval_every=3",
        "--config.data.eval_fraction=0.25"]
SAVE = "--config.checkpoint.every=1"  # the 2-process run's (the resume test reads step 1's)
COMPARED = ("loss", "grad_norm", "kl", "clip_fraction", "reward_mean", "reward_std",
            "reward/digits", "completion_length", "truncated_fraction", "eval_reward_mean",
            "eval_reward/digits", "eval_completion_length", "eval_truncated_fraction")


def _run(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    env = child_env(PYTHONPATH=f"{ROOT}{os.pathsep}{cwd}")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _metrics(workdir) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (workdir / "metrics.jsonl").open())}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The prompts and reward module, in a directory for each run (each with its own record
    of reward calls)."""
    root = tmp_path_factory.mktemp("grpo_mh")
    for name in ("single", "multi"):
        (root / name).mkdir()
        (root / name / "toy_reward.py").write_text(REWARD)
        (root / name / "prompts.jsonl").write_text("".join(
            json.dumps({"prompt": f"Q{i}: a number? A:", "id": i}) + "\n" for i in range(16)))
    return root


@pytest.fixture(scope="module")
def runs(files):
    """The same run on 1 process x 4 devices and on 2 processes x 2 devices."""
    root = files
    single = _run([sys.executable, "-m", "launch.train", *GRPO, "--workdir=run",
                   "--cpu_devices=4"], root / "single")
    assert single.returncode == 0, (single.stdout + single.stderr)[-3000:]
    multi = _run([*MULTIHOST, *GRPO, SAVE, "--workdir=run"], root / "multi")
    assert multi.returncode == 0, (multi.stdout + multi.stderr)[-3000:]
    return root, multi


@pytest.mark.slow
def test_two_processes_train_and_reward_as_one(runs):
    root, multi = runs
    one, two = _metrics(root / "single" / "run"), _metrics(root / "multi" / "run")
    assert sorted(one) == sorted(two) == [1, 2, 3]
    assert float(two[2]["clip_fraction"]) > 0 and abs(two[3]["loss"]) > 1e-6  # not trivial
    for step in (1, 2, 3):
        for key in COMPARED:
            if key in one[step] or key in two[step]:
                assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-7), (
                    step, key)
    assert "reward_mean" in two[3]  # rollout 1 was sampled, scored and rewarded on 2 processes
    assert "eval_reward_mean" in two[3] and "eval_reward_mean" not in two[2]
    # The reward function ran once per rollout and once for the held-out prompts, on process 0
    # only; process 0 alone logged.
    assert (root / "multi" / "calls.txt").read_text().split() == ["0", "0", "0"]
    assert [p.name for p in (root / "multi").rglob("metrics.jsonl")] == ["metrics.jsonl"]
    assert "[p0] jaxscale: mesh data=4 pipeline=1 fsdp=1 tensor=1 (4 cpu devices)" in multi.stdout
    assert "[p1] step" not in multi.stdout


@pytest.mark.exhaustive  # resume mid-rollout on one process: test_grpo.py; this adds 2 processes
def test_resume_on_two_processes_between_two_updates_is_exact(runs):
    """Step 1's checkpoint (written by 2 processes) holds rollout 0's batch for step 2."""
    root, _ = runs
    parts = root / "multi" / "parts"
    (parts / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "multi" / "run" / "checkpoints" / "1", parts / "checkpoints" / "1")
    out = _run([*MULTIHOST, *GRPO, SAVE, "--workdir=parts"], root / "multi")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    whole, resumed = _metrics(root / "multi" / "run"), _metrics(parts)
    assert sorted(resumed) == [2, 3]
    for step in (2, 3):
        for key in ("loss", "grad_norm", "kl"):
            assert resumed[step][key] == pytest.approx(whole[step][key], rel=1e-6), (step, key)
    assert resumed[3]["reward_mean"] == whole[3]["reward_mean"]


@pytest.mark.slow
def test_reward_failing_on_process_0_stops_every_process_with_one_paragraph(files):
    root = files  # not the runs: this test needs only their files (and may run on another worker)
    out = _run([*MULTIHOST, *GRPO, "--config.objective.rewards=toy_reward:broken",
                "--workdir=broken"], root / "multi")
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]  # each said: a user error
    assert "Traceback" not in out.stdout + out.stderr, out.stdout[-3000:]
    for pid in (0, 1):
        errors = [line for line in out.stdout.splitlines()
                  if line.startswith(f"[p{pid}] jaxscale: error:")]
        assert len(errors) == 1, out.stdout[-3000:]
        assert "The reward function toy_reward:broken raised KeyError" in errors[0]
    assert "(which scores the rewards for all 2)" in out.stdout
    assert "stopped" not in out.stderr  # neither was left waiting for the launcher to stop it
