"""The sharding planner: enumerate candidate configs for a topology, compile each, rank them.

Candidates are factorizations of the chip count over pipeline / data / fsdp / tensor, rules
presets (each only on meshes where it differs from a simpler one), remat policies, the attention
implementation (`splash`, the Pallas TPU kernel, and `einsum`, where the kernel applies), the
loss whole or in chunks (`model.loss_chunks`), per-chip
micro-batches (gradient accumulation keeps the global batch) and, with pipeline stages, the
schedule (1F1B, GPipe) and microbatch count, likeliest winners first (`_search_order`).
Invalid ones are pruned by the config validation (lazily, when reached); the rest are compiled
by the TPU compiler in worker processes, several at once (`workers`, default one per two cores:
a large compile keeps about 1.6 cores busy; workers keep a crashing compile away from the
search, and libtpu's process lock is lifted for compile-only use), skipping those
that cannot beat one that already fits (`_dominated`). Each result is cached on disk, keyed by
a hash of the config and topology, so a rerun is instant; those over HBM (with a margin) are
dropped, and the rest ranked by the roofline step-time estimate (full overlap).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import itertools
import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import ml_collections as mlc

from jaxscale import config as config_lib
from jaxscale.aot.compile import HbmOom, fit_advice
from jaxscale.aot.guess import no_remat_bytes
from jaxscale.aot.topology import Topology, compile_only_env
from jaxscale.errors import JaxscaleError

PRESETS = ("fsdp", "fsdp_tp", "tp", "dp")
REMATS = ("full", "dots", "none")
# Splash first: it never holds the (B, H, T, T) scores einsum keeps, so for the same settings it
# fits wherever einsum does (1B without remat, 64 x 2,048 tokens on v5p-16: see README).
ATTENTIONS = ("splash", "einsum")
# The LM head and loss whole, then in 8 chunks (`model.loss_chunks`): chunking costs one more
# head forward pass (0.5% of the compiled FLOPs of a 7B step) and keeps only a chunk of the
# float32 logits and their gradient: 10 GiB less temporaries per chip for 7B under fsdp=4 x
# tensor=4 at 512 x 2,048 tokens on v5p-16 (96.25 -> 86.22 GiB, bench/RESULTS.md).
LOSS_CHUNKS = (1, 8)
SCHEDULES = ("1f1b", "gpipe")  # 1F1B first: GPipe's bubble with activations bounded by stages
# The mesh axes each rules preset exists for: it is a candidate only where these are > 1, and
# only on meshes whose axes > 1 it uses (besides `data` and `pipeline`, which every preset
# uses): elsewhere it equals a simpler preset (`tp` at tensor=1 is `dp`; `dp` over `fsdp` is
# `dp` over `data`), and compiling it again would only spend the budget.
PRESET_AXES = {"fsdp": {"fsdp"}, "fsdp_tp": {"fsdp", "tensor"}, "tp": {"tensor"}, "dp": set()}


@dataclass(frozen=True)
class Candidate:
    overrides: dict  # dotted config field -> value (those that differ from the config)
    full: dict = field(default_factory=dict, compare=False)  # every searched field


    def label(self) -> str:
        return " ".join(f"{k.split('.')[-1]}={v}" for k, v in self.overrides.items())

    def flags(self) -> str:
        return " ".join(f"--config.{k}={v}" for k, v in self.overrides.items())


def apply(config: mlc.ConfigDict, overrides: dict) -> mlc.ConfigDict:
    c = mlc.ConfigDict(config.to_dict())  # a copy that keeps the locked structure's types
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def _get(config: mlc.ConfigDict, key: str):
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def _factorizations(n: int, num_layers: int) -> Iterator[tuple[int, int, int, int]]:
    """(pipeline, data, fsdp, tensor) with product n: tensor <= 8 (one ICI neighbourhood),
    pipeline stages in {1, 2, 4, 8} dividing the layers."""
    for pipeline in (1, 2, 4, 8):
        if n % pipeline or num_layers % pipeline:
            continue
        for tensor in (1, 2, 4, 8):
            rest = n // pipeline
            for data in range(1, rest + 1):
                if rest % (tensor * data) == 0:
                    yield pipeline, data, rest // (tensor * data), tensor


def _preset_fits_mesh(preset: str, mesh: dict[str, int]) -> bool:
    big = {axis for axis, size in mesh.items() if size > 1}
    return PRESET_AXES[preset] <= big and big <= PRESET_AXES[preset] | {"data", "pipeline"}


def _pipeline_options(stages: int, step_rows: int) -> list[dict]:
    """Schedule and microbatch count per pipeline mesh: 4S, 2S and S microbatches (a smaller
    bubble first) where the per-step batch divides; nothing to choose without stages."""
    if stages == 1:
        return [{}]
    return [{"pipeline.schedule": schedule, "pipeline.microbatches": m}
            for schedule in SCHEDULES for m in (4 * stages, 2 * stages, stages)
            if step_rows % m == 0]


def _micro_batches(per_chip: int) -> list[int]:
    """Power-of-two sequences per chip and step, largest (no accumulation) first."""
    return [m for m in sorted({1 << k for k in range(8)}, reverse=True)
            if m <= per_chip and per_chip % m == 0]


def _attentions(config: mlc.ConfigDict) -> tuple[str, ...]:
    """The attention implementations to search: splash and einsum where the splash kernel
    applies (a Llama, a sequence length on its 128 grid), else the config's own."""
    from jaxscale.models.splash import block_size

    m = config.model
    if m.get("name", "llama") == "llama" and block_size(config.data.seq_len) is not None:
        return ATTENTIONS
    return (m.get("attention", "einsum"),)


