"""Train and eval loss curves of one or more runs on one figure:

    python -m launch.plot WORKDIR [WORKDIR...] --out=curves.png
"""

import sys

from absl import app, flags

from jaxscale.observe.plots import plot_runs

_OUT = flags.DEFINE_string("out", "curves.png", "PNG file to write.")


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise app.UsageError("launch.plot needs at least one run directory holding a "
                             "metrics.jsonl, e.g. python -m launch.plot runs/a runs/b "
                             "--out=curves.png")
    try:
        print(plot_runs(argv[1:], _OUT.value))
    except ValueError as e:
        sys.exit(f"launch.plot: {e}")


if __name__ == "__main__":
    app.run(main)
