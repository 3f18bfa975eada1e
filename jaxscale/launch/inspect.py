"""Print where every parameter lives: `jaxscale inspect --config=... [--cpu_devices=N]`.

`--config.init_from=WEIGHTS` supplies the model as it does to `train` (`cli.resolved`): only the
shapes the weights record are read."""

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error
from jaxscale.runtime import distributed

_CONFIG = cli.define_config_file("config", "configs/tiny_lm.py", "Experiment config.")
_COMPILE = flags.DEFINE_bool("compile", True, "Compile the train step for its memory analysis.")
distributed.define_flags()


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    distributed.setup()
    from jaxscale.aot.sharding_report import build_report, format_report
    print(format_report(build_report(cli.resolved(_CONFIG.value), _COMPILE.value)))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