def _loss_chunks(config: mlc.ConfigDict) -> tuple[int, ...]:
    """The loss chunkings to search: whole and chunked for a Llama whose length they divide."""
    m = config.model
    if m.get("name", "llama") == "llama":
        return tuple(n for n in LOSS_CHUNKS if config.data.seq_len % n == 0)
    return (m.get("loss_chunks", 1),)


def _remat_order(config: mlc.ConfigDict, mesh: dict[str, int], accum: int, attention: str,
                 chunks: int, budget: float) -> tuple[str, ...]:
    """No remat first where the analytic guess says it fits the HBM budget (no recompute: it
    wins where it fits), else full remat first (the others rarely fit a large model: 7B on
    v5p-32 under `dots` needs 233 GB of temporaries per chip)."""
    guess = no_remat_bytes(config, mesh, accum, attention, chunks)
    return tuple(reversed(REMATS)) if guess is not None and guess <= budget else REMATS


def _search_order(cand: Candidate, remats: tuple[str, ...] = REMATS) -> tuple:
    """Likeliest winners first: no pipeline, the remat policy in `remats` order
    (`_remat_order`), splash attention (less memory than einsum at the same settings), no
    tensor parallelism, FSDP over the most chips, no accumulation (fewest weight gathers), the
    loss whole then chunked (a little more compute, much less memory: tried before
    accumulating), 1F1B, most microbatches."""
    o = cand.overrides
    attention = o["model.attention"]
    return (o["mesh.pipeline"], remats.index(o["model.remat"]),
            ATTENTIONS.index(attention) if attention in ATTENTIONS else len(ATTENTIONS),
            o["mesh.tensor"], -o["mesh.fsdp"], o["train.grad_accum"],
            o.get("model.loss_chunks", 1), SCHEDULES.index(o.get("pipeline.schedule", "1f1b")),
            -o.get("pipeline.microbatches", 1), PRESETS.index(o["rules_preset"]))


def _valid(config: mlc.ConfigDict, overrides: dict) -> bool:
    try:
        config_lib.validate(apply(config, overrides))
    except JaxscaleError:
        return False
    return True


