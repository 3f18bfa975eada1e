"""test_lofi_worker's check of `launch.lofi_local --dry_run`'s worker lines: `python -m
tests.check_worker_flags LINE...` parses and validates each command line as `jaxscale train`
would, each in a process of its own (forked after the imports, before any flag is defined:
absl's flags are global), prints each one's `config.lofi` as a JSON line, in order, and exits
with the first failure."""

import json
import os
import shlex
import sys
import traceback

from absl import flags

from jaxscale import cli
from jaxscale.config import validate


def check(line: str) -> None:
    """Parses and validates one `jaxscale train ...` line; prints its `config.lofi`."""
    sys.argv = ["jaxscale train"] + shlex.split(line)[2:]  # config_flags reads sys.argv
    config = cli.define_config_file("config", "configs/tiny_lm.py", "")
    flags.DEFINE_string("workdir", None, "")
    cli.parse_flags(sys.argv)
    validate(config.value)
    print(json.dumps(config.value.lofi.to_dict()), flush=True)


def main(lines: list[str]) -> int:
    for line in lines:
        pid = os.fork()
        if pid == 0:
            try:
                check(line)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
            os._exit(0)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if status:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
