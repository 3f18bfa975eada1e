"""The sharding planner: enumerate candidate configs for a topology, compile each, rank them.

Candidates are factorizations of the chip count over data / fsdp / tensor (and pipeline with
its microbatches), rules presets, remat policies and per-chip micro-batches (gradient
accumulation keeps the global batch). Invalid ones are pruned by the config validation; the
rest are compiled by the TPU compiler in one worker process, one at a time (a large compile
takes a core and gigabytes of memory; the worker keeps a crashing compile away from the search). Each result is cached on disk,
keyed by a hash of the config and topology, so a rerun is instant), those over HBM (with a
margin) dropped, and the rest ranked by the roofline step-time estimate (full overlap).
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
from dataclasses import dataclass

import ml_collections as mlc

from jaxscale import config as config_lib
from jaxscale.aot.topology import Topology, compile_only_env
from jaxscale.errors import JaxscaleError

PRESETS = ("fsdp", "fsdp_tp", "tp", "dp")
REMATS = ("full", "dots", "none")


@dataclass(frozen=True)
class Candidate:
    overrides: dict  # dotted config field -> value

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


def _factorizations(n: int) -> Iterator[tuple[int, int, int]]:
    """(data, fsdp, tensor) with product n, tensor <= 8 (one ICI neighbourhood)."""
    for tensor in (1, 2, 4, 8):
        for data in range(1, n + 1):
            if n % (tensor * data) == 0:
                yield data, n // (tensor * data), tensor


def candidates(config: mlc.ConfigDict, topology: Topology) -> list[Candidate]:
    """Valid candidates, likeliest winners first (FSDP-heavy, full remat, large micro-batch)."""
    n = topology.chips_per_slice
    found = []
    for (data, fsdp, tensor), preset, remat in itertools.product(
            _factorizations(n), PRESETS, REMATS):
        per_chip = config.data.batch_size // (data * fsdp * topology.num_slices)
        for micro in sorted({1 << k for k in range(8)} & set(range(1, per_chip + 1)),
                            reverse=True):
            if per_chip % micro:
                continue
            overrides = {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor,
                         "mesh.pipeline": 1, "rules_preset": preset, "model.remat": remat,
                         "train.grad_accum": per_chip // micro, "train.eval_every": 0}
            if topology.num_slices > 1:
                overrides["mesh.dcn_data"] = topology.num_slices
            overrides = {k: v for k, v in overrides.items() if _get(config, k) != v}
            try:
                config_lib.validate(apply(config, overrides))
            except JaxscaleError:
                continue
            found.append(Candidate(overrides))
    full = lambda c: apply(config, c.overrides)
    order = lambda c: (full(c).mesh.tensor, -full(c).mesh.fsdp, REMATS.index(full(c).model.remat),
                       full(c).train.grad_accum, PRESETS.index(full(c).rules_preset))
    return sorted(found, key=order)


def cache_key(config: mlc.ConfigDict, topology: Topology) -> str:
    text = json.dumps([config.to_dict(), topology.label()], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _compile_one(config_json: str, topology: Topology, cache_dir: str) -> dict:
    """Runs in a worker process: compile, estimate, cache. Errors come back as one line."""
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
        lines = [line for line in str(e).splitlines() if line.strip()]
        return {"error": f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]}
    os.makedirs(cache_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    return result


def _config_json(config: mlc.ConfigDict, overrides: dict) -> str:
    return json.dumps(apply(config, overrides).to_dict(), default=list)


def search(config: mlc.ConfigDict, topology: Topology, cache_dir: str,
           max_candidates: int = 16, time_budget_s: float = 3600.0,
           workers: int = 1) -> list[tuple[Candidate, dict]]:
    """Compiles candidates in order until the budget is spent; returns (candidate, result)."""
    todo = candidates(config, topology)[:max_candidates]
    deadline = time.monotonic() + time_budget_s
    results: list[tuple[Candidate, dict]] = []
    ctx = multiprocessing.get_context("spawn")  # libtpu and jax are not fork-safe
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx,
                                initializer=compile_only_env) as pool:
        pending = {}
        queue = list(todo)
        while queue or pending:
            while queue and len(pending) < workers and time.monotonic() < deadline:
                cand = queue.pop(0)
                job = pool.submit(_compile_one, _config_json(config, cand.overrides),
                                  topology, cache_dir)
                pending[job] = cand
            if not pending:
                break
            done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for job in done:
                results.append((pending.pop(job), job.result()))
    return results


def rank(results: list[tuple[Candidate, dict]], margin: float
         ) -> tuple[list, list, list]:
    """(fitting ranked by estimated step time, over HBM by over-by, failed to compile)."""
    ok, over, failed = [], [], []
    for cand, r in results:
        if "error" in r:
            failed.append((cand, r))
        elif r["total_bytes"] <= r["hbm_bytes"] * (1 - margin):
            ok.append((cand, r))
        else:
            over.append((cand, r))
    ok.sort(key=lambda cr: cr[1]["estimate"]["full_overlap_s"])
    over.sort(key=lambda cr: cr[1]["total_bytes"] - cr[1]["hbm_bytes"] * (1 - margin))
    return ok, over, failed


def format_plan(results: list[tuple[Candidate, dict]], margin: float, top: int,
                topology: Topology) -> str:
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
    for cand, r in failed:
        lines.append(f"   failed to compile: {cand.label()}: {r['error']}")
    if ok:
        lines.append(f"winner: {ok[0][0].flags()}")
    elif over:
        cand, r = over[0]
        lines.append(
            f"No candidate fits. Closest: {cand.label()} at {gib(r['total_bytes'])} GiB per chip, "
            f"over the {gib(r['hbm_bytes'] * (1 - margin))} GiB budget by "
            f"{gib(r['total_bytes'] - r['hbm_bytes'] * (1 - margin))} GiB. To fit: more chips "
            "(a larger topology or --num_slices), model.remat=full, precision=bf16-true, "
            "optim.name=adamw8bit (8-bit Adam states), or LoRA (lora.rank=16) for fine-tuning.")
    return "\n".join(lines)