def _all_candidates(config: mlc.ConfigDict, topology: Topology,
                    margin: float = 0.1) -> list[Candidate]:
    """Every combination, in search order, with every field spelled out (not yet validated)."""
    n, slices = topology.chips_per_slice, topology.num_slices
    budget = topology.chip.hbm_bytes * (1 - margin)
    found = []
    for (pipeline, data, fsdp, tensor), preset, remat, attention, chunks in itertools.product(
            _factorizations(n, config.model.num_layers), PRESETS, REMATS, _attentions(config),
            _loss_chunks(config)):
        mesh = {"data": data * slices, "pipeline": pipeline, "fsdp": fsdp, "tensor": tensor}
        if not _preset_fits_mesh(preset, mesh):
            continue
        per_chip = config.data.batch_size // (data * fsdp * slices)
        for micro in _micro_batches(per_chip):
            accum = per_chip // micro
            remats = _remat_order(config, mesh, accum, attention, chunks, budget)
            for pipe in _pipeline_options(pipeline, config.data.batch_size // accum):
                cand = Candidate({
                    "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor,
                    "mesh.pipeline": pipeline, "rules_preset": preset, "model.remat": remat,
                    "model.attention": attention, "model.loss_chunks": chunks,
                    "train.grad_accum": accum, "train.eval_every": 0, **pipe,
                    **({"mesh.dcn_data": slices} if slices > 1 else {})})
                found.append((_search_order(cand, remats), cand))
    return [cand for _, cand in sorted(found, key=lambda x: x[0])]


def iter_candidates(config: mlc.ConfigDict, topology: Topology,
                    margin: float = 0.1) -> Iterator[Candidate]:
    """Valid candidates over meshes, rules presets, remat policies, attention implementations,
    micro-batches (gradient accumulation keeps the global batch) and pipeline schedules /
    microbatch counts, in search order; each is validated only when reached (thousands exist
    for a large slice), and its overrides keep only the fields that differ from the config."""
    for cand in _all_candidates(config, topology, margin):
        overrides = {k: v for k, v in cand.overrides.items() if _get(config, k) != v}
        if _valid(config, overrides):
            yield Candidate(overrides, cand.overrides)


def candidates(config: mlc.ConfigDict, topology: Topology,
               margin: float = 0.1) -> list[Candidate]:
    """All valid candidates, in search order (`iter_candidates`)."""
    return list(iter_candidates(config, topology, margin))


def cache_key(config: mlc.ConfigDict, topology: Topology) -> str:
    text = json.dumps([config.to_dict(), topology.label()], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def compile_cached(config_json: str, topology: Topology, cache_dir: str) -> dict:
    """Compile (in this process: the planner runs it in a worker), estimate, cache by
    `cache_key`. Errors come back as one line; an out-of-HBM refusal as a result over HBM."""
    from jaxscale.aot.compile import compile_step
    from jaxscale.aot.report import step_estimate

    config = mlc.ConfigDict(json.loads(config_json))
    path = os.path.join(cache_dir, cache_key(config, topology) + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    try:
        report = compile_step(config, topology)
        result = {**report.to_json(), "estimate": vars(step_estimate(report))}
    except Exception as e:  # noqa: BLE001 - a failing candidate is reported, the search goes on
        result = _failure(e, topology)
        if "error" in result:  # not cached: it may be this machine's (memory, a killed worker)
            return result
    os.makedirs(cache_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    return result


def _failure(e: Exception, topology: Topology) -> dict:
    """A compile error as one line; libtpu's out-of-HBM refusal instead becomes a result over
    HBM (its temporaries, a lower bound of the total), so the ranking can say by how much."""
    if isinstance(e, HbmOom):
        return {"total_bytes": e.temp_bytes, "hbm_bytes": topology.chip.hbm_bytes,
                "over_hbm": "libtpu: CompileTimeHbmOom (temporaries alone)"}
    lines = [line for line in str(e).splitlines() if line.strip()]
    return {"error": f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]}


def _config_json(config: mlc.ConfigDict, overrides: dict) -> str:
    return json.dumps(apply(config, overrides).to_dict(), default=list)


# What a candidate pays, per searched field, where everything else is equal: more
# accumulation adds weight gathers and per-step overhead, more loss chunks head recompute, and
# remat recompute (none < dots < full), each with the same collectives or more.
_COSTS = {"train.grad_accum": lambda v: v, "model.loss_chunks": lambda v: v,
          "model.remat": lambda v: ("none", "dots", "full").index(v)}


def _dominated(cand: Candidate, fitting: list[Candidate]) -> bool:
    """True if a fitting candidate differs only by costing no more in every `_COSTS` field
    (less accumulation, fewer loss chunks, less remat): the candidate cannot win."""
    full = lambda c: c.full or c.overrides
    same = lambda c: {k: v for k, v in full(c).items() if k not in _COSTS}
    costs = lambda c: tuple(f(full(c)[k]) if k in full(c) else 0 for k, f in _COSTS.items())
    return any(same(f) == same(cand) and costs(f) != costs(cand)
               and all(a <= b for a, b in zip(costs(f), costs(cand))) for f in fitting)


def search(config: mlc.ConfigDict, topology: Topology, cache_dir: str,
           max_candidates: int = 16, time_budget_s: float = 3600.0,
           workers: int = 0, margin: float = 0.1) -> list[tuple[Candidate, dict]]:
    """Compiles candidates in search order, `workers` at once (0: one per two cores), until
    `max_candidates` are compiled or the time budget is spent; returns (candidate, result) in
    search order. A candidate that cannot beat an earlier one that fits (`_dominated`) is
    skipped, or, if it was already compiling when that one was found to fit, dropped and its
    place given to the next: so the result is the same for any number of workers."""
    workers = workers or max(1, (os.cpu_count() or 2) // 2)
    queue = iter_candidates(config, topology, margin)
    deadline = time.monotonic() + time_budget_s
    results: list[tuple[int, Candidate, dict]] = []
    started, exhausted, pending = 0, False, {}
    pool = _pool(workers)
    try:
        while True:
            kept, fitting = _kept(results, margin)
            while (not exhausted and len(kept) + len(pending) < max_candidates
                   and len(pending) < workers and time.monotonic() < deadline):
                cand = next(queue, None)
                exhausted = cand is None
                if cand is None or _dominated(cand, fitting):
                    continue
                job = pool.submit(compile_cached, _config_json(config, cand.overrides),
                                  topology, cache_dir)
                pending[job] = (started, cand)
                started += 1
            if not pending:
                return [(cand, r) for _, cand, r in kept]
            done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            results += [(*pending.pop(job), _result(job)) for job in done]
            if any(_died(r) for _, _, r in results[-len(done):]):
                pool.shutdown(cancel_futures=True)  # a dead worker breaks the pool: start anew
                results += [(*where, _result(job)) for job, where in pending.items()]
                pending, pool = {}, _pool(workers)
    finally:
        pool.shutdown(cancel_futures=True)


def _fits(result: dict, margin: float) -> bool:
    return "error" not in result and result["total_bytes"] <= result["hbm_bytes"] * (1 - margin)


def _kept(results: list[tuple[int, Candidate, dict]], margin: float
          ) -> tuple[list[tuple[int, Candidate, dict]], list[Candidate]]:
    """The results in search order without those an earlier fitting one dominates, and the
    fitting candidates among them."""
    kept, fitting = [], []
    for index, cand, result in sorted(results, key=lambda x: x[0]):
        if not _dominated(cand, fitting):
            kept.append((index, cand, result))
            if _fits(result, margin):
                fitting.append(cand)
    return kept, fitting


def _pool(workers: int) -> cf.ProcessPoolExecutor:
    ctx = multiprocessing.get_context("spawn")  # libtpu and jax are not fork-safe
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                  initializer=compile_only_env)


_DIED = "the compiling process died"


def _died(result: dict) -> bool:
    return result.get("error", "").startswith(_DIED)


def _result(job: cf.Future) -> dict:
    """A compile's result; a worker killed mid-compile (out of memory, a libtpu crash) fails
    only its candidates, and the search goes on in a new pool."""
    try:
        return job.result()
    except (cf.process.BrokenProcessPool, cf.CancelledError):
        return {"error": f"{_DIED} (out of memory? a libtpu crash?); rerun "
                         "`launch.compile` on this candidate alone to see why"}


def rank(results: list[tuple[Candidate, dict]], margin: float
         ) -> tuple[list, list, list]:
    """(fitting ranked by estimated step time, over HBM by over-by, failed to compile)."""
    ok, over, failed = [], [], []
    for cand, r in results:
        if "error" in r:
            failed.append((cand, r))
        elif _fits(r, margin):
            ok.append((cand, r))
        else:
            over.append((cand, r))
    ok.sort(key=lambda cr: (cr[1]["estimate"]["full_overlap_s"], cr[1]["estimate"]["no_overlap_s"]))
    over.sort(key=lambda cr: cr[1]["total_bytes"] - cr[1]["hbm_bytes"] * (1 - margin))
    return ok, over, failed


def format_plan(results: list[tuple[Candidate, dict]], margin: float, top: int,
                topology: Topology, config: mlc.ConfigDict) -> str:
    ok, over, failed = rank(results, margin)
    gib = lambda n: f"{n / 2**30:.1f}"
    lines = [f"{len(results)} candidates compiled for {topology.label()}: {len(ok)} fit with a "
             f"{margin:.0%} HBM margin, {len(over)} do not, {len(failed)} failed to compile.",
             f"{'#':>2} {'step ms (ESTIMATE)':>18} {'MFU':>5} {'GiB/chip':>9}  candidate"]
    for i, (cand, r) in enumerate(ok[:top], 1):
        e = r["estimate"]
        mfu = f"{e['mfu_full_overlap']:.0%}" if e["mfu_full_overlap"] else "-"
        lines.append(f"{i:>2} {e['full_overlap_s'] * 1e3:>8.2f}..{e['no_overlap_s'] * 1e3:<9.2f}"
                     f" {mfu:>5} {gib(r['total_bytes']):>9}  {cand.label()}")
    for cand, r in over:
        lines.append(f"   over HBM: {cand.label()}: {gib(r['total_bytes'])} GiB per chip"
                     + (f" ({r['over_hbm']})" if "over_hbm" in r else ""))
    for cand, r in failed:
        lines.append(f"   failed to compile: {cand.label()}: {r['error']}")
    if ok:
        lines.append(f"winner: {ok[0][0].flags()}")
    elif over:
        cand, r = over[0]
        lines.append(
            f"No candidate fits. Closest: {cand.label()} at {gib(r['total_bytes'])} GiB per chip, "
            f"over the {gib(r['hbm_bytes'] * (1 - margin))} GiB budget by "
            f"{gib(r['total_bytes'] - r['hbm_bytes'] * (1 - margin))} GiB. To fit: "
            f"{fit_advice(apply(config, cand.overrides))}.")
    return "\n".join(lines)
