"""Averaging rounds: pick workers' newest complete pushes, stream them chunk by chunk, publish.

A round uses, for each allowed worker, its newest committed push made since the previous round
(at least `min_workers` of them, else nothing is published). Each contribution is validated
(structure, shapes, dtypes, staleness) before any data is read; chunks are checked against their
checksums and for non-finite values while streaming, and a worker failing either is dropped and
the round restarted without it. Deltas from the previous average are reduced in float32 by the
chosen aggregator, one block of at most `chunk_budget_bytes` at a time, so peak memory does not
grow with model size. Round 0 is the initial weights, published by the first worker to start.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from jaxscale.errors import paragraph
from jaxscale.lofi import aggregate
from jaxscale.lofi.store import (CHUNK, Checkpoint, Store, StoreError, _sha, _write_leaf,
                                 average_prefix, load_checkpoint,
                                 latest_average_checkpoint, read_params, read_range,
                                 worker_checkpoints, worker_prefix, write_checkpoint)
from jaxscale import __version__

log = logging.getLogger("jaxscale.lofi")


@dataclass(frozen=True)
class AveragerConfig:
    aggregator: str = "mean"
    trim: float = 0.2
    tau: float = 1.0
    min_workers: int = 1
    allowed_workers: tuple[int, ...] | None = None   # None: everyone
    max_staleness: int = 0                            # steps behind the newest; 0 = no limit
    outer: str = "none"                               # or "diloco"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    chunk_budget_bytes: int = 64 << 20
    claim_timeout_s: float = 900.0                    # a dead averager's claim expires after


@dataclass
class RoundReport:
    round: int | None = None
    used: dict[int, int] = field(default_factory=dict)      # worker -> step
    skipped: dict[int, str] = field(default_factory=dict)   # worker -> reason
    bytes_read: int = 0
    bytes_written: int = 0
    note: str = ""

    @property
    def published(self) -> bool:
        return self.round is not None and not self.note


class _Drop(Exception):
    def __init__(self, worker: int, reason: str):
        super().__init__(reason)
        self.worker, self.reason = worker, reason


def publish_initial(store: Store, params: dict, step: int = 0) -> bool:
    """Round 0 = the initial weights; the first worker to start wins the claim."""
    if not store.write(f"{average_prefix(0)}/CLAIM", b"init", if_absent=True):
        return False
    write_checkpoint(store, average_prefix(0), params,
                     {"kind": "average", "round": 0, "step": step, "samples_seen": 0,
                      "contributors": {}})
    return True


def _structure_problem(ckpt: Checkpoint, base: Checkpoint) -> str | None:
    mine, ref = ckpt.leaves, base.leaves
    if set(mine) != set(ref):
        extra, missing = sorted(set(mine) - set(ref)), sorted(set(ref) - set(mine))
        return f"tree differs from the average: extra leaves {extra[:3]}, missing {missing[:3]}"
    for leaf, e in mine.items():
        if e["shape"] != ref[leaf]["shape"] or e["dtype"] != ref[leaf]["dtype"]:
            return (f"leaf {leaf} has shape {e['shape']} dtype {e['dtype']}, the average has "
                    f"{ref[leaf]['shape']} {ref[leaf]['dtype']}")
    return None


def _candidates(store: Store, cfg: AveragerConfig, base: Checkpoint,
                report: RoundReport) -> dict[int, Checkpoint]:
    """Each allowed worker's newest valid push made since the previous round."""
    used_before = {int(k): v for k, v in base.manifest.get("contributors", {}).items()}
    found: dict[int, Checkpoint] = {}
    for worker, steps in worker_checkpoints(store).items():
        if cfg.allowed_workers is not None and worker not in cfg.allowed_workers:
            report.skipped[worker] = "not in allowed_workers"
            continue
        fresh = [s for s in steps if s > used_before.get(worker, -1)]
        for step in reversed(fresh):  # newest complete first
            try:
                ckpt = load_checkpoint(store, worker_prefix(worker, step))
            except StoreError as e:
                report.skipped[worker] = str(e)
                continue
            problem = _structure_problem(ckpt, base)
            if problem:
                report.skipped[worker] = f"step {step}: {problem}"
            else:
                found[worker] = ckpt
            break
    newest = max([c.step for c in found.values()] + [base.step])
    for worker, ckpt in list(found.items()):
        if cfg.max_staleness and newest - ckpt.step > cfg.max_staleness:
            report.skipped[worker] = (f"stale: step {ckpt.step} is more than max_staleness="
                                      f"{cfg.max_staleness} steps behind step {newest}")
            del found[worker]
    return found


