"""TPU pod launcher commands (pure builders and the --dry_run CLI) and the SLURM template."""

import os
import shlex
import subprocess
import sys

import pytest

from jaxscale.errors import ConfigError
from jaxscale.runtime.pod_commands import (
    check_python,
    check_repo_dir,
    check_tpu_flags,
    check_train_flags,
    remote_path,
    tpu_pod_commands,
)

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
    assert out.returncode == 2 and "needs --zone" in out.stderr and "Example:" in out.stderr
    assert out.stderr.startswith("jaxscale: error: ") and "Traceback" not in out.stderr
    assert "jaxscale tpu-pod --tpu=" in out.stderr and "python -m" not in out.stderr


@pytest.mark.parametrize("args, says", [
    ((), "needs --tpu and --zone"),
    (("--", "--workdir=gs://b/r"), "have no --config"),
    (("--", "--config=configs/tiny_lm.py"), "have no --workdir"),
    (("--", "--config=configs/tiny_lm.py", "--workdir=runs/r"), "is a local path"),
    (("--python=python3.9", "--", "--config=tiny_lm", "--workdir=gs://b/r"), ">= 3.11"),
    (("--repo_dir=/no/such/dir", "--", "--config=tiny_lm", "--workdir=gs://b/r"),
     "does not exist"),
])
def test_tpu_pod_refuses_bad_flags_cli(args, says):
    """Each mistake is one `jaxscale: error:` paragraph and exit 2, before any command."""
    zone = ("--tpu=pod", "--zone=z", "--dry_run") if args else ()
    out = _cli(*zone, *args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("jaxscale: error: ") and says in out.stderr
    assert "Traceback" not in out.stderr and not out.stdout


def test_tpu_pod_checks(tmp_path):
    check_python("python3.11")
    check_python("/usr/bin/python3")
    with pytest.raises(ConfigError, match="Python 3.10"):
        check_python("/usr/bin/python3.10")
    check_repo_dir(ROOT)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    with pytest.raises(ConfigError, match="naming 'other'"):
        check_repo_dir(str(tmp_path))
    check_train_flags(["--config", "tiny_lm", "--workdir", "s3://b/r"])
    check_train_flags(["--config=tiny_lm", "--workdir=runs/r"], allow_local_workdir=True)


def test_tpu_pod_archive_is_unique_and_removed():
    """Two launches never share (or leave behind) one fixed /tmp archive."""
    args = ("--tpu=pod", "--zone=z", "--dry_run", "--", "--config=tiny_lm", "--workdir=gs://b/r")
    names = {shlex.split(_cli(*args).stdout.splitlines()[0])[2] for _ in range(2)}
    assert len(names) == 2 and not any(os.path.exists(n) for n in names)
    assert not any(n.endswith("/jaxscale-src.tar.gz") for n in names)


def test_sbatch_template():
    with open(os.path.join(ROOT, "launch", "slurm", "train.sbatch")) as f:
        text = f.read()
    assert text.startswith("#!/bin/bash") and "#SBATCH --nodes=" in text
    assert "srun" in text and "python -m launch.train" in text
    assert "scontrol show hostnames" in text
    assert subprocess.run(["bash", "-n", f.name]).returncode == 0
