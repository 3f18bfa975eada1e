"""What Lo-Fi moved through the store, next to what data-parallel training would all-reduce,
and the export of the final average as a regular jaxscale checkpoint directory.

Workers record their real store traffic in `STORE/stats/workers/<id>.json` at the end of their
run; each published round records the averager's traffic in its manifest (`io`). Data-parallel
training of the same steps would all-reduce 2(N-1)/N x gradient bytes per step per worker (ring
all-reduce), so the ratio grows linearly with the number of steps between exchanges.
"""

from __future__ import annotations

import json

import numpy as np

from jaxscale.lofi import store as store_lib
from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import DTYPES, StoreError
from jaxscale.weights.snapshot import (
    Snapshot,
    average_prefix,
    average_rounds,
    latest_average_snapshot,
    load_snapshot,
    read_params,
)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _stored_and_raw(ckpt: Snapshot) -> tuple[int, int]:
    """(bytes stored, bytes the same leaves take uncompressed)."""
    stored = raw = 0
    for e in ckpt.leaves.values():
        n = int(np.prod(e["shape"]))
        full = n * np.dtype(DTYPES[e["dtype"]]).itemsize
        raw += full
        stored += n + 4 * -(-n // 256) if e["encoding"] == "q8delta" else full
    return stored, raw


def _worker_stats(store: Store) -> dict[int, dict]:
    out = {}
    for key in store.keys("stats/workers/"):
        try:
            stats = json.loads(store.read(key) or b"{}")
            out[int(stats["worker_id"])] = {k: int(stats[k]) for k in
                                            ("bytes_written", "bytes_read", "step")}
        except (ValueError, KeyError, TypeError, StoreError):
            continue  # a damaged stats file only loses accounting, never data
    return out


def _loadable(store: Store, prefix: str) -> Snapshot | None:
    """The checkpoint, or None where the rounds skip it (corrupt, partial): the accounting
    counts what was exchanged and never fails a run that already published."""
    try:
        return load_snapshot(store, prefix)
    except StoreError:
        return None


def store_totals(location: str) -> dict[str, float]:
    """Bytes pushed / averaged / really moved, and the data-parallel equivalent."""
    store = Store(location)
    t = dict(pushed=0, pushed_raw=0, averaged=0, averager_io=0, worker_io=0, param_bytes=0)
    last_step: dict[int, int] = {}
    pushed_by: dict[int, int] = {}
    for w, steps in store_lib.worker_pushes(store).items():
        for step in steps:
            ckpt = _loadable(store, store_lib.worker_prefix(w, step))
            if ckpt is None:
                continue
            stored, raw = _stored_and_raw(ckpt)
            pushed_by[w] = pushed_by.get(w, 0) + stored
            t["pushed_raw"] += raw
            last_step[w] = step
    t["pushed"] = sum(pushed_by.values())
    for r in average_rounds(store):
        ckpt = _loadable(store, average_prefix(r))
        if ckpt is None:
            continue
        t["param_bytes"] = _stored_and_raw(ckpt)[1]
        t["averaged"] += t["param_bytes"]
        io = ckpt.manifest.get("io") or {}
        t["averager_io"] += sum(int(io.get(k, 0)) for k in ("bytes_read", "bytes_written"))
    stats = _worker_stats(store)
    for w in last_step:  # without stats (still running): its pushes + one read per average
        s = stats.get(w)
        t["worker_io"] += (s["bytes_written"] + s["bytes_read"] if s
                           else pushed_by[w] + t["averaged"])
    n = max(len(last_step), 1)
    t.update(workers=n, steps=max(last_step.values(), default=0),
             ddp_allreduce=2 * (n - 1) / n * t["param_bytes"] * sum(last_step.values()))
    t["lofi_total"] = t["worker_io"] + t["averager_io"]
    return t


def accounting_lines(location: str) -> list[str]:
    t = store_totals(location)
    ratio = t["ddp_allreduce"] / t["lofi_total"] if t["lofi_total"] else float("inf")
    lines = [f"communication: {t['workers']} worker(s), up to {t['steps']} steps each",
             f"  workers wrote+read {_mib(t['worker_io'])}; averager read+wrote "
             f"{_mib(t['averager_io'])}; Lo-Fi total {_mib(t['lofi_total'])}",
             f"  data-parallel all-reduce of the same steps: {_mib(t['ddp_allreduce'])} "
             f"(2(N-1)/N x {_mib(t['param_bytes'])} gradient per step per worker) -> "
             f"{ratio:,.1f}x the Lo-Fi bytes"]
    if t["pushed"] < t["pushed_raw"]:
        saved = t["pushed_raw"] - t["pushed"]
        lines.append(f"  compression: pushes stored {_mib(t['pushed'])} instead of "
                     f"{_mib(t['pushed_raw'])} (saved {_mib(saved)}, "
                     f"{100 * saved / t['pushed_raw']:.0f}%)")
    return lines


def export_final(location: str, directory: str) -> str:
    """Writes DIR/params/ (read by `launch.train --config.init_from=DIR`) and DIR/config.json
    (the workers' resolved config, so `launch.evaluate --workdir=DIR` and `launch.convert
    --from_workdir=DIR` can rebuild the model)."""
    from jaxscale.weights.init_from import export_params

    check_final_dir(directory)
    store = Store(location)
    ckpt = latest_average_snapshot(store)
    if ckpt is None:
        raise StoreError(f"{location}: no complete average to export; run workers "
                                   "and at least one averaging round first.")
    meta = {"source_store": location, "round": ckpt.manifest["round"], "step": ckpt.step}
    export_params(directory, read_params(store, ckpt), meta)
    config = store.read("config.json")
    if config is not None:
        Store(directory).write("config.json", config)
    return directory


FINAL_ENTRIES = {"params", "commits", "config.json"}  # what `export_final` writes


def check_final_dir(directory: str) -> None:
    """`--final` writes into an empty directory or over an earlier export (a rerun of the
    job), never over anything else: a training workdir's config.json would be replaced."""
    foreign = sorted(store_lib.top_level_names(directory) - FINAL_ENTRIES)
    if foreign:
        from jaxscale.errors import paragraph
        raise StoreError(paragraph(
            f"--final={directory} holds {', '.join(foreign[:5])}{', ...' if foreign[5:] else ''},",
            "which an export of the average does not write (a training workdir?): its",
            "config.json would be replaced. Give a new or empty directory, or an earlier",
            "--final export. Nothing was written.",
        ))
