"""Train from a config file: `jaxscale train --config=configs/tiny_lm.py --workdir=DIR`.

Any config field can be overridden (`--config.mesh.fsdp=4 --config.train.steps=20`);
`--cpu_devices=N` simulates N CPU devices (applied before JAX initialises its backends).
On SIGTERM (a pre-emption) it saves at the current step and exits with status 75
(`jaxscale.runtime.preemption.PREEMPTED_EXIT`); the same command then resumes. A SIGTERM
during start-up (a restore, the compile) exits 75 at once with nothing to save.
"""

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error
from jaxscale.runtime import distributed
from jaxscale.runtime.peer_failure import together
from jaxscale.runtime.preemption import Preempted, StartupGuard, exit_preempted
from jaxscale.storage import locations

_CONFIG = cli.define_config_file("config", "configs/tiny_lm.py", "Experiment config.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for config.json, metrics, checkpoints: a local path, "
    "gs://bucket/prefix or s3://bucket/prefix.", required=True)
distributed.define_flags()


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    # Before anything slow: a SIGTERM until the first step exits 75 (single process; a
    # multi-host run's SIGTERM belongs to JAX's pre-emption sync service).
    with StartupGuard(enabled=not distributed.multi_host()):
        locations.epath(_WORKDIR.value)  # an unsupported scheme fails before devices start
        distributed.setup()
        from jaxscale.lofi.worker import train_worker  # after the devices are configured
        from jaxscale.rl.rollout import train_grpo
        from jaxscale.train.loop import train
        run = (train_worker if _CONFIG.value.lofi.enabled else
               train_grpo if _CONFIG.value.objective.name == "grpo" else train)
        try:
            with together():  # one process failing stops them all
                run(cli.resolved(_CONFIG.value), _WORKDIR.value)
        except Preempted as e:  # SIGTERM: saved at the same step on every host; exit 75
            exit_preempted(e)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
