"""Entry point for tests/test_local_tier_faults.py: `launch.train` whose process 1 loses its
local tier mid-run in a real way. After step `--break_at` (before that step's local save) its
`checkpoint.local_dir` is renamed away (a save in flight then fails writing into it) and a
regular file takes its place (every later save fails to make its step directory); after step
`--mend_at` (0: never) the file is replaced by an empty directory again. Run by
`launch.local_multihost --module=tests.tier_faults`."""

import os

import jax
from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error
from jaxscale.runtime import distributed

_CONFIG = cli.define_config_file("config", "configs/tiny_lm.py", "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir.", required=True)
_BREAK = flags.DEFINE_integer("break_at", 3, "Step after which process 1's local tier breaks.")
_MEND = flags.DEFINE_integer("mend_at", 0, "Step after which it is a directory again (0: never).")
distributed.define_flags()


class BreakTier:
    """Before the checkpoint hooks (order 300) of `break_at` / `mend_at`, on process 1."""

    order = 250

    def __init__(self, directory: str):
        self.directory = directory

    def after_step(self, info) -> None:
        if info.step == _BREAK.value:
            os.rename(self.directory, self.directory + ".gone")
            open(self.directory, "w").close()
        if info.step == _MEND.value:
            os.remove(self.directory)
            os.makedirs(self.directory)

    def at_end(self, info) -> None:
        pass


@exit_on_user_error
def main(argv: list[str]) -> None:
    distributed.setup()
    from jaxscale.train.local_tier import local_directory
    from jaxscale.train.loop import prepare

    config = cli.resolved(_CONFIG.value)
    hooks = [BreakTier(local_directory(config.checkpoint.local_dir))]
    prepare(config, _WORKDIR.value, hooks if jax.process_index() == 1 else []).run()


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
