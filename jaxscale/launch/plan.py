r"""Find the fastest sharding that fits a TPU topology, by compiling candidates (no TPU needed):

    jaxscale plan --topology=v5p:2x4x4 --config=configs/llama.py:7b \
        [--top=3] [--hbm_margin=0.1] [--max_candidates=16] [--time_budget_s=3600] [--workers=N]

Ranks by a roofline step-time ESTIMATE (no overlap: compute plus every collective); prints
the winner's --config.* overrides and how much of the search space it compiled and skipped.
Past --max_candidates it compiles up to as many again: the next ones while nothing fits, else
the best's untried neighbours that the guess says may beat it. `--config.init_from=WEIGHTS`
supplies the model as it does to `train` (only the shapes it records are read).

`--topology=GEN` (a generation alone, e.g. v5p) plans its slices fewest chips first and stops
at the first where a candidate fits: the smallest slice of that generation for the config. A
slice whose floor (the weights and Adam's moments split over every chip, `guess.state_floor_bytes`)
is over the HBM budget is ruled out without compiling.

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
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology, e.g. v5p:4x4x8, or a "
                                "generation (v5p): its smallest slice that fits.", required=True)
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
    from jaxscale.aot.search import PlanStopped, check_cache_dir, check_margin
    from jaxscale.aot.topology import parse_topology, require_libtpu, slice_names
    from jaxscale.runtime.preemption import PREEMPTED_EXIT

    check_margin(_MARGIN.value)
    names = slice_names(_TOPOLOGY.value)
    topologies = [parse_topology(name, _SLICES.value) for name in names]
    require_libtpu()
    check_cache_dir(_CACHE.value)
    config = cli.resolved(_CONFIG.value)

    def stop(signum, frame):
        raise PlanStopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)  # the workers are stopped (search), then exit 75
    ok, over, failed, topology = [], [], [], topologies[0]
    try:
        for topology in topologies:
            if len(topologies) > 1 and (why := _below_floor(config, topology)):
                print(why)
                continue
            ok, over, failed = _plan(config, topology)
            if ok:
                if len(topologies) > 1:
                    print(f"Smallest {_TOPOLOGY.value} slice that fits with a "
                          f"{_MARGIN.value:.0%} HBM margin: {topology.label()} "
                          f"({topology.num_chips} chips).")
                return
    except (PlanStopped, KeyboardInterrupt) as e:
        print(f"jaxscale: plan stopped ({str(e) or 'SIGINT'}): its compiling workers were stopped; "
              f"the cache ({_CACHE.value}) keeps every finished compile, so the same command "
              "continues where it stopped.", file=sys.stderr, flush=True)
        sys.exit(PREEMPTED_EXIT)
    where = (f"any {_TOPOLOGY.value} slice" if len(topologies) > 1
             else topologies[0].label())
    raise ConfigError(paragraph(  # the table above names the closest and what would make it fit
        f"No candidate fits {where} with a {_MARGIN.value:.0%} HBM margin",
        f"({len(over)} over HBM, {len(failed)} failed to compile on {topology.label()}):",
        "the plan above names the closest and what would make it fit." if over else
        "see the compiler's lines above.",
    ))


def _plan(config, topology) -> tuple[list, list, list]:
    """Searches one slice and prints its plan: (fitting, over HBM, failed), ranked."""
    from collections import Counter

    from jaxscale.aot.frontier import space_line
    from jaxscale.aot.plan import format_plan, rank
    from jaxscale.aot.search import search

    space = Counter()
    results = search(config, topology, _CACHE.value, _MAX.value, _BUDGET.value,
                     _WORKERS.value, _MARGIN.value, space=space)
    print(format_plan(results, _MARGIN.value, _TOP.value, topology, config, space))
    print(space_line(space), flush=True)
    return rank(results, _MARGIN.value)


def _below_floor(config, topology) -> str | None:
    """Why `topology` cannot hold the config whatever the sharding, or None."""
    from jaxscale.aot.guess import dims_of, state_floor_bytes
    from jaxscale.hardware import hbm_budget

    floor = state_floor_bytes(config, dims_of(config), topology.num_chips)
    budget = hbm_budget(topology.chip.hbm_limit_bytes, _MARGIN.value)
    if floor is None or floor <= budget:
        return None
    return (f"{topology.label()} ({topology.num_chips} chips): ruled out without compiling: the "
            f"weights and optimizer state alone need {floor / 2**30:.1f} GiB per chip split over "
            f"every chip, over the {budget / 2**30:.1f} GiB budget.")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
