"""Lo-Fi on one machine: `jaxscale lofi-local --num_workers=4 --devices_per_worker=2
--store=DIR -- <train flags>` runs N independent workers plus the averager, shows one combined
progress line, and leaves the final average in the store (exported to WORKDIR/final).
`--dry_run` prints the same job as one worker per TPU VM with a shared gs:// store."""

import os

from absl import app, flags

from jaxscale import cli
from jaxscale.config import LOFI_SYNC_MODES
from jaxscale.errors import exit_on_user_error
from jaxscale.lofi.aggregate import AGGREGATORS
from jaxscale.lofi.job import LofiJob, lofi_vm_commands, run_local
from jaxscale.lofi.store import check_new_store
from jaxscale.storage import locations

_N = flags.DEFINE_integer("num_workers", 4, "Worker processes, each with its own mesh.",
                          lower_bound=1)
_DEV = flags.DEFINE_integer("devices_per_worker", 2, "Simulated CPU devices per worker.",
                            lower_bound=1)
_STORE = flags.DEFINE_string("store", None, "Shared store (path, gs://, s3://).", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Per-worker workdirs (default: STORE/runs).")
_SYNC = flags.DEFINE_enum("sync", "end", list(LOFI_SYNC_MODES), "Lo-Fi schedule.")
_AGG = flags.DEFINE_enum("aggregator", "mean", list(AGGREGATORS),
                         "How the averager reduces the workers' deltas.")
_DRY = flags.DEFINE_bool("dry_run", False, "Print one worker command per TPU VM and exit.")


@exit_on_user_error
def main(argv):
    cli.refuse_device_flag(argv[1:], f"--devices_per_worker={_DEV.value}")
    train_flags = tuple(argv[1:]) + (f"--config.lofi.sync={_SYNC.value}",)
    outer = "diloco" if _SYNC.value == "diloco" else "none"
    if _DRY.value:
        print("\n".join(lofi_vm_commands(_STORE.value, _N.value, train_flags, _AGG.value, outer,
                                         _SYNC.value != "end")))
        return
    check_new_store(_STORE.value)  # never a training workdir; before anything is written
    if "://" not in _STORE.value:  # one paragraph here, not one from every worker
        locations.make_local_dir(_STORE.value, "--store")
    job = LofiJob(_STORE.value, _N.value, _DEV.value, train_flags,
                  _WORKDIR.value or os.path.join(_STORE.value, "runs"), _AGG.value, outer)
    raise SystemExit(run_local(job, periodic=_SYNC.value != "end"))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
