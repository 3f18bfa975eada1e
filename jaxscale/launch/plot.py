"""Train and eval loss curves of one or more runs on one figure:

    jaxscale plot WORKDIR [WORKDIR...] --out=curves.png
"""

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import JaxscaleError, exit_on_user_error
from jaxscale.observe.plots import plot_runs

_OUT = flags.DEFINE_string("out", "curves.png", "PNG file to write.")


@exit_on_user_error
def main(argv: list[str]) -> None:
    """Checks every workdir is reachable before plotting any (a bucket read retries for
    minutes on a dead endpoint)."""
    if len(argv) < 2:
        raise JaxscaleError("jaxscale plot needs at least one run directory holding a "
                            "metrics.jsonl, e.g. jaxscale plot runs/a runs/b --out=curves.png")
    from jaxscale.storage import locations
    for workdir in argv[1:]:  # a dead endpoint: one paragraph in seconds, not a retry loop
        locations.check(workdir)
    try:
        print(plot_runs(argv[1:], _OUT.value))
    except ValueError as e:  # a directory without metrics.jsonl, a run with no losses
        raise JaxscaleError(str(e)) from None


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
