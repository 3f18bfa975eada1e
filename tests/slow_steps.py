"""Entry point for tests/test_preemption.py's two-process pre-emption: `launch.train` with a
hook that adds `STEP_S` to every step, so that the SIGTERM the test sends after
step 2 stops the run before its last step.

Why: JAX's pre-emption sync agrees on a step only once the notice has reached every process.
Measured on a quiet 2-core machine, that took 7 of tiny_lm's 8 steps under jax 0.12 (1 under jax
0.10): the run ended before the notice (exit 0), or, under load, stopped at its last step. With
0.25 s steps the same notice stopped it at step 4; 0.4 s leaves room for a loaded machine. The
hook changes no value, so the losses still equal conftest's uninterrupted run. Run by
`launch.local_multihost --module=tests.slow_steps`."""

import time

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error
from jaxscale.runtime import distributed
from jaxscale.runtime.peer_failure import together
from jaxscale.runtime.preemption import Preempted, exit_preempted

STEP_S = 0.4
_CONFIG = cli.define_config_file("config", "configs/tiny_lm.py", "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Workdir.", required=True)
distributed.define_flags()


class SlowSteps:
    """Sleeps after each step (after the loop's own hooks: it only stretches time)."""

    order = 500

    def after_step(self, info) -> None:
        time.sleep(STEP_S)

    def at_end(self, info) -> None:
        pass


@exit_on_user_error
def main(argv: list[str]) -> None:
    distributed.setup()
    from jaxscale.train.loop import train

    try:
        with together():
            train(cli.resolved(_CONFIG.value), _WORKDIR.value, hooks=[SlowSteps()])
    except Preempted as e:  # as launch.train: saved at the same step on every host; exit 75
        exit_preempted(e)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
