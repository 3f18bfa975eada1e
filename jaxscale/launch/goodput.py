"""How much of a run's time trained steps it kept: `jaxscale goodput WORKDIR` (local or a bucket).

Reads WORKDIR/events.jsonl, which every start, restore, compile, save, pre-emption and exit of
the run appends to, across all restarts (`jaxscale.observe.events`), and prints productive step
time over wall time, the steps lost to each interruption, and the time spent compiling, saving
and restoring (`jaxscale.observe.goodput`). `--json` prints the same as one JSON object.
"""

import json

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import JaxscaleError, exit_on_user_error, paragraph

_JSON = flags.DEFINE_bool("json", False, "Print the report as one JSON object.")


@exit_on_user_error
def main(argv):
    if len(argv) != 2:
        raise JaxscaleError(paragraph(
            f"jaxscale goodput takes one workdir, and was given {len(argv) - 1}",
            f"({' '.join(argv[1:]) or 'none'}): jaxscale goodput WORKDIR [--json]."))
    from jaxscale.observe.goodput import format_report, goodput
    from jaxscale.storage import locations
    locations.check(argv[1])
    report = goodput(argv[1])
    print(json.dumps(report.to_json()) if _JSON.value else format_report(argv[1], report))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
