"""Summarize a profiler trace in the terminal: `jaxscale profile-summary WORKDIR`.

Prints the top ops by device time and the share of time in collectives, from the newest trace
a run with `--config.train.profile.num_steps=N` wrote into WORKDIR/profile/ (or from a
`.xplane.pb` file given instead of a workdir).
"""

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error

_TOP = flags.DEFINE_integer("top", 15, "How many ops to list.")


@exit_on_user_error
def main(argv):
    if len(argv) != 2:
        raise app.UsageError("Usage: jaxscale profile-summary WORKDIR [--top=N]")
    from jaxscale.observe.profiling import format_summary, summarize
    print(format_summary(summarize(argv[1]), _TOP.value))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
