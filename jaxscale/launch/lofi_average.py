"""Lo-Fi averager: `jaxscale lofi-average --store=STORE [--watch] [--aggregator=mean]`.

Each round takes every allowed worker's newest complete push, skips (and says why) anything
partial, corrupt, mismatched, stale or non-finite, and publishes STORE/average/<round>/.
`--allowed_workers`, `--min_workers`, `--max_staleness` and `--outer` default to the workers'
config.lofi (recorded with round 0; `sync=diloco` means `--outer=diloco`). `--final=DIR` runs
a last round and exports the average as DIR/params/ + DIR/config.json for `launch.train
--config.init_from=DIR`, `launch.evaluate --workdir=DIR` and `launch.convert
--from_workdir=DIR --to_hf=OUT`. Prints the communication accounting.
"""

import dataclasses
import signal
import time

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import ConfigError, exit_on_user_error, paragraph
from jaxscale.lofi.accounting import accounting_lines, check_final_dir, export_final
from jaxscale.lofi.aggregate import AGGREGATORS
from jaxscale.lofi.averager import AveragerConfig, describe, run_round
from jaxscale.lofi.store import check_store_root
from jaxscale.storage import locations
from jaxscale.storage.lease import DEFAULT_LEASE_S
from jaxscale.weights.kv import Store, kvstore_spec
from jaxscale.weights.snapshot import latest_average_snapshot

_STORE = flags.DEFINE_string("store", None, "Store location (path, gs://, s3://).", required=True)
_WATCH = flags.DEFINE_bool("watch", False, "Keep running rounds as workers push.")
_REPAIR_INDEX = flags.DEFINE_bool(
    "repair_index", False, "No longer needed, and refused: stores have no index to repair "
    "(committed snapshots are found by listing their COMMIT markers under commits/).")
_INTERVAL = flags.DEFINE_float("interval_s", 1.0, "Polling interval with --watch.", lower_bound=0.0)
_DEFAULT = AveragerConfig()  # the flags' defaults are the averager's
_AGG = flags.DEFINE_enum("aggregator", _DEFAULT.aggregator, list(AGGREGATORS),
                         "How deltas are reduced.")
_TRIM = flags.DEFINE_float("trim", _DEFAULT.trim, "trimmed_mean: fraction trimmed at each end.")
_TAU = flags.DEFINE_float("tau", _DEFAULT.tau,
                          "centered_clip: clipping radius (whole-model L2 norm).")
_MIN = flags.DEFINE_integer("min_workers", None, "Quorum (default: config.lofi.min_workers).")
_ALLOWED = flags.DEFINE_list("allowed_workers", None, "Worker ids accepted (default: config).")
_STALE = flags.DEFINE_integer("max_staleness", None, "Max rounds behind the base (0: any).")
_OUTER = flags.DEFINE_enum("outer", None, ["none", "diloco"],
                           "Outer optimizer (default: 'diloco' for a config.lofi.sync=diloco job).")
_OUTER_LR = flags.DEFINE_float("outer_lr", _DEFAULT.outer_lr, "DiLoCo outer learning rate.")
_OUTER_MOM = flags.DEFINE_float("outer_momentum", _DEFAULT.outer_momentum,
                                "DiLoCo outer Nesterov momentum.")
_BUDGET = flags.DEFINE_integer("chunk_budget_mb", _DEFAULT.chunk_budget_bytes >> 20,
                               "Peak memory budget for streamed blocks.")
_LEASE = flags.DEFINE_float(
    "claim_lease_s", DEFAULT_LEASE_S, "Seconds a round's claim outlives its averager: the "
    "holder renews it while alive, so after a crash another averager takes the round over this "
    "soon. Keep it well under the workers' config.lofi.sync_timeout_s.", lower_bound=0.0)
_RETRY = flags.DEFINE_float(
    "store_retry_s", locations.DEFAULT_RETRY_S, "How long an object-store outage is ridden out "
    "(bounded backoff) before the averager stops with an error; 0: stop at the first error.",
    lower_bound=0.0)
_FINAL = flags.DEFINE_string("final", None, "Run a last round, export the average to DIR.")
flags.register_multi_flags_validator(
    ["watch", "final"], lambda f: not (f["watch"] and f["final"]),
    message="--final runs one last round and exports it, while --watch never stops: run the "
            "watching averager until the workers finish, then `launch.lofi_average "
            "--store=STORE --final=DIR` once.")


def _config(store: Store) -> AveragerConfig:
    given = {"min_workers": _MIN.value, "max_staleness": _STALE.value, "outer": _OUTER.value,
             "allowed_workers": tuple(int(w) for w in _ALLOWED.value)
             if _ALLOWED.value is not None else None}
    explicit = {k for k, v in given.items() if v is not None}
    cfg = AveragerConfig(_AGG.value, _TRIM.value, _TAU.value, outer=_OUTER.value or "none",
                         outer_lr=_OUTER_LR.value, outer_momentum=_OUTER_MOM.value,
                         chunk_budget_bytes=_BUDGET.value << 20,
                         claim_timeout_s=_LEASE.value)
    cfg = cfg.with_job(store, frozenset(explicit))
    return dataclasses.replace(cfg, **{k: given[k] for k in explicit})


def _stop(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_round's finally: the claim is released


@exit_on_user_error
def main(argv):
    signal.signal(signal.SIGTERM, _stop)
    if _REPAIR_INDEX.value:
        raise ConfigError(paragraph(
            "--repair_index is no longer needed: a Lo-Fi store has no index any more. Committed",
            "snapshots are found by listing their COMMIT markers (STORE/commits/workers/ and",
            "STORE/commits/average/), so nothing can be missing from a listing. Run the averager",
            "without --repair_index.",
        ))
    locations.configure(retry_s=_RETRY.value)  # endpoint and region: AWS_* variables
    check_store_root(_STORE.value, kvstore_spec(_STORE.value), must_exist=not _WATCH.value)
    if _FINAL.value:
        check_final_dir(_FINAL.value)  # before a round: a refused export changes nothing
    store = Store(_STORE.value)
    if not _WATCH.value and not store.keys("average/") and not store.keys("workers/"):
        raise ConfigError(paragraph(
            f"--store={_STORE.value} holds no Lo-Fi job: no initial average (round 0) and no",
            "worker push, so there is nothing to average (a training workdir, or a job whose",
            "workers have not started?). Point --store at the workers' config.lofi.store, or",
            "add --watch to wait for them."))
    announced = False
    while True:  # the job settings appear with round 0, possibly after the averager started
        report = run_round(store, _config(store))
        if report.published or not _WATCH.value:
            print(describe(report), flush=True)
        if not _WATCH.value:
            break
        if not announced:  # says the watch is on, also while the store is still empty
            print(f"watching {_STORE.value} for worker pushes every {_INTERVAL.value:g} s "
                  "(SIGTERM or Ctrl-C stops)", flush=True)
            announced = True
        time.sleep(_INTERVAL.value)
    if _FINAL.value:  # a round that found nothing new leaves the newest average as the final one
        print(f"final average exported to {export_final(_STORE.value, _FINAL.value)} "
              f"(round {latest_average_snapshot(store).manifest['round']})")
    print("\n".join(accounting_lines(_STORE.value)), flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