def _claim(store: Store, round_: int, timeout_s: float) -> bool:
    """Claims the round after the newest average, so racing averagers publish it only once.

    The claim is a create-if-absent key holding its time; a claim older than `timeout_s` whose
    round never committed (its averager died) is taken over by compare-and-swap.
    """
    key = f"{average_prefix(round_)}/CLAIM"
    if store.write(key, str(time.time()).encode(), if_absent=True):
        return True
    value, generation = store.read_stamped(key)
    try:
        age = time.time() - float(value or b"0")
    except ValueError:
        age = float("inf")
    committed = store.read(f"{average_prefix(round_)}/COMMIT") is not None
    if committed or age < timeout_s:
        return False
    log.warning("taking over round %d from an averager that stopped %.0fs ago", round_, age)
    return store.write(key, str(time.time()).encode(), if_generation=generation)


def _block_size(n_workers: int, budget: int) -> int:
    per_value = 4 * (2 * n_workers + 4)  # f32 inputs, deltas, base, output, momentum
    return max(CHUNK, (budget // per_value) // CHUNK * CHUNK)


def _reduce_leaf(store: Store, leaf: str, base: Checkpoint, workers: dict[int, Checkpoint],
                 cfg: AveragerConfig, out_prefix: str, dtype: str) -> dict:
    """Streams one leaf through the aggregator; writes output (and momentum) chunk by chunk."""
    reducer = aggregate.get_aggregator(cfg.aggregator)
    outer = aggregate.OuterSGD(cfg.outer_lr, cfg.outer_momentum) if cfg.outer == "diloco" else None
    size = int(np.prod(base.leaves[leaf]["shape"]))
    ids = sorted(workers)
    weights = np.array([workers[w].manifest["samples_seen"] or 1 for w in ids], np.float64)
    out = store.array(f"{out_prefix}/arrays/{leaf}", size, dtype)
    mom_out = store.array(f"{out_prefix}/momentum/{leaf}", size, "float32") if outer else None
    sums, mom_sums, block = [], [], _block_size(len(ids), cfg.chunk_budget_bytes)
    for a in range(0, max(size, 1), block):
        b = min(a + block, size)
        base_blk = read_range(store, base, leaf, a, b)
        rows = []
        for w in ids:
            try:
                rows.append(read_range(store, workers[w], leaf, a, b) - base_blk)
            except StoreError as e:
                raise _Drop(w, str(e)) from None
        deltas = np.stack(rows)
        bad = ~aggregate.finite_rows(deltas)
        if bad.any():
            w = ids[int(np.argmax(bad))]
            raise _Drop(w, f"non-finite values in leaf {leaf} (values {a}..{b})")
        delta = reducer(deltas, weights, trim=cfg.trim, tau=cfg.tau)
        if outer:
            momentum = _previous_momentum(store, base, leaf, a, b)
            new, m = outer.step(base_blk, delta, momentum)
            mom_out[a:b] = m
            mom_sums += _chunk_sums(m)
        else:
            new = base_blk + delta
        values = new.astype(out.dtype.numpy_dtype)
        out[a:b] = values
        store.bytes_written += values.nbytes + (new.nbytes if outer else 0)
        sums += _chunk_sums(values)
    entry = {"shape": base.leaves[leaf]["shape"], "dtype": dtype, "encoding": "raw",
             "checksums": sums}
    return {**entry, "momentum_checksums": mom_sums} if outer else entry


def _chunk_sums(values: np.ndarray) -> list[str]:
    return [_sha(np.ascontiguousarray(values[i:i + CHUNK]).tobytes())
            for i in range(0, max(len(values), 1), CHUNK)]


def _previous_momentum(store: Store, base: Checkpoint, leaf: str, a: int, b: int) -> np.ndarray:
    entry = base.leaves[leaf]
    if "momentum_checksums" not in entry:
        return np.zeros(b - a, np.float32)
    arr = store.array(f"{base.prefix}/momentum/{leaf}")
    return np.asarray(arr[a:b].read().result(), np.float32)


def run_round(location: str | Store, cfg: AveragerConfig) -> RoundReport:
    """One averaging round; publishes `average/<round>` or says (in `note`) why not."""
    store = location if isinstance(location, Store) else Store(location)
    report = RoundReport()
    base = latest_average_checkpoint(store)
    if base is None:
        report.note = "no initial average (round 0) yet: start a worker first"
        return report
    workers = _candidates(store, cfg, base, report)
    round_ = int(base.manifest["round"]) + 1
    claimed = False
    while True:
        if len(workers) < cfg.min_workers:
            report.note = (f"only {len(workers)} new complete contribution(s), fewer than "
                           f"min_workers={cfg.min_workers}; nothing published")
            break
        if not claimed and not _claim(store, round_, cfg.claim_timeout_s):
            report.note = f"round {round_} is being written by another averager"
            break
        claimed = True
        try:
            _publish(store, round_, base, workers, cfg, report)
            break
        except _Drop as drop:  # corrupt or non-finite data found while streaming
            report.skipped[drop.worker] = drop.reason
            del workers[drop.worker]
    if claimed and not report.published:
        store.kv.write(f"{average_prefix(round_)}/CLAIM", None).result()  # release
    report.bytes_read, report.bytes_written = store.bytes_read, store.bytes_written
    return report


def _publish(store: Store, round_: int, base: Checkpoint, workers: dict[int, Checkpoint],
             cfg: AveragerConfig, report: RoundReport) -> None:
    prefix = average_prefix(round_)
    leaves = {leaf: _reduce_leaf(store, leaf, base, workers, cfg, prefix, e["dtype"])
              for leaf, e in base.leaves.items()}
    contributors = {**base.manifest.get("contributors", {}),
                    **{str(w): c.step for w, c in workers.items()}}
    manifest = {"format": 1, "jaxscale_version": __version__, "created": time.time(),
                "kind": "average", "round": round_, "base_round": base.manifest["round"],
                "step": max(c.step for c in workers.values()),
                "samples_seen": sum(c.manifest["samples_seen"] for c in workers.values()),
                "aggregator": cfg.aggregator, "outer": cfg.outer,
                "contributors": contributors, "leaves": leaves}
    data = json.dumps(manifest, sort_keys=True).encode()
    store.write(f"{prefix}/manifest.json", data)
    store.write(f"{prefix}/COMMIT", _sha(data).encode())
    report.round, report.used = round_, {w: c.step for w, c in workers.items()}


@dataclass(frozen=True)
class Average:
    """What a worker loads: the round, the step it covers and flat float arrays."""

    round: int
    step: int
    params: dict[str, np.ndarray]


def latest_average(location: str | Store) -> Average | None:
    store = location if isinstance(location, Store) else Store(location)
    ckpt = latest_average_checkpoint(store)
    if ckpt is None:
        return None
    return Average(int(ckpt.manifest["round"]), ckpt.step, read_params(store, ckpt))


def describe(report: RoundReport) -> str:
    if not report.published:
        lines = [f"no round published: {report.note}"]
    else:
        used = ", ".join(f"w{w}@{s}" for w, s in sorted(report.used.items()))
        lines = [f"round {report.round}: averaged {used}"]
    lines += [f"  skipped w{w}: {why}" for w, why in sorted(report.skipped.items())]
    return "\n".join(lines)
