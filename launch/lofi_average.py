"""Lo-Fi averager: `python -m launch.lofi_average --store=STORE [--watch] [--aggregator=mean]`.

Each round takes every allowed worker's newest complete push, skips (and says why) anything
partial, corrupt, mismatched, stale or non-finite, and publishes STORE/average/<round>/.
`--final=DIR` runs a last round and exports the average as DIR/params/ for
`launch.train --config.init_from=DIR`.
"""

import time

from absl import app, flags

from jaxscale.errors import exit_on_user_error
from jaxscale.lofi.accounting import accounting_lines
from jaxscale.lofi.averager import AveragerConfig, describe, run_round

_STORE = flags.DEFINE_string("store", None, "Store location (path, gs://, s3://).", required=True)
_WATCH = flags.DEFINE_bool("watch", False, "Keep running rounds as workers push.")
_INTERVAL = flags.DEFINE_float("interval_s", 1.0, "Polling interval with --watch.")
_AGG = flags.DEFINE_enum("aggregator", "mean", ["mean", "median", "trimmed_mean", "centered_clip"],
                         "How deltas are reduced.")
_TRIM = flags.DEFINE_float("trim", 0.2, "trimmed_mean: fraction trimmed at each end.")
_TAU = flags.DEFINE_float("tau", 1.0, "centered_clip: clipping radius.")
_MIN = flags.DEFINE_integer("min_workers", 1, "Quorum: new contributions needed for a round.")
_ALLOWED = flags.DEFINE_list("allowed_workers", [], "Worker ids accepted (default: all).")
_STALE = flags.DEFINE_integer("max_staleness", 0, "Max steps behind the newest push (0: any).")
_OUTER = flags.DEFINE_enum("outer", "none", ["none", "diloco"], "Outer optimizer.")
_OUTER_LR = flags.DEFINE_float("outer_lr", 0.7, "DiLoCo outer learning rate.")
_OUTER_MOM = flags.DEFINE_float("outer_momentum", 0.9, "DiLoCo outer Nesterov momentum.")
_BUDGET = flags.DEFINE_integer("chunk_budget_mb", 64, "Peak memory budget for streamed blocks.")
_FINAL = flags.DEFINE_string("final", None, "Export the final average to DIR/params/.")


@exit_on_user_error
def main(argv):
    cfg = AveragerConfig(_AGG.value, _TRIM.value, _TAU.value, _MIN.value,
                         tuple(int(w) for w in _ALLOWED.value) or None, _STALE.value,
                         _OUTER.value, _OUTER_LR.value, _OUTER_MOM.value, _BUDGET.value << 20)
    while True:
        report = run_round(_STORE.value, cfg)
        if report.published or not _WATCH.value:
            print(describe(report), flush=True)
        if not _WATCH.value:
            break
        time.sleep(_INTERVAL.value)
    if _FINAL.value:
        from jaxscale.lofi.accounting import export_final
        print(f"final average exported to {export_final(_STORE.value, _FINAL.value)}")
    print("\n".join(accounting_lines(_STORE.value)), flush=True)


if __name__ == "__main__":
    app.run(main)
