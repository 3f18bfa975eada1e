"""Find the fastest sharding that fits a TPU topology, by compiling candidates (no TPU needed):

    python -m launch.plan --topology=v5p:2x4x4 --config=configs/llama.py:7b \
        [--top=3] [--hbm_margin=0.1] [--max_candidates=16] [--time_budget_s=3600] [--workers=N]

Ranks by a roofline step-time ESTIMATE (no overlap: compute plus every collective); prints
the winner's --config.* overrides and how much of the search space it compiled and skipped.
Past --max_candidates it compiles up to as many again: the next ones while nothing fits, else
the best's untried neighbours that the guess says may beat it. `--config.init_from=WEIGHTS`
supplies the model as it does to `train` (only the shapes it records are read).
"""

import os

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error
from jaxscale.hardware import HBM_MARGIN

_CONFIG = cli.define_config_file("config", "configs/llama.py:tiny", "Experiment config.")
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology, e.g. v5p:4x4x8.", required=True)
_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices joined over DCN (data-parallel).")
_TOP = flags.DEFINE_integer("top", 3, "How many ranked candidates to print.")
_MARGIN = flags.DEFINE_float("hbm_margin", HBM_MARGIN, "Fraction of the usable HBM kept free.")
_MAX = flags.DEFINE_integer("max_candidates", 16, "Compile this many candidates, then up to as "
                            "many again while nothing fits or the best has an untried "
                            "neighbour that may beat it.")
_BUDGET = flags.DEFINE_float("time_budget_s", 3600.0, "Start no compile after this many s.")
_WORKERS = flags.DEFINE_integer("workers", 0, "Compiling processes at once (0: one per two "
                                 "cores; a large compile keeps about 1.6 cores busy).")
_CACHE = flags.DEFINE_string("cache_dir", os.path.expanduser("~/.cache/jaxscale/plan"),
                             "Compiled results, by hash of config and topology.")


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from jaxscale.aot.topology import compile_only_env
    compile_only_env()  # before jax opens a backend
    from collections import Counter

    from jaxscale.aot.frontier import space_line
    from jaxscale.aot.plan import format_plan
    from jaxscale.aot.search import search
    from jaxscale.aot.topology import parse_topology, require_libtpu

    topology = parse_topology(_TOPOLOGY.value, _SLICES.value)
    require_libtpu()
    config, space = cli.resolved(_CONFIG.value), Counter()
    results = search(config, topology, _CACHE.value, _MAX.value, _BUDGET.value,
                     _WORKERS.value, _MARGIN.value, space=space)
    print(format_plan(results, _MARGIN.value, _TOP.value, topology, config, space))
    print(space_line(space))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
