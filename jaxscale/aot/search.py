"""The planner's search: compile candidates in worker processes, cache each result on disk.

`plan.py` says which candidates exist, in which order, and which cannot win; this module runs
the TPU compiler on them, `workers` at once (a large compile keeps about 1.6 cores busy; a
worker keeps a crashing compile away from the search, and libtpu's process lock is lifted for
compile-only use), keyed on disk by a hash of config, topology and code (`cache_key`) so a
rerun is instant. The result is the same for any number of workers: candidates come back in
search order, and one that an earlier fitting candidate dominates is dropped even if it was
compiling meanwhile.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import glob
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from importlib import metadata

import ml_collections as mlc

from jaxscale.aot.compile import CompilerError, HbmOom, error_signature
from jaxscale.aot.frontier import Frontier
from jaxscale.aot.plan import Candidate, apply
from jaxscale.aot.topology import Topology, compile_only_env
from jaxscale.errors import ConfigError, paragraph
from jaxscale.hardware import HBM_MARGIN

CompileFn = Callable[[str, Topology, str], dict]  # (config JSON, topology, cache dir) -> result
_DIED = "the compiling process died"


def cache_key(config: mlc.ConfigDict, topology: Topology) -> str:
    """Config, topology and `code_version`: a result cached by other code or another compiler
    is not this one's (issue 40: a plan replayed from a cache written before a change to the
    step reported a winner that no longer compiled)."""
    text = json.dumps([config.to_dict(), topology.label(), code_version()], sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@functools.cache
def code_version() -> str:
    """A digest of jaxscale's sources and the versions of jax, jaxlib and libtpu: what besides
    the config decides a compile's result."""
    import jaxscale

    root = os.path.dirname(os.path.abspath(jaxscale.__file__))
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    for package in ("jax", "jaxlib", "libtpu"):
        try:
            digest.update(f"{package}={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package}=none".encode())
    return digest.hexdigest()[:16]


def compile_cached(config_json: str, topology: Topology, cache_dir: str) -> dict:
    """Compile (in this process: the planner runs it in a worker), estimate, cache by
    `cache_key`. Errors come back as one line; an out-of-HBM refusal as a result over HBM."""
    from jaxscale.aot.compile import compile_step
    from jaxscale.aot.report import step_estimate

    config = mlc.ConfigDict(json.loads(config_json))
    path = os.path.join(cache_dir, cache_key(config, topology) + ".json")
    if os.path.exists(path):
        cached = read_cached(path)
        if cached is not None:
            return cached
    try:
        report = compile_step(config, topology)
        result = {**report.to_json(), "estimate": vars(step_estimate(report))}
    except Exception as e:  # a failing candidate is reported, the search goes on
        result = _failure(e, topology)
        if "error" in result:  # not cached: it may be this machine's (memory, a killed worker)
            return result
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # this worker's own: a stopped plan removes its workers'
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)
    return result


def read_cached(path: str) -> dict | None:
    """A cache entry, or None (with a one-line note, so that it is compiled again) when it is
    truncated, not JSON or not a result's shape (a disk filled mid-write, a hand edit)."""
    try:
        with open(path) as f:
            result = json.load(f)
        ok = isinstance(result, dict) and (
            isinstance(result.get("error"), str) or (
                isinstance(result.get("total_bytes"), (int, float))
                and isinstance(result.get("hbm_bytes"), (int, float))
                and ("over_hbm" in result or (
                    isinstance(result.get("estimate"), dict)
                    and isinstance(result["estimate"].get("no_overlap_s"), (int, float))
                    and isinstance(result["estimate"].get("full_overlap_s"), (int, float))))))
        why = "not a compile result" if not ok else ""
    except (OSError, ValueError, UnicodeDecodeError) as e:
        why = f"{type(e).__name__}: {e}"[:120]
    if not why:
        return result
    print(f"jaxscale: note: plan cache entry {path} is unreadable ({why}); compiling that "
          "candidate again.", file=sys.stderr, flush=True)
    return None


def check_cache_dir(cache_dir: str) -> None:
    """The plan cache must be a directory this process can write: one paragraph naming the
    path otherwise (below a regular file, a read-only filesystem), before any compile."""
    probe = os.path.join(cache_dir, f".probe-{os.getpid()}")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(paragraph(
            f"--cache_dir={cache_dir} cannot be written ({e.strerror or e}:",
            f"{e.filename or cache_dir}): a path below a regular file, a read-only filesystem, or no",
            "permission. The plan caches every compile there; give a writable directory",
            "(default ~/.cache/jaxscale/plan).")) from None


def check_margin(margin: float) -> None:
    if not 0.0 <= margin < 1.0:
        raise ConfigError(paragraph(
            f"--hbm_margin={margin}: the fraction of the usable HBM kept free must be in [0, 1)",
            f"(the default {HBM_MARGIN} keeps {HBM_MARGIN:.0%} free; 0 plans to the last byte)."))


class PlanStopped(Exception):
    """SIGTERM (or SIGINT) reached `plan`: its compiling workers were stopped; exit 75."""


