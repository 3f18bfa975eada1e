"""What Lo-Fi moved through the store, next to what data-parallel training would all-reduce,
and the export of the final average as a regular `init_from` source."""

from __future__ import annotations

import numpy as np

from jaxscale.init_from import export_params
from jaxscale.lofi import store as store_lib


def _gib(n: float) -> str:
    return f"{n / 2**30:.4f} GiB"


def store_totals(location: str) -> dict[str, float]:
    """Bytes of all committed pushes and averages, and the DDP equivalent for the same steps."""
    store = store_lib.Store(location)
    pushed = averaged = param_bytes = 0
    workers = store_lib.worker_checkpoints(store)
    max_step = 0
    for w, steps in workers.items():
        for step in steps:
            ckpt = store_lib.load_checkpoint(store, store_lib.worker_prefix(w, step))
            pushed += _stored_bytes(ckpt)
            max_step = max(max_step, step)
    for r in store_lib.average_rounds(store):
        ckpt = store_lib.load_checkpoint(store, store_lib.average_prefix(r))
        averaged += _stored_bytes(ckpt)
        param_bytes = _stored_bytes(ckpt)
    n = max(len(workers), 1)
    ddp = 2 * (n - 1) / n * param_bytes * max_step * n  # ring all-reduce, every step, all workers
    return {"workers": n, "steps": max_step, "pushed": pushed, "averaged": averaged,
            "ddp_allreduce": ddp}


def _stored_bytes(ckpt: store_lib.Checkpoint) -> int:
    total = 0
    for e in ckpt.leaves.values():
        n = int(np.prod(e["shape"]))
        total += n if e["encoding"] == "q8delta" else n * np.dtype(
            store_lib._DTYPES.get(e["dtype"], e["dtype"])).itemsize
    return total


def accounting_lines(location: str) -> list[str]:
    t = store_totals(location)
    lofi = t["pushed"] + t["averaged"] * t["workers"]  # each worker reads each average once
    ratio = t["ddp_allreduce"] / lofi if lofi else float("inf")
    return [f"communication: {t['workers']} workers, {t['steps']} steps",
            f"  Lo-Fi pushes {_gib(t['pushed'])} + averages read {_gib(t['averaged'] * t['workers'])}",
            f"  data-parallel all-reduce of the same steps: {_gib(t['ddp_allreduce'])} "
            f"(2(N-1)/N x gradient bytes per step per worker) -> {ratio:,.0f}x more"]


def export_final(location: str, directory: str) -> str:
    store = store_lib.Store(location)
    ckpt = store_lib.latest_average_checkpoint(store)
    if ckpt is None:
        raise store_lib.StoreError(f"{location}: no complete average to export.")
    meta = {"source_store": location, "round": ckpt.manifest["round"], "step": ckpt.step}
    return export_params(directory, store_lib.read_params(store, ckpt), meta)
