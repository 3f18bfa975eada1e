"""TPU pod launcher commands (pure builders and the --dry_run CLI) and the SLURM template."""

import os
import shlex
import subprocess
import sys

import pytest

from jaxscale.runtime.pod_commands import check_tpu_flags, remote_path, tpu_pod_commands

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tpu_pod_commands():
    flags = ["--config=configs/tiny_lm.py", "--workdir=a b"]
    cmds = tpu_pod_commands("pod", "us-central2-b", flags, project="proj", archive="/tmp/src.tgz")
    tar, scp, install, start = cmds
    assert tar[:3] == ["tar", "czf", "/tmp/src.tgz"] and "--exclude=.venv" in tar
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
    assert {"--recurse", "/tmp/src.tgz", "pod:src.tgz"} <= set(scp)
    for cmd in (scp, install, start):
        assert cmd[-3:] == ["--worker=all", "--zone=us-central2-b", "--project=proj"]
    assert install[4:6] == ["ssh", "pod"] and "pip install --quiet -e ." in install[7]
    script = start[start.index("--command") + 1]
    assert "-m launch.train --config=configs/tiny_lm.py '--workdir=a b'" in script
    assert 'logs/worker-"$(hostname)".log' in script
    assert "--project" not in " ".join(tpu_pod_commands("pod", "z", [])[1])


def test_remote_path_and_missing_flags():
    assert remote_path("~/jax scale") == "\"$HOME\"/'jax scale'"
    assert remote_path("/opt/x") == "/opt/x"
    with pytest.raises(ValueError, match="--tpu and --zone"):
        check_tpu_flags(None, "")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "launch.tpu_pod", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_tpu_pod_dry_run_cli():
    out = _cli("--tpu=pod", "--zone=europe-west4-a", "--project=p", "--dry_run", "--",
               "--config=configs/tiny_lm.py", "--workdir=gs://b/run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4
    assert lines[1].startswith("gcloud compute tpus tpu-vm scp --recurse ")
    for line in lines[1:]:
        assert "--worker=all --zone=europe-west4-a --project=p" in line
    start = shlex.split(lines[3])
    assert start[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod"]
    assert "launch.train --config=configs/tiny_lm.py --workdir=gs://b/run" in start[7]


def test_tpu_pod_missing_zone_cli():
    out = _cli("--tpu=pod", "--dry_run")
    assert out.returncode != 0 and "needs --zone" in out.stderr and "Example:" in out.stderr


def test_sbatch_template():
    with open(os.path.join(ROOT, "launch", "slurm", "train.sbatch")) as f:
        text = f.read()
    assert text.startswith("#!/bin/bash") and "#SBATCH --nodes=" in text
    assert "srun" in text and "python -m launch.train" in text
    assert "scontrol show hostnames" in text
    assert subprocess.run(["bash", "-n", f.name]).returncode == 0
