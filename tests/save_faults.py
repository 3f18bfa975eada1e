"""Entry point for tests/test_save_faults.py: `launch.train` whose process 1 cannot write its
shards of the persistent checkpoints from some step on, in a real way. After step `--break_at`
(before that step's save) its file-size limit is set to 0 bytes (RLIMIT_FSIZE: every write to a
regular file then fails with EFBIG, as a full quota does, for root too); after step `--mend_at`
(0: never) the limit is restored. Process 0 writes as usual. Run by
`launch.local_multihost --module=tests.save_faults`."""

import glob
import os
import resource
import time

import jax
from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error
from jaxscale.runtime import distributed

_CONFIG = cli.define_config_file("config", "configs/tiny_lm.py", "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir.", required=True)
_BREAK = flags.DEFINE_integer("break_at", 4, "Step after which process 1 cannot write files.")
_MEND = flags.DEFINE_integer("mend_at", 0, "Step after which it can again (0: never).")
distributed.define_flags()


class DenyWrites:
    """Before the checkpoint hooks (order 300) of `break_at` / `mend_at`, on process 1.
    (Python ignores SIGXFSZ, so a write past the limit fails with EFBIG, not a signal.)"""

    order = 250

    def __init__(self, checkpoints: str):
        self.limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        self.checkpoints = checkpoints

    def after_step(self, info) -> None:
        if info.step == _BREAK.value:
            # the previous save's commit done (renamed by process 0 after every process
            # wrote), so that the save that fails is this step's, not a slow earlier one
            while glob.glob(os.path.join(self.checkpoints, "*.orbax-checkpoint-tmp*")):
                time.sleep(0.05)
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, self.limits[1]))
        if info.step == _MEND.value:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.limits)

    def at_end(self, info) -> None:
        pass


@exit_on_user_error
def main(argv: list[str]) -> None:
    distributed.setup()
    from jaxscale.train.loop import prepare

    config = cli.resolved(_CONFIG.value)
    hooks = [DenyWrites(os.path.join(_WORKDIR.value, "checkpoints"))] if jax.process_index() == 1 else []
    prepare(config, _WORKDIR.value, hooks).run()


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
