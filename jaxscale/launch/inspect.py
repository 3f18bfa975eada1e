"""Print where every parameter lives: `jaxscale inspect [--config=FILE[:ARG]] [--cpu_devices=N]`.

Without `--config` it inspects the default config, configs/tiny_lm.py (the banner names it).
`--config.init_from=WEIGHTS` supplies the model as it does to `train` (`cli.resolved`): only the
shapes the weights record are read, and weights `train` would refuse are refused here too."""


from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error
from jaxscale.runtime import distributed

DEFAULT_CONFIG = "configs/tiny_lm.py"
_CONFIG = cli.define_config_file(
    "config", DEFAULT_CONFIG, f"Experiment config (default: {DEFAULT_CONFIG}).")
_COMPILE = flags.DEFINE_bool("compile", True, "Compile the train step for its memory analysis.")
distributed.define_flags()


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    distributed.setup()
    from jaxscale import config as config_lib
    from jaxscale.aot.sharding_report import build_report, format_report
    from jaxscale.weights.init_from import check_init_from
    config = cli.resolved(_CONFIG.value)
    config_lib.validate(config)  # first: a missing init_from is named as train names it
    check_init_from(config)
    print(banner(), flush=True)
    print(format_report(build_report(config, _COMPILE.value)))


def banner() -> str:
    """Which config the report is of: without --config it is the default, which a reader
    would otherwise not know was chosen for them."""
    import sys

    from jaxscale.runtime.pod_commands import flag_value
    spec = flags.FLAGS["config"].config_filename
    given = flag_value(sys.argv, "config") is not None
    return f"config: {spec}" + ("" if given else " (the default; --config=FILE[:ARG] for another)")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
