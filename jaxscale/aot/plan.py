"""The sharding planner: which candidate configs exist for a topology, in which order, which
cannot win, and how the compiled ones rank.

Candidates are factorizations of the chip count over pipeline / data / fsdp / tensor (and, for
an MoE model, `expert`: `_expert_splits`), rules presets (each only on meshes where it differs
from a simpler one), remat policies, the attention kernel and loss chunking (`choices`),
per-chip micro-batches (gradient accumulation keeps the global batch) and, with pipeline
stages, the schedule (1F1B, GPipe) and microbatch count, likeliest winners first (`_search_order`). Invalid ones are pruned by the config validation
(lazily, when reached); `search.py` compiles the rest, skipping those that cannot beat one that
already fits (`dominated`); those over HBM (with a margin) are set apart, and the rest ranked by
the roofline step-time estimate (full overlap).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import ml_collections as mlc

from jaxscale import config as config_lib
from jaxscale.aot.choices import (
    ATTENTIONS,
    attentions,
    context_options,
    fit_advice,
    loss_chunks,
    require_language_model,
    rows_per_chip,
)
from jaxscale.aot.guess import dims_of, remat_bytes
from jaxscale.aot.memory import Dims
from jaxscale.aot.topology import Topology
from jaxscale.errors import JaxscaleError

PRESETS = ("fsdp", "fsdp_tp", "tp", "dp")
# The remat policies searched, most recompute (least HBM) first, and their recompute rank:
# none < dots (elementwise only) < save_dot_except_mlp (and the MLP's matmuls) < save_qkv_proj
# (and attention's out projection and einsums) < full (every matmul but the last).
REMATS = ("full", "save_qkv_proj", "save_dot_except_mlp", "dots", "none")
REMAT_COST = {r: len(REMATS) - 1 - i for i, r in enumerate(REMATS)}
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


def _expert_splits(config: mlc.ConfigDict, n: int) -> tuple[int, ...]:
    """`mesh.expert` sizes to search: 1 for a dense model; for MoE (`model.moe.num_experts`)
    also each power of two dividing both the chips and the experts (each chip of an expert
    group holds num_experts / expert of them; the batch splits over it as over data), the
    most expert parallelism first; both the capacity path (all-to-all dispatch) and dropless
    (the expert group's all-gather, `models/moe_dropless.py`) run on it."""
    experts = config.model.get("moe", {}).get("num_experts", 0)
    return tuple(e for e in (64, 32, 16, 8, 4, 2) if experts and experts % e == 0
                 and n % e == 0) + (1,)


def _with_context(config: mlc.ConfigDict, n: int) -> Iterator[tuple[tuple[int, ...], dict]]:
    """(pipeline, data, fsdp, tensor) of the chips left beside each sequence sharding
    (`choices.context_options`: none, and for long sequences `mesh.context` > 1)."""
    for ctx in context_options(config, n):
        for factors in _factorizations(n // ctx.get("mesh.context", 1), config.model.num_layers):
            yield factors, ctx


def _preset_fits_mesh(preset: str, mesh: dict[str, int]) -> bool:
    """Every preset maps `length -> context`: `context` is as free as data and pipeline."""
    big = {axis for axis, size in mesh.items() if size > 1}
    free = {"data", "pipeline", "expert", "context"}  # axes every preset uses
    return PRESET_AXES[preset] <= big and big <= PRESET_AXES[preset] | free


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


def _remat_order(config: mlc.ConfigDict, dims: Dims | None, mesh: dict[str, int], accum: int,
                 attention: str, chunks: int, budget: float) -> tuple[str, ...]:
    """The policies the analytic guess says fit the HBM budget first, least recompute first
    (the lightest that fits wins), then the rest, most recompute first (the likeliest to fit
    after all); without a guess, `REMATS` (most recompute first)."""
    guesses = {r: remat_bytes(config, dims, mesh, accum, attention, chunks, r) for r in REMATS}
    if any(g is None for g in guesses.values()):
        return REMATS
    fit = [r for r in reversed(REMATS) if guesses[r] <= budget]
    return tuple(fit) + tuple(r for r in REMATS if r not in fit)


def _search_order(cand: Candidate, remats: tuple[str, ...] = REMATS) -> tuple:
    """Likeliest winners first: no pipeline, the remat policy in `remats` order
    (`_remat_order`), splash attention (less memory than einsum at the same settings), no
    tensor parallelism, FSDP over the most chips, no accumulation (fewest weight gathers), the
    loss whole then chunked (a little more compute, much less memory: tried before
    accumulating), 1F1B, most microbatches."""
    o = cand.overrides
    attention = o["model.attention"]
    return (o["mesh.pipeline"], o.get("mesh.context", 1), remats.index(o["model.remat"]),
            ATTENTIONS.index(attention) if attention in ATTENTIONS else len(ATTENTIONS),
            o["mesh.tensor"], -o.get("mesh.expert", 1), -o["mesh.fsdp"], o["train.grad_accum"],
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
    require_language_model(config)
    n, slices = topology.chips_per_slice, topology.num_slices
    budget = topology.chip.hbm_limit_bytes * (1 - margin)
    dims = dims_of(config)
    found = []
    moe = _expert_splits(config, n) != (1,)
    for expert, ((pipeline, data, fsdp, tensor), ctx), preset, remat, attention, chunks in (
            (e, *rest) for e in _expert_splits(config, n) for rest in itertools.product(
                _with_context(config, n // e), PRESETS, REMATS, attentions(config),
                loss_chunks(config))):
        mesh = {"data": data * slices, "pipeline": pipeline, "fsdp": fsdp, "tensor": tensor,
                "expert": expert, "context": ctx.get("mesh.context", 1)}
        if not _preset_fits_mesh(preset, mesh):
            continue
        per_chip = config.data.batch_size // (data * fsdp * expert * slices)
        for micro in _micro_batches(per_chip):
            accum = per_chip // micro
            remats = _remat_order(config, dims, mesh, accum, attention, chunks, budget)
            for pipe in _pipeline_options(pipeline, config.data.batch_size // accum):
                cand = Candidate({
                    "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor,
                    "mesh.pipeline": pipeline, "rules_preset": preset, "model.remat": remat,
                    "model.attention": attention, "model.loss_chunks": chunks,
                    "train.grad_accum": accum, "train.eval_every": 0, **pipe, **ctx,
                    **({"mesh.expert": expert} if moe else {}),
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


# What a candidate pays, per searched field, where everything else is equal: more
# accumulation adds weight gathers and per-step overhead, more loss chunks head recompute, and
# more remat recompute, each with the same collectives or more. A field a candidate does not
# spell out has the config's default: 1 micro-batch, the loss whole, remat as configured.
_COSTS = {"train.grad_accum": (1, lambda v: v), "model.loss_chunks": (1, lambda v: v),
          "model.remat": (None, REMAT_COST.get)}


def dominated(cand: Candidate, fitting: list[Candidate]) -> bool:
    """True if a fitting candidate differs only by costing no more in every `_COSTS` field
    (less accumulation, fewer loss chunks, less remat): the candidate cannot win."""
    full = lambda c: c.full or c.overrides
    same = lambda c: {k: v for k, v in full(c).items() if k not in _COSTS}
    costs = lambda c: tuple(cost(full(c).get(k, default)) for k, (default, cost) in _COSTS.items())
    return any(same(f) == same(cand) and costs(f) != costs(cand)
               and all(a == b or (a is not None and b is not None and a <= b)
                       for a, b in zip(costs(f), costs(cand))) for f in fitting)


def usable(result: dict) -> float:
    """The HBM a compiled result may fill: the compiler's limit where the result has it (libtpu
    lets a program use more than the documented "GB" on v5e / v5p / v6e), else the capacity."""
    return result.get("hbm_limit_bytes") or result["hbm_bytes"]


def fits(result: dict, margin: float) -> bool:
    """A compiled result that leaves `margin` of the usable HBM free."""
    return "error" not in result and result["total_bytes"] <= usable(result) * (1 - margin)


def rank(results: list[tuple[Candidate, dict]], margin: float
         ) -> tuple[list, list, list]:
    """(fitting ranked by estimated step time, over HBM by over-by, failed to compile)."""
    ok, over, failed = [], [], []
    for cand, r in results:
        if "error" in r:
            failed.append((cand, r))
        elif fits(r, margin):
            ok.append((cand, r))
        else:
            over.append((cand, r))
    ok.sort(key=lambda cr: (cr[1]["estimate"]["full_overlap_s"], cr[1]["estimate"]["no_overlap_s"]))
    over.sort(key=lambda cr: cr[1]["total_bytes"] - usable(cr[1]) * (1 - margin))
    return ok, over, failed


def format_plan(results: list[tuple[Candidate, dict]], margin: float, top: int,
                topology: Topology, config: mlc.ConfigDict) -> str:
    """The ranked table, those over HBM and those that failed, and the winner's flags (or,
    with nothing fitting, the closest candidate and what would make it fit)."""
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
        closest = apply(config, cand.overrides)
        m = closest.mesh
        advice = fit_advice(closest, rows_per_chip(closest, m.data * m.dcn_data, m.fsdp))
        lines.append(
            f"No candidate fits. Closest: {cand.label()} at {gib(r['total_bytes'])} GiB per chip, "
            f"over the {gib(usable(r) * (1 - margin))} GiB budget by "
            f"{gib(r['total_bytes'] - usable(r) * (1 - margin))} GiB. To fit: "
            f"{advice}.")
    return "\n".join(lines)
