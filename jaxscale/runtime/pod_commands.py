"""Command builders for launching on TPU pod slices: pure functions returning argv lists.

Kept free of side effects so `launch/tpu_pod.py --dry_run` and the tests see exactly the
commands a real launch runs. Every command is an argv list (no shell on this machine); the
remote part of `gcloud ... ssh --command=...` is one shell string, built with `shlex` quoting.

On a TPU VM every worker must run the same program at about the same time:
`jax.distributed.initialize()` finds the coordinator and the process ids from the TPU metadata,
so the train flags need no `--coordinator_address`.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from collections.abc import Sequence

# Paths left out of the code archive: environments, caches and run outputs are large and
# host-specific; the workers build their own virtual environment.
ARCHIVE_EXCLUDES: tuple[str, ...] = (".venv", ".git", "runs", "__pycache__", ".pytest_cache",
                                     "*.egg-info", "logs")
DEFAULT_ARCHIVE = os.path.join(tempfile.gettempdir(), "jaxscale-src.tar.gz")


def check_tpu_flags(tpu: str | None, zone: str | None) -> None:
    """Raises a ValueError naming the missing flag, with a full example command."""
    missing = [name for name, value in (("--tpu", tpu), ("--zone", zone)) if not value]
    if missing:
        raise ValueError(
            f"launch.tpu_pod needs {' and '.join(missing)}: the TPU VM's name and its zone, as "
            "shown by `gcloud compute tpus tpu-vm list --zone=ZONE`. Example: python -m "
            "launch.tpu_pod --tpu=my-v4-32 --zone=us-central2-b --project=my-project -- "
            "--config=configs/llama.py:1b --workdir=gs://my-bucket/runs/1b")


def remote_path(path: str) -> str:
    """Shell-quotes a remote path but keeps a leading `~/` expandable (as "$HOME"/...)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def gcloud_tpu(verb: str, tpu: str, zone: str, project: str | None,
               *args: str) -> list[str]:
    """`gcloud compute tpus tpu-vm VERB ...` aimed at all workers of `tpu`."""
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", verb, *args, "--worker=all", f"--zone={zone}"]
    if project:
        cmd.append(f"--project={project}")
    return cmd


def ssh_all(tpu: str, zone: str, project: str | None, script: str) -> list[str]:
    """Runs the shell `script` on every worker in parallel, stopping at its first failure.

    The script runs in the worker's login shell (bash on TPU VM images), hence `pipefail`.
    """
    return gcloud_tpu("ssh", tpu, zone, project, tpu, "--command", "set -euo pipefail; " + script)


def archive_command(repo_dir: str, archive: str = DEFAULT_ARCHIVE) -> list[str]:
    """A local `tar` of the source tree, without environments and run outputs."""
    excludes = [f"--exclude={pattern}" for pattern in ARCHIVE_EXCLUDES]
    return ["tar", "czf", archive, *excludes, "-C", repo_dir, "."]


def tpu_pod_commands(tpu: str, zone: str, train_flags: Sequence[str], *,
                     project: str | None = None, repo_dir: str = ".",
                     remote_dir: str = "~/jaxscale", archive: str = DEFAULT_ARCHIVE,
                     jax_extra: str = "tpu", python: str = "python3",
                     background: bool = False) -> list[list[str]]:
    """The commands that copy, install and start `launch.train` on every worker of a TPU VM.

    1. tar the code locally (one file copies faster than a tree, and skips `.venv`);
    2. `scp --recurse` it to every worker's home directory (`--worker=all`);
    3. unpack into `remote_dir`, create `remote_dir/.venv` with `python` (jaxscale needs
       Python >= 3.11; older TPU VM images ship 3.10, so pass e.g. `python3.11`),
       and `pip install -e .` plus `jax[<jax_extra>]` (the TPU runtime; the package itself only pins CPU jax);
    4. start `python -m launch.train <train_flags>` on all workers at once, each writing
       `remote_dir/logs/worker-$(hostname).log`; in the foreground the output also streams
       back through gcloud, with `background=True` it runs under nohup and the ssh returns.
    """
    check_tpu_flags(tpu, zone)
    name = os.path.basename(archive)
    rdir = remote_path(remote_dir)
    install = (f"mkdir -p {rdir} && tar xzf {remote_path('~/' + name)} -C {rdir} && cd {rdir} "
               f"&& {shlex.quote(python)} -m venv .venv "
               f"&& .venv/bin/pip install --quiet --upgrade pip "
               f"&& .venv/bin/pip install --quiet -e . {shlex.quote(f'jax[{jax_extra}]')}")
    train = shlex.join([".venv/bin/python", "-m", "launch.train", *train_flags])
    log = 'logs/worker-"$(hostname)".log'
    if background:
        start = f"cd {rdir} && mkdir -p logs && nohup {train} > {log} 2>&1 < /dev/null &"
    else:
        start = f"cd {rdir} && mkdir -p logs && {train} 2>&1 | tee {log}"
    return [
        archive_command(repo_dir, archive),
        gcloud_tpu("scp", tpu, zone, project, "--recurse", archive, f"{tpu}:{name}"),
        ssh_all(tpu, zone, project, install),
        ssh_all(tpu, zone, project, start),
    ]
