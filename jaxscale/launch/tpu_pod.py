"""Copy, install and start training on every worker of a TPU VM slice:

    jaxscale tpu-pod --tpu=NAME --zone=ZONE [--project=P] [--dry_run] -- <train flags>

The commands are built by `jaxscale.runtime.pod_commands.tpu_pod_commands`; `--dry_run` prints them.
"""

import shlex
import subprocess
import sys

from absl import app, flags

from jaxscale import cli
from jaxscale.runtime.pod_commands import check_tpu_flags, tpu_pod_commands

_TPU = flags.DEFINE_string("tpu", None, "TPU VM name (gcloud compute tpus tpu-vm list).")
_ZONE = flags.DEFINE_string("zone", None, "Zone of the TPU VM, e.g. us-central2-b.")
_PROJECT = flags.DEFINE_string("project", None, "Google Cloud project (default: gcloud's).")
_DRY = flags.DEFINE_bool("dry_run", False, "Print the commands instead of running them.")
_REPO = flags.DEFINE_string("repo_dir", ".", "Local source tree to copy.")
_REMOTE = flags.DEFINE_string("remote_dir", "~/jaxscale", "Where the code lives on each worker.")
_EXTRA = flags.DEFINE_string("jax_extra", "tpu", "pip extra of jax installed on the workers.")
_PY = flags.DEFINE_string("python", "python3", "Worker interpreter for the venv (>= 3.11).")
_BG = flags.DEFINE_bool("background", False, "Start training under nohup and return at once.")


def main(argv: list[str]) -> None:
    try:
        check_tpu_flags(_TPU.value, _ZONE.value)
    except ValueError as e:
        sys.exit(str(e))
    commands = tpu_pod_commands(_TPU.value, _ZONE.value, argv[1:], project=_PROJECT.value,
                                repo_dir=_REPO.value, remote_dir=_REMOTE.value,
                                jax_extra=_EXTRA.value, python=_PY.value,
                                background=_BG.value)
    for cmd in commands:
        print(shlex.join(cmd), flush=True)
        if not _DRY.value:
            code = subprocess.run(cmd).returncode
            if code:
                sys.exit(f"launch.tpu_pod: `{shlex.join(cmd)}` exited with {code}; "
                         "later steps were not run. Fix the cause and launch again.")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