def stop_workers(pool: cf.ProcessPoolExecutor, cache_dir: str) -> int:
    """Terminates the pool's compiling processes (a compile can run for minutes) and removes
    the temporary files they were writing, so the cache holds whole entries only; returns how
    many were stopped."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    pool.shutdown(wait=False, cancel_futures=True)
    if manager is not None:  # it reaps the workers too: until it ends, one may look alive
        manager.join(10)
    for proc in procs:
        for tmp in glob.glob(os.path.join(glob.escape(cache_dir), f"*.{proc.pid}.tmp")):
            with contextlib.suppress(OSError):
                os.remove(tmp)
    return len(procs)


def _failure(e: Exception, topology: Topology) -> dict:
    """A compile error as one line; libtpu's out-of-HBM refusal instead becomes a result over
    HBM (its temporaries, a lower bound of the total), so the ranking can say by how much."""
    if isinstance(e, HbmOom):
        return {"total_bytes": e.temp_bytes, "hbm_bytes": topology.chip.hbm_bytes,
                "hbm_limit_bytes": e.available_bytes,  # the compiler's own, from its error
                "over_hbm": "libtpu: CompileTimeHbmOom (temporaries alone)"}
    if isinstance(e, CompilerError):  # the compiler's own line; the settings are the label
        return {"error": e.compiler_line, "signature": e.signature}
    lines = [line for line in str(e).splitlines() if line.strip()]
    error = f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
    return {"error": error, "signature": error_signature(error)}


def search(config: mlc.ConfigDict, topology: Topology, cache_dir: str,
           max_candidates: int = 16, time_budget_s: float = 3600.0, workers: int = 0,
           margin: float = HBM_MARGIN, compile_fn: CompileFn = compile_cached,
           space: Counter | None = None) -> list[tuple[Candidate, dict]]:
    """Compiles candidates in search order, `workers` at once (0: one per two cores), until
    `max_candidates` are kept (failures not counted: they make the frontier skip their
    siblings instead, `frontier.same_error_rules`) or the time budget is spent, then, up to as
    many again, the next
    ones while nothing fits, else the untried neighbours of the best that the guess says may
    beat it (`Frontier.next`);
    returns (candidate, result) in search order. A candidate that cannot win is skipped
    (`Frontier.why_skip`), or, if it was already compiling when an earlier one was found to
    fit and dominate it, dropped and its place given to the next. `space` counts what became
    of every listed candidate, by reason. A worker that dies breaks the pool and fails every
    compile in it: those run again, each alone, so that only the one that dies fails; a
    candidate the broken pool refused goes to the next pool."""
    if workers < 0 or max_candidates < 1 or not 0 < time_budget_s < float("inf"):
        raise ConfigError(paragraph(
            f"--workers={workers}, --max_candidates={max_candidates} and",
            f"--time_budget_s={time_budget_s}: give workers >= 0 (0: one per two cores), at least",
            "one candidate and a positive time budget."))
    check_margin(margin)
    workers = workers or max(1, _cores() // 2)
    front = Frontier(config, topology, margin, space)
    deadline = time.monotonic() + time_budget_s
    results: list[tuple[int, Candidate, dict]] = []
    pending: dict = {}
    unsent: list[tuple[int, Candidate]] = []  # refused by a pool that a death had broken
    pool = _pool(workers)
    job_of = lambda cand: (compile_fn, _config_json(config, cand.overrides), topology, cache_dir)
    try:
        while True:
            front.learn(results)
            while len(pending) < workers and time.monotonic() < deadline:
                used = front.counted + len(pending)  # failures use none of the budget
                where = unsent.pop() if unsent else front.next(
                    used < max_candidates, extra=used < 2 * max_candidates)
                if where is None:
                    break
                try:
                    pending[pool.submit(*job_of(where[1]))] = where
                except cf.process.BrokenProcessPool:  # a worker died since the last wait:
                    unsent.append(where)  # this one never ran; it goes to the next pool
                    if pending:
                        break  # the wait below sees the death, as the compiles' failure
                    pool.shutdown(cancel_futures=True)  # it died idle: no compile to blame
                    pool = _pool(workers)
            if not pending:
                front.finish(results)
                return [(cand, r) for _, cand, r in front.kept]
            done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            finished = [(pending.pop(job), _result(job)) for job in done]
            suspects = [where for where, r in finished if _died(r)]
            if suspects:  # a dead worker breaks the pool, failing every compile in it
                pool.shutdown(cancel_futures=True)
                suspects += list(pending.values())
                finished = [(w, r) for w, r in finished if not _died(r)] + (
                    [(w, _alone(*job_of(w[1]))) for w in suspects] if len(suspects) > 1
                    else [(suspects[0], _died_result())])
                pending, pool = {}, _pool(workers)
            results += [(*where, r) for where, r in finished]
    except BaseException:  # SIGTERM / Ctrl-C: no compile outlives the plan
        stop_workers(pool, cache_dir)
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def _cores() -> int:
    """The cores this process may run on (Linux: its affinity mask), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 2


def _config_json(config: mlc.ConfigDict, overrides: dict) -> str:
    return json.dumps(apply(config, overrides).to_dict(), default=list)


def _pool(workers: int) -> cf.ProcessPoolExecutor:
    """Compiling processes, spawned (libtpu and jax are not fork-safe), compile-only env."""
    ctx = multiprocessing.get_context("spawn")
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                  initializer=compile_only_env)


def _alone(compile_fn: CompileFn, *args) -> dict:
    """One compile in a pool of its own: after a worker died with others compiling beside
    it, each of them runs again alone, so that only the one that dies fails."""
    with _pool(1) as pool:
        return _result(pool.submit(compile_fn, *args))


def _died(result: dict) -> bool:
    return result.get("error", "").startswith(_DIED)


def _died_result() -> dict:
    return {"error": f"{_DIED} (out of memory? a libtpu crash?); rerun `launch.compile` on "
                     "this candidate alone to see why", "signature": ""}  # maybe the machine's


def _result(job: cf.Future) -> dict:
    """A compile's result, or `_died_result` where its worker was killed mid-compile."""
    try:
        return job.result()
    except (cf.process.BrokenProcessPool, cf.CancelledError):
        return _died_result()
