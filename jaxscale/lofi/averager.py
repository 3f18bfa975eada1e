"""The averager: decides what each averaging round uses, has `stream.py` compute it, publishes.

A round uses, for each allowed worker, its newest committed push made since the previous round
(at least `min_workers` of them, else nothing is published). Each contribution is validated
(structure, shapes, dtypes, staleness) before any data is read; chunks are checked against their
crc32c (by tensorstore) and for non-finite values while streaming, and a worker failing either is dropped and
the round restarted without it. Deltas from the previous average are reduced in float32 by the
chosen aggregator, one block of at most `chunk_budget_bytes` at a time (see `stream.py`), so peak
memory does not grow with model size. Round 0 is the initial weights (and the job's quorum
settings), published by the first worker to start. A claim key makes racing averagers publish a
round once; the claim and any unpublished data are released in a `finally`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace

import numpy as np

from jaxscale import __version__
from jaxscale.config import LOFI_SYNC_MODES
from jaxscale.errors import ConfigError, paragraph
from jaxscale.lofi.manifest import FORMAT
from jaxscale.lofi.stream import Abort, Drop, RoundInputs, stream_round
from jaxscale.lofi.store import (LostRace, Snapshot, Store, StoreError, average_prefix, commit,
                                 commit_key, committed_data, latest_average_snapshot, load_snapshot,
                                 read_params, worker_pushes, worker_prefix,
                                 write_snapshot)

log = logging.getLogger("jaxscale.lofi")
JOB_FIELDS = ("allowed_workers", "min_workers", "max_staleness")


@dataclass(frozen=True)
class AveragerConfig:
    aggregator: str = "mean"
    trim: float = 0.2
    tau: float = 1.0
    min_workers: int = 1
    allowed_workers: tuple[int, ...] | None = None   # None: everyone
    max_staleness: int = 0        # rounds between a push's synced average and the base; 0 = any
    outer: str = "none"                               # or "diloco"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    chunk_budget_bytes: int = 64 << 20
    claim_timeout_s: float = 900.0                    # a dead averager's claim expires after
    clip_iters: int = 3                               # centered_clip iterations

    def __post_init__(self) -> None:
        problems = [f"{name}={value!r} ({rule})" for name, value, ok, rule in (
            ("min_workers", self.min_workers, self.min_workers >= 1,
             "at least 1: a round needs a contribution"),
            ("max_staleness", self.max_staleness, self.max_staleness >= 0, "0 means no limit"),
            ("outer", self.outer, self.outer in ("none", "diloco"), "'none' or 'diloco'"),
            ("trim", self.trim, 0 <= self.trim < 0.5, "a fraction per end, in [0, 0.5)"),
            ("tau", self.tau, self.tau > 0, "a positive radius"),
            ("chunk_budget_bytes", self.chunk_budget_bytes, self.chunk_budget_bytes > 0,
             "positive")) if not ok]
        if problems:
            raise ConfigError(paragraph(
                f"Averager setting {'; '.join(problems)} is invalid. Fix the flag",
                "(--min_workers, --max_staleness, --outer, --trim, --tau, --chunk_budget_mb) or,",
                "for a default taken from the store, the workers' config.lofi.",
            ))

    def with_job(self, store: Store, explicit: frozenset[str] = frozenset()) -> "AveragerConfig":
        """Fills `allowed_workers`, `min_workers`, `max_staleness` and `outer` (DiLoCo's outer
        optimizer for a `sync=diloco` job) from the job settings the first worker recorded with
        round 0 (its `config.lofi`), except fields in `explicit` (given on the command line)."""
        job = job_settings(store)
        return replace(self, **{k: v for k, v in job.items() if k not in explicit})


def job_settings(store: Store) -> dict:
    """The `config.lofi` quorum settings (and the outer optimizer its `sync` implies) recorded
    in round 0 ({} if none; stores from before `sync` was recorded give no `outer`)."""
    try:
        job = load_snapshot(store, average_prefix(0)).manifest.get("job") or {}
    except StoreError:
        return {}
    allowed = job.get("allowed_workers")
    ok = (isinstance(job, dict)
          and all(isinstance(job.get(k), int) and job[k] >= 0 for k in JOB_FIELDS[1:])
          and (allowed is None or (isinstance(allowed, list)
                                   and all(isinstance(w, int) for w in allowed)))
          and job.get("sync", "end") in LOFI_SYNC_MODES)
    if not ok:
        raise StoreError(f"average/0: the job settings {job!r} are malformed; expected "
                         f"integers for {', '.join(JOB_FIELDS)} and a sync in "
                         f"{LOFI_SYNC_MODES}.")
    settings = {"allowed_workers": tuple(allowed) if allowed is not None else None,
                "min_workers": job["min_workers"], "max_staleness": job["max_staleness"]}
    if "sync" in job:
        settings["outer"] = "diloco" if job["sync"] == "diloco" else "none"
    return settings


def parse_allowed(text: str, num_workers: int) -> tuple[int, ...]:
    """`config.lofi.allowed_workers` ('0,2,5'; empty: 0..num_workers-1) as a tuple of ids."""
    try:
        ids = tuple(int(w) for w in str(text).split(",") if w.strip())
    except ValueError:
        raise ConfigError(f"lofi.allowed_workers={text!r}: give comma-separated worker ids, "
                          "e.g. '0,1,3'.") from None
    return ids or tuple(range(num_workers))


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


def publish_initial(store: Store, params: dict, step: int = 0, job: dict | None = None) -> bool:
    """Round 0 = the initial weights (and the job's quorum settings); the first worker to
    commit it wins, later ones find it and continue from it. No claim: a worker killed while
    publishing leaves only its own uncommitted attempt, which the next worker ignores."""
    if store.read(commit_key(average_prefix(0))) is not None:
        return False
    meta = {"kind": "average", "round": 0, "step": step, "samples_seen": 0, "contributors": {}}
    try:  # several first workers may race: each writes its own attempt, one commits
        write_snapshot(store, average_prefix(0), params,
                         {**meta, **({"job": job} if job else {})}, exclusive=True)
    except LostRace:
        return False
    return True


def _structure_problem(ckpt: Snapshot, base: Snapshot) -> str | None:
    mine, ref = ckpt.leaves, base.leaves
    if set(mine) != set(ref):
        extra, missing = sorted(set(mine) - set(ref)), sorted(set(ref) - set(mine))
        return f"tree differs from the average: extra leaves {extra[:3]}, missing {missing[:3]}"
    for leaf, e in sorted(mine.items()):
        if e["shape"] != ref[leaf]["shape"] or e["dtype"] != ref[leaf]["dtype"]:
            return (f"leaf {leaf} has shape {e['shape']} dtype {e['dtype']}, the average has "
                    f"{ref[leaf]['shape']} {ref[leaf]['dtype']}")
    return None


def _staleness(ckpt: Snapshot, base: Snapshot, cfg: AveragerConfig) -> str | None:
    """Rounds between the average the push continued from and the base of this round."""
    behind = int(base.manifest["round"]) - int(ckpt.manifest.get("synced_round") or 0)
    if cfg.max_staleness and behind > cfg.max_staleness:
        return (f"stale: step {ckpt.step} continued from average round "
                f"{ckpt.manifest.get('synced_round') or 0}, {behind} rounds behind the base "
                f"round {base.manifest['round']} (max_staleness={cfg.max_staleness})")
    return None


def _candidates(store: Store, cfg: AveragerConfig, base: Snapshot,
                report: RoundReport) -> dict[int, Snapshot]:
    """Each allowed worker's newest valid, fresh push made since the previous round."""
    used_before = {int(k): v for k, v in base.manifest.get("contributors", {}).items()}
    found: dict[int, Snapshot] = {}
    for worker, steps in worker_pushes(store).items():
        if cfg.allowed_workers is not None and worker not in cfg.allowed_workers:
            report.skipped[worker] = "not in allowed_workers"
            continue
        fresh = [s for s in steps if s > used_before.get(worker, -1)]
        for step in reversed(fresh):  # newest complete first
            try:
                ckpt = load_snapshot(store, worker_prefix(worker, step))
            except StoreError as e:
                report.skipped[worker] = str(e)
                continue
            problem = _structure_problem(ckpt, base) or _staleness(ckpt, base, cfg)
            if problem:
                report.skipped[worker] = f"step {step}: {problem}"
            else:
                found[worker] = ckpt
            break
    return found


def _claim(store: Store, round_: int, timeout_s: float) -> bytes | None:
    """Claims a round so racing averagers publish it only once; returns the claim's token.

    The claim is a create-if-absent key holding a token and its time; a claim older than
    `timeout_s` whose round never committed (its averager died) is taken over by
    compare-and-swap. Nothing of the dead averager is deleted: a presumed-dead averager that
    wakes up cannot damage the round either, since each attempt writes only its own directory
    and the single create-if-absent COMMIT decides which attempt is the round.
    """
    key = f"{average_prefix(round_)}/CLAIM"
    token = json.dumps({"time": time.time(), "token": uuid.uuid4().hex}).encode()
    if store.write(key, token, if_absent=True):
        return token
    value, generation = store.read_stamped(key)
    try:
        age = time.time() - float(json.loads(value or b"{}").get("time", 0))
    except (ValueError, AttributeError):
        age = float("inf")
    if store.read(commit_key(average_prefix(round_))) is not None or age < timeout_s:
        return None
    log.warning("taking over round %d from an averager that stopped %.0fs ago", round_, age)
    if not store.write(key, token, if_generation=generation):
        return None
    return token


def _release(store: Store, round_: int, token: bytes, data: str) -> None:
    """Drops this averager's unpublished data and its claim (only if still ours). Data that
    the round's COMMIT names is never dropped, whatever interrupted this averager after it."""
    if committed_data(store, average_prefix(round_)) != data.rsplit("/", 1)[1]:
        store.delete_prefix(data)
    key = f"{average_prefix(round_)}/CLAIM"
    value, generation = store.read_stamped(key)
    if value == token:
        store.kv.write(key, None, if_equal=generation).result()


def run_round(location: str | Store, cfg: AveragerConfig) -> RoundReport:
    """One averaging round; publishes `average/<round>` or says (in `note`) why not."""
    store = location if isinstance(location, Store) else Store(location)
    report = RoundReport()
    base = latest_average_snapshot(store)
    if base is None:
        report.note = "no initial average (round 0) yet: start a worker first"
        return report
    workers = _candidates(store, cfg, base, report)
    round_ = int(base.manifest["round"]) + 1
    if len(workers) < cfg.min_workers:
        report.note = _quorum_note(workers, cfg, base, report)
        return report
    if store.read(commit_key(average_prefix(round_))) is not None:
        report.note = _committed_note(store, round_)
        return report
    token = _claim(store, round_, cfg.claim_timeout_s)
    if token is None:
        report.note = f"round {round_} is being written by another averager"
        return report
    data = f"{average_prefix(round_)}/d{json.loads(token)['token'][:16]}"
    try:
        _publish_until_quorum(store, round_, base, workers, cfg, report, data)
    except (Abort, StoreError) as e:
        report.note = str(e)
    finally:
        if not report.published:
            _release(store, round_, token, data)
        report.bytes_read, report.bytes_written = store.bytes_read, store.bytes_written
    return report


def _committed_note(store: Store, round_: int) -> str:
    """Why a round whose COMMIT exists is not published again: just published by another
    averager, or committed but corrupt (then no later round can build on it: say so)."""
    try:
        load_snapshot(store, average_prefix(round_))
        return f"round {round_} was just published by another averager"
    except StoreError as e:
        return (f"average/{round_} is committed but does not verify ({e}), so no later round "
                f"can build on it: inspect it, then delete commits/average/{round_} and "
                f"average/{round_}/ to republish it from the workers' pushes")


def _quorum_note(workers: dict, cfg: AveragerConfig, base: Snapshot,
                 report: RoundReport) -> str:
    if not workers and not report.skipped:  # e.g. a last `--final` run: nothing is lost
        return f"nothing new: no complete push since round {base.manifest['round']}"
    return (f"only {len(workers)} new complete contribution(s), fewer than "
            f"min_workers={cfg.min_workers}; nothing published")


def _publish_until_quorum(store: Store, round_: int, base: Snapshot,
                          workers: dict[int, Snapshot], cfg: AveragerConfig,
                          report: RoundReport, data: str) -> None:
    """Publishes, dropping workers found corrupt or non-finite while streaming."""
    while True:
        if len(workers) < cfg.min_workers:
            report.note = _quorum_note(workers, cfg, base, report)
            return
        try:
            _publish(store, round_, base, workers, cfg, report, data)
            return
        except Drop as drop:
            report.skipped[drop.worker] = drop.reason
            del workers[drop.worker]


def _publish(store: Store, round_: int, base: Snapshot, workers: dict[int, Snapshot],
             cfg: AveragerConfig, report: RoundReport, data: str) -> None:
    read0, written0 = store.bytes_read, store.bytes_written
    leaves = stream_round(RoundInputs(store, base, dict(workers), cfg, data))
    prefix = average_prefix(round_)
    contributors = {**base.manifest.get("contributors", {}),
                    **{str(w): c.step for w, c in workers.items()}}
    manifest = {"format": FORMAT, "jaxscale_version": __version__, "created": time.time(),
                "chunk": store.chunk, "kind": "average", "round": round_,
                "base_round": base.manifest["round"],
                "data": data.rsplit("/", 1)[1],
                "step": max(c.step for c in workers.values()),
                "samples_seen": sum(c.manifest["samples_seen"] for c in workers.values()),
                "aggregator": cfg.aggregator, "outer": cfg.outer,
                "io": {"bytes_read": store.bytes_read - read0,
                       "bytes_written": store.bytes_written - written0},
                "contributors": contributors, "leaves": leaves}
    if not commit(store, prefix, manifest):
        raise Abort(f"round {round_} was committed by another averager first; this one's "
                    "data was discarded")
    report.round, report.used = round_, {w: c.step for w, c in workers.items()}
    try:  # published: the scratch space is garbage now, its removal merely tidy
        store.delete_prefix(f"{data}/scratch")
    except Exception as e:  # noqa: BLE001 - never fail (or unpublish) a committed round
        log.warning("round %d: could not remove %s/scratch (%s)", round_, data, e)


@dataclass(frozen=True)
class Average:
    """What a worker loads: the round, the step it covers and flat float arrays."""

    round: int
    step: int
    params: dict[str, np.ndarray]


def latest_average(location: str | Store) -> Average | None:
    store = location if isinstance(location, Store) else Store(location)
    ckpt = latest_average_snapshot(store)
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
