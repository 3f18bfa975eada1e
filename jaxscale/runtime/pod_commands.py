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
import re
import shlex
import tempfile
import tomllib
from collections.abc import Sequence

from jaxscale.errors import ConfigError, paragraph

# Paths left out of the code archive: environments, caches and run outputs are large and
# host-specific; the workers build their own virtual environment.
ARCHIVE_EXCLUDES: tuple[str, ...] = (".venv", ".git", "runs", "__pycache__", ".pytest_cache",
                                     "*.egg-info", "logs")
DEFAULT_ARCHIVE = os.path.join(tempfile.gettempdir(), "jaxscale-src.tar.gz")
EXAMPLE = ("Example: jaxscale tpu-pod --tpu=my-v4-32 --zone=us-central2-b --project=my-project "
           "-- --config=configs/llama.py:1b --workdir=gs://my-bucket/runs/1b")
MIN_PYTHON = (3, 11)


def check_tpu_flags(tpu: str | None, zone: str | None) -> None:
    """Raises a ConfigError naming the missing flag, with a full example command."""
    missing = [name for name, value in (("--tpu", tpu), ("--zone", zone)) if not value]
    if missing:
        raise ConfigError(paragraph(
            f"jaxscale tpu-pod needs {' and '.join(missing)}: the TPU VM's name and its zone, as",
            "shown by `gcloud compute tpus tpu-vm list --zone=ZONE`.", EXAMPLE))


def new_archive() -> str:
    """A fresh local path for the code archive: a fixed name would let two launches from one
    machine (or another user's file there) overwrite or leak into each other's archive."""
    fd, path = tempfile.mkstemp(prefix="jaxscale-src-", suffix=".tar.gz")
    os.close(fd)
    return path


def default_repo_dir() -> str:
    """The checkout this jaxscale runs from (an editable install's source tree), whatever the
    current directory; "" for an installed wheel, which has no tree to copy."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return root if os.path.isfile(os.path.join(root, "pyproject.toml")) else ""


def check_repo_dir(repo_dir: str) -> None:
    """Refuses a `--repo_dir` that is not a jaxscale source tree: it is tarred whole and
    `pip install -e .`-ed on every worker, so a wrong directory would ship and install it."""
    pyproject = os.path.join(repo_dir, "pyproject.toml")
    name = None
    if os.path.isfile(pyproject):
        try:
            with open(pyproject, "rb") as f:
                name = tomllib.load(f).get("project", {}).get("name")
        except (OSError, tomllib.TOMLDecodeError):
            name = None
    if name != "jaxscale":
        found = ("does not exist" if not os.path.isdir(repo_dir) else
                 "has no pyproject.toml" if not os.path.isfile(pyproject) else
                 f"has a pyproject.toml naming {name!r}, not jaxscale")
        raise ConfigError(paragraph(
            f"--repo_dir={repo_dir!r} ({os.path.abspath(repo_dir)}) {found}: it is the source",
            "tree copied to and `pip install -e .`-ed on every worker (by default the checkout",
            "this jaxscale is installed from). Pass --repo_dir=PATH/TO/jaxscale."))


def check_python(python: str) -> None:
    """Refuses a worker interpreter whose name gives a version below 3.11 (`python3.10`):
    jaxscale would fail to install on every worker, after the copy."""
    m = re.fullmatch(r"python(\d+)\.(\d+)", os.path.basename(python))
    if m and (int(m[1]), int(m[2])) < MIN_PYTHON:
        raise ConfigError(paragraph(
            f"--python={python!r} is Python {m[1]}.{m[2]}, but jaxscale needs Python >= 3.11.",
            "Pass an interpreter the workers have, e.g. --python=python3.11 (older TPU VM",
            "images ship 3.10: install 3.11 there first)."))


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name=V` / `--name V` in `argv` (the last one wins, as absl's), else
    None: read before (or without) parsing, by the launchers and `cli`."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def check_train_flags(train_flags: Sequence[str], allow_local_workdir: bool = False) -> None:
    """Refuses train flags that would start the wrong run on every worker: none (train's
    default config, no workdir), no `--config`, no `--workdir`, or a local workdir, which
    each worker of a multi-worker slice would fill on its own disk (no shared checkpoints)."""
    config, workdir = flag_value(train_flags, "config"), flag_value(train_flags, "workdir")
    if not config or not workdir:
        missing = " and ".join(f for f, v in (("--config", config), ("--workdir", workdir))
                               if not v)
        raise ConfigError(paragraph(
            f"jaxscale tpu-pod: the train flags after `--` ({shlex.join(train_flags) or 'none'})",
            f"have no {missing}; every worker runs `jaxscale train` with exactly those flags.",
            EXAMPLE))
    if not allow_local_workdir and "://" not in workdir:  # gs://, s3://: shared
        raise ConfigError(paragraph(
            f"--workdir={workdir!r} is a local path: each worker of the slice would write its",
            "own checkpoints and metrics on its own disk, and a resume would find none of the",
            "others'. Use shared storage (--workdir=gs://BUCKET/PATH), or pass",
            "--allow_local_workdir to jaxscale tpu-pod if the path is shared by every worker (a",
            "gcsfuse or NFS mount) or the slice has one worker (e.g. v4-8)."))


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
