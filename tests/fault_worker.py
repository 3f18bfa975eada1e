"""Entry point for the 2-process fault tests: `launch.train` whose process 1 gets a real fault
after step `--break_at` (before that step's saves), mended after step `--mend_at` (0: never).
Process 0 runs as usual. Run by `launch.local_multihost --module=tests.fault_worker` (the tests
start it with `fault_common.launch_two`).

`--fault=local_tier` (tests/test_local_tier_faults.py): process 1's `checkpoint.local_dir` is
renamed away, once the previous local save has been committed (else that save, still in flight,
would fail writing into it first, by chance, with another error), and a regular file takes its
place (every later save fails to make its step directory); mended, an empty directory again.
`--fault=raise` (tests/test_peer_failure.py): process 1 raises a plain RuntimeError, as a
reward function or a data reader that fails on one host does; never mended.
`--fault=writes` (tests/test_persistent_faults.py): process 1's file-size limit is set to 0 bytes
(RLIMIT_FSIZE: every write to a regular file fails with EFBIG, as a full quota does, for root
too; Python ignores SIGXFSZ), once the previous persistent save has been committed, so that the
save that fails is this step's; mended, the limit restored."""

import glob
import os
import resource
import time

import jax
from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error
from jaxscale.runtime import distributed, peer_failure
from jaxscale.runtime.peer_failure import together

_CONFIG = cli.define_config_file("config", "configs/tiny_lm.py", "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir.", required=True)
_FAULT = flags.DEFINE_enum("fault", "local_tier", ["local_tier", "writes", "raise"],
                           "What breaks.")
_BREAK = flags.DEFINE_integer("break_at", 3, "Step after which process 1's fault starts.")
_MEND = flags.DEFINE_integer("mend_at", 0, "Step after which it is mended (0: never).")
distributed.define_flags()


def wait_for_commits(directory: str) -> None:
    """Until the previous save under `directory` is committed (orbax renames its temporary
    directory then), so that the save the fault fails is this step's."""
    while glob.glob(os.path.join(directory, "*.orbax-checkpoint-tmp*")):
        time.sleep(0.05)


class Fault:
    """Breaks and mends at `break_at` / `mend_at`, before the checkpoint hooks (order 300)."""

    order = 250

    def after_step(self, info) -> None:
        if info.step == _BREAK.value:
            self.break_()
        if info.step == _MEND.value:
            self.mend()

    def at_end(self, info) -> None:
        pass


class BreakTier(Fault):
    def __init__(self, directory: str):
        self.directory = directory

    def break_(self) -> None:
        wait_for_commits(self.directory)
        os.rename(self.directory, self.directory + ".gone")
        open(self.directory, "w").close()

    def mend(self) -> None:
        os.remove(self.directory)
        os.makedirs(self.directory)


class Raise(Fault):
    def break_(self) -> None:
        raise RuntimeError(f"injected on process 1 after step {_BREAK.value}")

    def mend(self) -> None:
        pass


class DenyWrites(Fault):
    def __init__(self, checkpoints: str):
        self.limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        self.checkpoints = checkpoints

    def break_(self) -> None:
        wait_for_commits(self.checkpoints)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, self.limits[1]))

    def mend(self) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, self.limits)


@exit_on_user_error
def main(argv: list[str]) -> None:
    distributed.setup()
    from jaxscale.train.local_dir import local_directory
    from jaxscale.train.loop import prepare

    config = cli.resolved(_CONFIG.value)
    if _FAULT.value == "local_tier":
        fault = BreakTier(local_directory(config.checkpoint.local_dir))
    elif _FAULT.value == "raise":
        fault = Raise()
        # Process 0's own main thread, waiting on process 1 in a collective, never fails by
        # itself: the grace it gets for that (10 s) would only be waited out.
        peer_failure.GRACE_S = 1.0
    else:
        fault = DenyWrites(os.path.join(_WORKDIR.value, "checkpoints"))
    with together():  # as launch.train
        prepare(config, _WORKDIR.value, [fault] if jax.process_index() == 1 else []).run()


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
