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

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np

from jaxscale import __version__
from jaxscale.config import LOFI_SYNC_MODES
from jaxscale.errors import ConfigError, paragraph
from jaxscale.lofi import fallback
from jaxscale.lofi.aggregate import DILOCO_LR, DILOCO_MOMENTUM
from jaxscale.lofi.lease import claim, release
from jaxscale.lofi.store import worker_prefix, worker_pushes
from jaxscale.lofi.stream import Abort, Drop, RoundInputs, stream_round
from jaxscale.lofi.trust import TrimError, round_step, step_problem, trim_count, worker_weights
from jaxscale.storage.diskfull import disk_full_error, is_disk_full
from jaxscale.storage.lease import DEFAULT_LEASE_S, Renewal, holder
from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import FORMAT, StoreError
from jaxscale.weights.snapshot import (
    LostRace,
    Snapshot,
    average_prefix,
    commit,
    commit_key,
    committed_data,
    load_snapshot,
    write_snapshot,
)

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
    outer_lr: float = DILOCO_LR
    outer_momentum: float = DILOCO_MOMENTUM
    chunk_budget_bytes: int = 64 << 20
    claim_timeout_s: float = DEFAULT_LEASE_S          # the claim lease (renewed while alive)
    clip_iters: int = 3                               # centered_clip iterations
    max_step: int | None = None    # the job's train.steps: a push claiming more is rejected
    batch_size: int | None = None  # the job's per-worker batch: bounds a worker's weight

    def __post_init__(self) -> None:
        problems = [f"{name}={value!r} ({rule})" for name, value, ok, rule in (
            ("min_workers", self.min_workers, self.min_workers >= 1,
             "at least 1: a round needs a contribution"),
            ("max_staleness", self.max_staleness, self.max_staleness >= 0, "0 means no limit"),
            ("outer", self.outer, self.outer in ("none", "diloco"), "'none' or 'diloco'"),
            ("trim", self.trim, 0 <= self.trim < 0.5, "a fraction per end, in [0, 0.5)"),
            ("tau", self.tau, self.tau > 0, "a positive radius"),
            ("trim", self.trim, self.aggregator != "trimmed_mean" or self.trim > 0,
             "trimmed_mean must trim: use --aggregator=mean for an untrimmed mean"),
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
    if not job:  # round 0 published by hand (publish_initial without job settings)
        return {}
    allowed = job.get("allowed_workers")
    ok = (isinstance(job, dict)
          and all(isinstance(job.get(k), int) and job[k] >= 0 for k in JOB_FIELDS[1:])
          and (allowed is None or (isinstance(allowed, list)
                                   and all(isinstance(w, int) for w in allowed)))
          and job.get("sync", "end") in LOFI_SYNC_MODES
          and all(isinstance(job.get(k, 1), int) and job.get(k, 1) > 0
                  for k in ("total_steps", "batch_size")))
    if not ok:
        raise StoreError(f"average/0: the job settings {job!r} are malformed; expected "
                         f"integers for {', '.join(JOB_FIELDS)} and a sync in "
                         f"{LOFI_SYNC_MODES}.")
    settings = {"allowed_workers": tuple(allowed) if allowed is not None else None,
                "min_workers": job["min_workers"], "max_staleness": job["max_staleness"]}
    settings.update({name: job[k] for k, name in (("total_steps", "max_step"),
                                                  ("batch_size", "batch_size")) if k in job})
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
    fallback: str = ""        # what was done about a damaged newest average, if anything

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
            bad_step = step_problem(ckpt.step, cfg.max_step)
            if bad_step:  # an impossible claim: invalid like a corrupt push
                report.skipped[worker] = f"step {step}: {bad_step}"
                continue
            problem = _structure_problem(ckpt, base) or _staleness(ckpt, base, cfg)
            if problem:
                report.skipped[worker] = f"step {step}: {problem}"
            else:
                found[worker] = ckpt
            break
    return found


def run_round(location: str | Store, cfg: AveragerConfig) -> RoundReport:
    """One averaging round; publishes `average/<round>` or says (in `note`) why not. A damaged
    newest average is passed over: the round is built on the newest one that verifies
    (`fallback.py`), and `fallback` says so."""
    store = location if isinstance(location, Store) else Store(location)
    damaged: dict[int, str] = {}
    while True:
        report = RoundReport()
        base, newest = fallback.base_and_damaged(store, damaged)
        if base is None:
            report.note = "no initial average (round 0) yet: start a worker first"
            return report
        round_ = max(newest, int(base.manifest["round"])) + 1
        try:
            _round_on(store, cfg, base, round_, report)
        except fallback.BaseDamaged as e:
            damaged[int(base.manifest["round"])] = str(e)
            continue
        except Exception as e:  # the claim and this attempt's data were released already
            if not is_disk_full(e):
                raise
            raise disk_full_error(store.location, f"averaging round {round_}",
                                  _output_bytes(base, cfg),
                                  f"this averager's attempt under {average_prefix(round_)}/"
                                  ) from None

        if report.published and damaged:
            report.fallback = fallback.note(store, damaged, base, report.used, report.round)
            log.warning("%s", report.fallback)
        return report


def _output_bytes(base: Snapshot, cfg: AveragerConfig) -> int:
    """Bytes a round writes: the average (+ DiLoCo momentum, centered_clip scratch)."""
    values = sum(int(np.prod(e["shape"])) for e in base.leaves.values())
    extra = (cfg.outer == "diloco") + (cfg.aggregator == "centered_clip")
    return values * 4 * (1 + extra)


def _round_on(store: Store, cfg: AveragerConfig, base: Snapshot, round_: int,
              report: RoundReport) -> None:
    """The round `round_` built on `base` (raises BaseDamaged if `base` turns out damaged)."""
    workers = _candidates(store, cfg, base, report)
    if len(workers) < cfg.min_workers or store.read(
            commit_key(average_prefix(round_))) is not None:
        fallback.verify(store, base)  # idle: make sure workers can continue from the base
    if len(workers) < cfg.min_workers:
        report.note = _quorum_note(workers, cfg, base, report)
        return
    if store.read(commit_key(average_prefix(round_))) is not None:
        report.note = _committed_note(store, round_)
        return
    token = claim(store, round_, cfg.claim_timeout_s)
    if token is None:
        report.note = f"round {round_} is being written by another averager"
        return
    data = f"{average_prefix(round_)}/d{holder(token)[:16]}"
    try:
        with Renewal(store, f"{average_prefix(round_)}/CLAIM", holder(token), cfg.claim_timeout_s):
            _publish_until_quorum(store, round_, base, workers, cfg, report, data)
    except fallback.BaseDamaged:
        raise
    except (Abort, StoreError, TrimError) as e:
        report.note = str(e)
        _warn_once(f"round {round_} not published: {e}")
    finally:
        if not report.published:
            release(store, round_, token, data)
        report.bytes_read, report.bytes_written = store.bytes_read, store.bytes_written


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """Logs a refusal once per averager process (a watching averager retries every poll)."""
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


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
                "step": round_step([c.step for c in workers.values()]),
                "samples_seen": int(sum(worker_weights(list(workers.values()), cfg.batch_size))),
                **_trimmed(cfg, len(workers), round_),
                "aggregator": cfg.aggregator, "outer": cfg.outer,
                "io": {"bytes_read": store.bytes_read - read0,
                       "bytes_written": store.bytes_written - written0},
                "contributors": contributors, "leaves": leaves}
    if not commit(store, prefix, manifest) and committed_data(store, prefix) != manifest["data"]:
        raise Abort(f"round {round_} was committed by another averager first; this one's "
                    "data was discarded")
    report.round, report.used = round_, {w: c.step for w, c in workers.items()}
    try:  # published: the scratch space is garbage now, its removal merely tidy
        store.delete_prefix(f"{data}/scratch")
    except Exception as e:  # never fail (or unpublish) a committed round
        log.warning("round %d: could not remove %s/scratch (%s)", round_, data, e)


def _trimmed(cfg: AveragerConfig, n: int, round_: int) -> dict:
    """The round's record of what trimmed_mean dropped (also logged)."""
    if cfg.aggregator != "trimmed_mean":
        return {}
    k = trim_count(n, cfg.trim)
    log.info("round %d: trimmed_mean dropped the %d lowest and %d highest of %d values per "
             "coordinate", round_, k, k, n)
    return {"trimmed": {"per_side": k, "of": n}}


@dataclass(frozen=True)
class Average:
    """What a worker loads: the round, the step it covers and flat float arrays."""

    round: int
    step: int
    params: dict[str, np.ndarray]


def latest_average(location: str | Store) -> Average | None:
    """The newest average that verifies (a damaged newer one is warned about, passed over)."""
    store = location if isinstance(location, Store) else Store(location)
    found = fallback.readable_average(store)
    if found is None:
        return None
    ckpt, params = found
    return Average(int(ckpt.manifest["round"]), ckpt.step, params)


def describe(report: RoundReport) -> str:
    if not report.published:
        lines = [f"no round published: {report.note}"]
    else:
        used = ", ".join(f"w{w}@{s}" for w, s in sorted(report.used.items()))
        lines = [f"round {report.round}: averaged {used}"]
        lines += [f"  fallback: {report.fallback}"] if report.fallback else []
    lines += [f"  skipped w{w}: {why}" for w, why in sorted(report.skipped.items())]
    return "\n".join(lines)
