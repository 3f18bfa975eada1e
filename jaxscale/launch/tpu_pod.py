r"""Copy, install and start training on every worker of a TPU VM slice:

    jaxscale tpu-pod --tpu=NAME --zone=ZONE [--project=P] [--dry_run] -- \
        --config=FILE[:ARG] --workdir=gs://BUCKET/PATH [more train flags]

The commands are built by `jaxscale.runtime.pod_commands.tpu_pod_commands`; `--dry_run` prints them.
"""

import os
import shlex
import subprocess

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import JaxscaleError, exit_on_user_error, paragraph
from jaxscale.runtime.pod_commands import (
    check_python,
    check_repo_dir,
    check_tpu_flags,
    check_train_flags,
    default_repo_dir,
    new_archive,
    tpu_pod_commands,
)

_TPU = flags.DEFINE_string("tpu", None, "TPU VM name (gcloud compute tpus tpu-vm list).")
_ZONE = flags.DEFINE_string("zone", None, "Zone of the TPU VM, e.g. us-central2-b.")
_PROJECT = flags.DEFINE_string("project", None, "Google Cloud project (default: gcloud's).")
_DRY = flags.DEFINE_bool("dry_run", False, "Print the commands instead of running them.")
_REPO = flags.DEFINE_string("repo_dir", None, "Local jaxscale source tree to copy (default: "
                            "the checkout this jaxscale is installed from).")
_REMOTE = flags.DEFINE_string("remote_dir", "~/jaxscale", "Where the code lives on each worker.")
_EXTRA = flags.DEFINE_string("jax_extra", "tpu", "pip extra of jax installed on the workers.")
_PY = flags.DEFINE_string("python", "python3", "Worker interpreter for the venv (>= 3.11).")
_BG = flags.DEFINE_bool("background", False, "Start training under nohup and return at once.")
_LOCAL_WORKDIR = flags.DEFINE_bool(
    "allow_local_workdir", False, "Accept a --workdir that is a path, not a bucket URL: right "
    "for a directory every worker shares (a gcsfuse or NFS mount) or a slice of one worker.")


@exit_on_user_error
def main(argv: list[str]) -> None:
    """Checks every flag before the first command runs: a mistake found on the workers would
    come after the copy and install, once per worker."""
    train_flags = argv[1:]
    check_tpu_flags(_TPU.value, _ZONE.value)
    check_train_flags(train_flags, _LOCAL_WORKDIR.value)
    repo_dir = _REPO.value or default_repo_dir() or "."
    check_repo_dir(repo_dir)
    check_python(_PY.value)
    archive = new_archive()
    try:
        commands = tpu_pod_commands(_TPU.value, _ZONE.value, train_flags, project=_PROJECT.value,
                                    repo_dir=repo_dir, remote_dir=_REMOTE.value,
                                    archive=archive, jax_extra=_EXTRA.value, python=_PY.value,
                                    background=_BG.value)
        for cmd in commands:
            print(shlex.join(cmd), flush=True)
            if not _DRY.value:
                _run(cmd)
    finally:
        os.remove(archive)


def _run(cmd: list[str]) -> None:
    """Runs one step; a failure stops the launch in one paragraph (later steps need it)."""
    code = subprocess.run(cmd).returncode
    if code:
        raise JaxscaleError(paragraph(
            f"jaxscale tpu-pod: `{shlex.join(cmd)}` exited with {code}; later steps were not",
            "run. Fix the cause (its output is above) and launch again."))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
