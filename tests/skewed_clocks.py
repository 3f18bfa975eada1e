"""Entry point for tests/test_checkpoint_time.py's multi-process test: `launch.train` with each
process's save timers on its own injected clock, skewed per process (process p's clock advances
p * 4 + 1 minutes per read), as hosts' clocks differ. Run by `launch.local_multihost
--module=tests.skewed_clocks`."""

import jax
from absl import app, flags

from jaxscale import cli
from jaxscale.runtime import distributed

_CONFIG = cli.define_config_file("config", "configs/tiny_lm.py", "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir.", required=True)
distributed.define_flags()


class Skewed:
    """A clock that advances `minutes` each time it is read (once per step and timer)."""

    def __init__(self, minutes: float) -> None:
        self.minutes, self.t = minutes, -minutes * 60.0

    def __call__(self) -> float:
        self.t += self.minutes * 60.0
        return self.t


def main(argv: list[str]) -> None:
    distributed.setup()
    from jaxscale.train.loop import prepare

    trainer = prepare(cli.resolved(_CONFIG.value), _WORKDIR.value)
    for hook in trainer.hooks:
        if hasattr(hook, "interval"):
            hook.interval.clock = Skewed(jax.process_index() * 4 + 1)
    trainer.run()


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
