"""Find the fastest sharding that fits a TPU topology, by compiling candidates (no TPU needed):

    python -m launch.plan --topology=v5p:2x4x4 --config=configs/llama.py:7b \
        [--top=3] [--hbm_margin=0.1] [--max_candidates=16] [--time_budget_s=3600] [--workers=N]

Ranks by a roofline step-time ESTIMATE (no overlap: compute plus every collective); prints
the winner's --config.* overrides and how much of the search space it compiled and skipped.
Past --max_candidates it compiles up to as many again: the next ones while nothing fits, else
the best's untried neighbours that the guess says may beat it. `--config.init_from=WEIGHTS`
supplies the model as it does to `train` (only the shapes it records are read).

Exits 2 when no candidate fits (after the table, which names the closest candidate and what
would make it fit), and 75 on SIGTERM or Ctrl-C after stopping its compiling workers (the cache
keeps every finished compile). An unreadable cache entry is compiled again, with a note.
"""

import os
import signal
import sys

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import ConfigError, exit_on_user_error, paragraph
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
    from jaxscale.aot.plan import format_plan, rank
    from jaxscale.aot.search import PlanStopped, check_cache_dir, check_margin, search
    from jaxscale.aot.topology import parse_topology, require_libtpu
    from jaxscale.runtime.preemption import PREEMPTED_EXIT

    check_margin(_MARGIN.value)
    topology = parse_topology(_TOPOLOGY.value, _SLICES.value)
    require_libtpu()
    check_cache_dir(_CACHE.value)
    config, space = cli.resolved(_CONFIG.value), Counter()

    def stop(signum, frame):
        raise PlanStopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)  # the workers are stopped (search), then exit 75
    try:
        results = search(config, topology, _CACHE.value, _MAX.value, _BUDGET.value,
                         _WORKERS.value, _MARGIN.value, space=space)
        print(format_plan(results, _MARGIN.value, _TOP.value, topology, config, space))
        print(space_line(space))
    except (PlanStopped, KeyboardInterrupt) as e:
        print(f"jaxscale: plan stopped ({str(e) or 'SIGINT'}): its compiling workers were stopped; "
              f"the cache ({_CACHE.value}) keeps every finished compile, so the same command "
              "continues where it stopped.", file=sys.stderr, flush=True)
        sys.exit(PREEMPTED_EXIT)
    ok, over, failed = rank(results, _MARGIN.value)
    if not ok:  # the table above names the closest candidate and what would make it fit
        raise ConfigError(paragraph(
            f"No candidate fits {topology.label()} with a {_MARGIN.value:.0%} HBM margin",
            f"({len(over)} over HBM, {len(failed)} failed to compile):",
            "the plan above names the closest and what would make it fit." if over else
            "see the compiler's lines above.",
        ))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
