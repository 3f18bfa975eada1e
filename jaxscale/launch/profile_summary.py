"""Summarize a profiler trace in the terminal: `jaxscale profile-summary WORKDIR`.

Prints the top ops by device time and the share of time in collectives, from the newest trace
a run with `--config.train.profile.num_steps=N` wrote into WORKDIR/profile/ (or from a
`.xplane.pb` file given instead of a workdir).
"""

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import JaxscaleError, exit_on_user_error, paragraph

_TOP = flags.DEFINE_integer("top", 15, "How many ops to list (1 or more).")


def _check_args(argv: list[str], top: int) -> None:
    """One paragraph for a wrong argument count or --top < 1 (a negative --top would slice
    the table from its end and print every op but the last few, an answer that looks right)."""
    if len(argv) != 2:
        raise JaxscaleError(paragraph(
            "jaxscale profile-summary takes one workdir (or .xplane.pb file), and was given",
            f"{len(argv) - 1} ({' '.join(argv[1:]) or 'none'}): jaxscale profile-summary",
            "WORKDIR [--top=N]."))
    if top < 1:
        raise JaxscaleError(paragraph(
            f"--top={top}: jaxscale profile-summary lists the N ops that took the most time;",
            "give N >= 1 (the default is 15)."))


@exit_on_user_error
def main(argv: list[str]) -> None:
    _check_args(argv, _TOP.value)
    from jaxscale.observe.profiling import format_summary, summarize
    from jaxscale.storage import locations
    locations.check(argv[1])  # an unreachable bucket is said as such, not as "no trace"
    print(format_summary(summarize(argv[1]), _TOP.value))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
