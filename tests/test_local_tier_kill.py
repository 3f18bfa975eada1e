"""Proof under kill -9 (issue 44 item 5): a two-process run (2 x 4 simulated CPU devices) with
a local tier every step and persistent saves every 4 steps is killed with SIGKILL between
them. Restarted, it resumes from the newest local step; with one host's local tier wiped (a
replaced host), from the newest step of the other, whose copy of the replicated state it gets
over the run's collectives (with both wiped, from the persistent step: two processes whose
tiers hold no step, in test_preemption's resume); on one process (an
elastic restart, issue 44 item 3), from the persistent step too (each local tier holds only
its process's shards), at the data position the 2 processes saved; on an S3 workdir with the
local tiers on disk, the same; and each resumed run's losses equal an uninterrupted run's."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8  # conftest.TINY_STEPS: the uninterrupted run's
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


def _env() -> dict[str, str]:
    """The test's environment at call time (an S3 fixture has set the AWS_* variables)."""
    return child_env()


def _kill_when(cmd: list[str], ready) -> None:
    """Runs `cmd` in its own process group and SIGKILLs the whole group (launcher and both
    training processes) once `ready()` holds."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if ready():
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _run(workdir: str, local) -> list[str]:
    return [*MULTIHOST, *TRAIN, f"--workdir={workdir}",
            f"--config.checkpoint.local_dir={local / 'local-{process}'}"]


def _kill_between_saves(workdir: str, local, persistent_steps) -> tuple[list[int], list[list[int]]]:
    """Starts the 2-process run and SIGKILLs it once both local tiers hold step 5, 6 or 7 and
    the persistent save of step 4 is committed (on a bucket it may commit after step 5's local
    save): between the persistent saves of 4 and 8. (persistent steps, each tier's steps)."""
    _kill_when(_run(workdir, local),
               lambda: all({5, 6, 7} & set(_steps(local / f"local-{p}")) for p in (0, 1))
               and bool(persistent_steps()))
    persistent = persistent_steps()
    tiers = [_steps(local / f"local-{p}") for p in (0, 1)]
    newest_local = max(tiers[0] + tiers[1])
    assert persistent and persistent[-1] < newest_local < STEPS, (persistent, tiers)
    return persistent, tiers


def _resume(workdir: str, local, processes: int = 2) -> subprocess.CompletedProcess:
    """The killed command again, but with no saves of its own in its steps (the later flags
    win; the local tier's first would be at step 100): what it restores, and its losses, are
    the point."""
    cmd = [*_run(workdir, local), "--config.checkpoint.every=0",
           "--config.checkpoint.local_every=100"]
    if processes == 1:
        cmd = [sys.executable, "-m", "launch.train", *cmd[len(MULTIHOST):], "--cpu_devices=8"]
    run = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return run


def _assert_losses(got: list[float], want: list[float], name: str) -> None:
    assert len(got) == STEPS, name
    for step, (a, b) in enumerate(zip(want, got), 1):
        assert b == pytest.approx(a, rel=1e-5), (name, step)


@pytest.mark.slow
def test_sigkill_between_local_and_persistent_saves_then_restart_from_each_tier(tmp_path,
                                                                               tiny_losses):
    killed = tmp_path / "killed"
    persistent, tiers = _kill_between_saves(str(killed / "run"), killed,
                                            lambda: _steps(killed / "run" / "checkpoints"))
    for name in ("one_wiped", "one_process"):
        shutil.copytree(killed, tmp_path / name)
        # The copies are the same run under another path, whose tiers' owner records name the
        # original workdir (train.local_dir): deleted, as the refusal tells a renamed run to.
        for record in (tmp_path / name).glob("local-*/.jaxscale-tier-owner.json"):
            record.unlink()
    shutil.rmtree(tmp_path / "one_wiped" / "local-1")

    # The data position of the persistent step: global batches, whatever the hosts (orbax
    # JsonSave's file), and how many processes saved it.
    saved = killed / "run" / "checkpoints" / str(persistent[-1]) / "data" / "metadata"
    assert json.load(open(saved)) == {"next_index": persistent[-1], "jaxscale_processes": 2}

    newest = max(tiers[0] + tiers[1])
    tried = ", ".join(str(s) for s in reversed(tiers[0]) if s >= persistent[-1])
    cases = {  # the replaced host gets its shards from its peer (the state is replicated
               # along `data`, which spans both processes)
        "killed": f"[p0] jaxscale: resumed from step {newest} of the local tier "
                  f"{killed / 'local-0'}",
        "one_wiped": f"[p0] jaxscale: resumed from step {max(tiers[0])} of the local tier "
                     f"{tmp_path / 'one_wiped' / 'local-0'} (process 1 got its shards from "
                     "its peers' local tiers)",
        "one_process": "jaxscale: resumed from "
                       f"{tmp_path / 'one_process' / 'run' / 'checkpoints'}/{persistent[-1]} "
                       f"(persistent tier; the local tier could not restore step {tried} on "
                       "every process"}
    for name, line in cases.items():
        run = _resume(str(tmp_path / name / "run"), tmp_path / name,
                      processes=1 if name == "one_process" else 2)
        assert line in run.stdout, (name, run.stdout[-3000:])
        _assert_losses(_losses(tmp_path / name / "run"), tiny_losses, name)


# Exhaustive (~40 s): its halves run in make test, the kill with a wiped tier restored from a
# peer above, and an S3 workdir with local tiers on disk in test_local_tier.py's
# test_s3_workdir_with_the_local_tier_on_disk_resumes_from_the_local_step.
@pytest.mark.exhaustive
@pytest.mark.xdist_group("seaweedfs")
def test_sigkill_on_an_s3_workdir_with_local_tiers_on_disk(seaweedfs, tmp_path, tiny_losses):
    """The same on an S3 workdir (SeaweedFS): the persistent tier, config and metrics in the
    bucket, the local tiers on disk; one tier wiped after the kill (a replaced host)."""
    from jaxscale.observe.metrics import read_metrics
    from jaxscale.weights.restore import saved_steps

    _, bucket = seaweedfs
    workdir = f"s3://{bucket}/killed"
    _, tiers = _kill_between_saves(
        workdir, tmp_path, lambda: sorted(saved_steps(f"{workdir}/checkpoints")))
    shutil.rmtree(tmp_path / "local-1")
    run = _resume(workdir, tmp_path)
    line = (f"[p0] jaxscale: resumed from step {max(tiers[0])} of the local tier "
            f"{tmp_path / 'local-0'} (process 1 got its shards from its peers' local tiers)")
    assert line in run.stdout, run.stdout[-3000:]
    _assert_losses([m["loss"] for m in read_metrics(workdir)], tiny_losses, "s3")
