"""The sharding planner: which candidate configs exist for a topology, in which order, which
cannot win or cannot fit, and how the compiled ones rank.

Candidates are factorizations of the chip count over pipeline / data / fsdp / tensor (and, for
an MoE model, `expert`: `_expert_splits`), rules presets (each only on meshes where it differs
from a simpler one), remat policies, the attention kernel, loss chunking and the logits' dtype
(`choices`), per-chip micro-batches (gradient accumulation keeps the global batch) and, with
pipeline stages, the schedule (1F1B, GPipe) and microbatch count, likeliest winners first by
the guesses of `aot.guess` (`_search_order`). Invalid ones are pruned by the config validation
(lazily, when reached); `frontier.py` decides from the compiled results what else cannot win
(`dominated`, `slower_than`) or fit (`implied_over`), `search.py` compiles the rest; those over
HBM (with a margin) are set apart, and the rest ranked by the roofline step-time estimate
without overlap (`step_s`)."""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import ml_collections as mlc

from jaxscale import config as config_lib
from jaxscale.aot.choices import (
    ATTENTIONS,
    attentions,
    context_options,
    f32_logits,
    fit_advice,
    loss_chunks,
    precisions,
    require_language_model,
    rows_per_chip,
)
from jaxscale.aot.guess import dims_of, remat_bytes, step_seconds
from jaxscale.aot.topology import Topology
from jaxscale.errors import JaxscaleError
from jaxscale.hardware import HBM_MARGIN, hbm_budget
from jaxscale.hardware import fits as hardware_fits

PRESETS = ("fsdp", "fsdp_tp", "tp", "dp")
# The remat policies searched, least HBM first, and their recompute rank: none < dots
# (elementwise only) < dots_no_batch (and attention's einsums) <= minimal (the same, keeping
# the projections by name) < save_dot_except_mlp (and the MLP's gate/up) < save_qkv_proj (and
# attention's out projection) < full (every matmul but the last). The offloaded policies are
# not searched: the estimate does not charge their host copies, so they would win unfairly.
REMATS = ("full", "save_qkv_proj", "save_dot_except_mlp", "minimal", "dots_no_batch", "dots",
          "none")
REMAT_COST = {r: len(REMATS) - 1 - i for i, r in enumerate(REMATS)}
SCHEDULES = ("1f1b", "gpipe")  # 1F1B first: GPipe's bubble with activations bounded by stages
# A candidate whose guessed bytes (`aot.guess`) exceed the HBM budget this many times is not
# compiled: the guess is rough (within 1.5x where compiled, bench/RESULTS.md), not that rough.
FAR_OVER = 2.0
# The mesh axes each rules preset exists for: it is a candidate only where these are > 1, and
# only on meshes whose axes > 1 it uses (besides `data` and `pipeline`, which every preset
# uses): elsewhere it equals a simpler preset (`tp` at tensor=1 is `dp`; `dp` over `fsdp` is
# `dp` over `data`), and compiling it again would only spend the budget.
PRESET_AXES = {"fsdp": {"fsdp"}, "fsdp_tp": {"fsdp", "tensor"}, "tp": {"tensor"}, "dp": set()}


@dataclass(frozen=True)
class Candidate:
    overrides: dict  # dotted config field -> value (those that differ from the config)
    full: dict = field(default_factory=dict, compare=False)  # every searched field
    guess_bytes: float | None = field(default=None, compare=False)  # `guess.remat_bytes`
    guess_s: float | None = field(default=None, compare=False)  # `guess.step_seconds`
    compute_s: float | None = field(default=None, compare=False)  # its compute part

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
    (the expert group's all-gather, `models/moe/dropless.py`) run on it."""
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


def _search_order(cand: Candidate, budget: float) -> tuple:
    """Likeliest winners first: no pipeline, no sequence sharding, then those the memory
    guess says fit the HBM budget, fastest guessed step first (compute with the remat's
    recompute, plus the collectives of the mesh and accumulation: `guess.step_seconds`), then
    those it doubts, least guessed bytes first (the likeliest to fit after all: a refusal
    rules out every candidate that needs no less, `implied_over`); ties go to splash attention (less memory than einsum at the same
    settings), no tensor parallelism, FSDP over the most chips, less accumulation, the loss
    whole, 1F1B, most microbatches."""
    o = cand.overrides
    attention = o["model.attention"]
    doubt = cand.guess_bytes is not None and cand.guess_bytes > budget
    first = cand.guess_bytes if doubt else float(f"{cand.guess_s or 0.0:.4g}")  # ties: below
    return (o["mesh.pipeline"], o.get("mesh.context", 1), doubt, first,
            ATTENTIONS.index(attention) if attention in ATTENTIONS else len(ATTENTIONS),
            f32_logits(o.get("precision", "")), o["mesh.tensor"], -o.get("mesh.expert", 1),
            -o["mesh.fsdp"], o["train.grad_accum"],
            o.get("model.loss_chunks", 1), SCHEDULES.index(o.get("pipeline.schedule", "1f1b")),
            -o.get("pipeline.microbatches", 1), PRESETS.index(o["rules_preset"]))


def _compute_seconds(config: mlc.ConfigDict, topology: Topology) -> Callable[..., float]:
    """(remat, attention, loss chunks) -> the analytic compiled FLOPs per chip at the chip's
    peak (`flops.expected_flops`: the model's and the remat's recompute), memoized: it
    depends on nothing else a candidate chooses (a pipeline's bubble aside)."""
    from jaxscale.aot.flops import expected_flops

    @functools.cache
    def seconds(remat: str, attention: str, chunks: int) -> float:
        c = apply(config, {"model.remat": remat, "model.attention": attention,
                           "model.loss_chunks": chunks})
        flops = expected_flops(c, topology.num_chips)
        return (flops or 0.0) / topology.chip.peak_bf16_flops
    return seconds


def _valid(config: mlc.ConfigDict, overrides: dict) -> bool:
    try:
        config_lib.validate(apply(config, overrides))
    except JaxscaleError:
        return False
    return True


def _all_candidates(config: mlc.ConfigDict, topology: Topology,
                    margin: float = HBM_MARGIN) -> list[Candidate]:
    """Every combination, in search order, with every field spelled out and its guesses (not
    yet validated)."""
    require_language_model(config)
    n, slices = topology.chips_per_slice, topology.num_slices
    budget = hbm_budget(topology.chip.hbm_limit_bytes, margin)
    dims, compute_s = dims_of(config), _compute_seconds(config, topology)
    found = []
    moe = _expert_splits(config, n) != (1,)
    for expert, ((pipeline, data, fsdp, tensor), ctx), preset, remat, attention, chunks, prec in (
            (e, *rest) for e in _expert_splits(config, n) for rest in itertools.product(
                _with_context(config, n // e), PRESETS, REMATS, attentions(config),
                loss_chunks(config), precisions(config))):
        mesh = {"data": data * slices, "pipeline": pipeline, "fsdp": fsdp, "tensor": tensor,
                "expert": expert, "context": ctx.get("mesh.context", 1)}
        if not _preset_fits_mesh(preset, mesh):
            continue
        per_chip = config.data.batch_size // (data * fsdp * expert * slices)
        tokens = per_chip * config.data.seq_len / mesh["context"]
        for micro in _micro_batches(per_chip):
            accum = per_chip // micro
            guess_bytes = remat_bytes(config, dims, mesh, accum, attention, chunks, remat)
            compute = compute_s(remat, attention, chunks)
            guess_s = step_seconds(topology.chip, dims, mesh, accum, tokens, compute)
            for pipe in _pipeline_options(pipeline, config.data.batch_size // accum):
                cand = Candidate({
                    "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor,
                    "mesh.pipeline": pipeline, "rules_preset": preset, "model.remat": remat,
                    "model.attention": attention, "model.loss_chunks": chunks,
                    "precision": prec, "train.grad_accum": accum, "train.eval_every": 0,
                    **pipe, **ctx,
                    **({"mesh.expert": expert} if moe else {}),
                    **({"mesh.dcn_data": slices} if slices > 1 else {})},
                    guess_bytes=guess_bytes, guess_s=guess_s, compute_s=compute)
                found.append((_search_order(cand, budget), cand))
    return [cand for _, cand in sorted(found, key=lambda x: x[0])]


def far_over(cand: Candidate, topology: Topology, margin: float) -> bool:
    """Whether the memory guess puts `cand` over `FAR_OVER` times the HBM budget: skipped."""
    budget = hbm_budget(topology.chip.hbm_limit_bytes, margin)
    return cand.guess_bytes is not None and cand.guess_bytes > FAR_OVER * budget


def iter_candidates(config: mlc.ConfigDict, topology: Topology, margin: float = HBM_MARGIN,
                    skipped: Counter | None = None, listed: list[Candidate] | None = None
                    ) -> Iterator[Candidate]:
    """Valid candidates over meshes, rules presets, remat policies, attention implementations,
    micro-batches (gradient accumulation keeps the global batch) and pipeline schedules /
    microbatch counts, in search order, without those the memory guess puts far over HBM
    (`far_over`); each is validated only when reached (thousands exist for a large slice), and
    its overrides keep only the fields that differ from the config. `skipped` counts those left
    out, by reason; `listed` (the `_all_candidates` of these arguments) saves listing them
    again."""
    skipped = Counter() if skipped is None else skipped
    for cand in listed if listed is not None else _all_candidates(config, topology, margin):
        if far_over(cand, topology, margin):
            skipped[SKIP_GUESSED] += 1
            continue
        full = specified(config, cand)
        if full is None:
            skipped[SKIP_INVALID] += 1
        else:
            yield full


def specified(config: mlc.ConfigDict, cand: Candidate) -> Candidate | None:
    """`cand` (every field spelled out) as the overrides that differ from `config`, or None
    where the config validation refuses it."""
    overrides = {k: v for k, v in cand.overrides.items() if _get(config, k) != v}
    if not _valid(config, overrides):
        return None
    return Candidate(overrides, cand.overrides, cand.guess_bytes, cand.guess_s, cand.compute_s)


SKIP_GUESSED = f"guessed over {FAR_OVER:g}x the HBM budget"
SKIP_INVALID = "refused by the config validation"
SAME_ERROR = "same compiler error as "  # + a failed candidate's label (`frontier.why_skip`)


def candidates(config: mlc.ConfigDict, topology: Topology,
               margin: float = HBM_MARGIN) -> list[Candidate]:
    """All valid candidates, in search order (`iter_candidates`)."""
    return list(iter_candidates(config, topology, margin))


# What a candidate pays, per searched field, where everything else is equal: more
# accumulation adds weight gathers and per-step overhead, more loss chunks head recompute, more
# remat recompute, einsum attention the same FLOPs and collectives as splash (the estimate
# counts both alike) with its scores in HBM, and float32 logits the same FLOPs as bf16 ones
# with twice the head's bytes, each with the same collectives or more. A field a
# candidate does not spell out has the config's default: 1 micro-batch, the loss whole, remat
# as configured.
_COSTS = {"train.grad_accum": (1, lambda v: v), "model.loss_chunks": (1, lambda v: v),
          "model.remat": (None, REMAT_COST.get),
          "model.attention": (None, lambda v: ATTENTIONS.index(v) if v in ATTENTIONS else None),
          "precision": (None, lambda v: None if v is None else f32_logits(v))}


# What a candidate needs in HBM, per searched field, where everything else is equal: less
# accumulation, fewer loss chunks, lighter remat (later in `REMATS`) and einsum attention (its
# scores) each need as much or more. A candidate needing at least as much as one libtpu
# refused (or that compiled over the margin) in every field cannot fit either.
_NEEDS = {"train.grad_accum": (1, lambda v: -v), "model.loss_chunks": (1, lambda v: -v),
          "model.remat": (None, lambda v: REMATS.index(v) if v in REMATS else None),
          "model.attention": (None, lambda v: ATTENTIONS.index(v) if v in ATTENTIONS else None),
          "precision": (None, lambda v: None if v is None else f32_logits(v))}


def _no_less(fields: dict, a: Candidate, b: Candidate) -> bool:
    """Whether `b` differs from `a` only in `fields` (name -> (default, rank)), ranking no
    lower in each, and differs in at least one."""
    full = lambda c: c.full or c.overrides
    same = lambda c: {k: v for k, v in full(c).items() if k not in fields}
    ranks = lambda c: tuple(rank(full(c).get(k, default)) for k, (default, rank) in fields.items())
    return (same(a) == same(b) and ranks(a) != ranks(b)
            and all(x == y or (x is not None and y is not None and x <= y)
                    for x, y in zip(ranks(a), ranks(b))))


def dominated(cand: Candidate, fitting: list[Candidate]) -> bool:
    """True if a fitting candidate differs only by costing no more in every `_COSTS` field
    (less accumulation, fewer loss chunks, less remat): the candidate cannot win."""
    return any(_no_less(_COSTS, f, cand) for f in fitting)


def implied_over(cand: Candidate, over: list[Candidate]) -> bool:
    """True if a candidate found over HBM differs only by needing no more in every `_NEEDS`
    field (more accumulation, more loss chunks, more remat, splash): this one cannot fit."""
    return any(_no_less(_NEEDS, o, cand) for o in over)


def slower_than(cand: Candidate, best_s: float | None) -> bool:
    """True if `cand`'s compute alone (the analytic FLOPs at peak, what libtpu compiles to
    within 1%) is slower than `best_s`, the no-overlap step of the best fitting candidate:
    communication only adds to it, so it cannot win."""
    return best_s is not None and cand.compute_s is not None and cand.compute_s > best_s


def step_s(result: dict) -> float:
    """The ranking's step time: the no-overlap estimate (compute plus every collective), the
    bound that assumes nothing hides communication; full overlap breaks ties."""
    return result["estimate"]["no_overlap_s"]


def usable(result: dict) -> float:
    """The HBM a compiled result may fill: the compiler's limit where the result has it (libtpu
    lets a program use more than the documented "GB" on v5e / v5p / v6e), else the capacity."""
    return result.get("hbm_limit_bytes") or result["hbm_bytes"]


def fits(result: dict, margin: float = HBM_MARGIN) -> bool:
    """A compiled result that leaves `margin` of the usable HBM free (`hardware.fits`)."""
    return "error" not in result and hardware_fits(result["total_bytes"], usable(result), margin)


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
    ok.sort(key=lambda cr: (step_s(cr[1]), cr[1]["estimate"]["full_overlap_s"]))
    over.sort(key=lambda cr: cr[1]["total_bytes"] - hbm_budget(usable(cr[1]), margin))
    return ok, over, failed


def format_plan(results: list[tuple[Candidate, dict]], margin: float, top: int,
                topology: Topology, config: mlc.ConfigDict, space: Counter | None = None
                ) -> str:
    """The ranked table, those over HBM, those that failed (the settings and the compiler's
    line) and the untried ones skipped for failing the same way (`space`, the search's
    counts), and the winner's flags (or, with nothing fitting, the closest candidate and what
    would make it fit)."""
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
    for reason, n in (space or {}).items():
        if reason.startswith(SAME_ERROR) and n:
            lines.append(f"   skipped: {reason} ({n} untried candidate{'s' * (n > 1)} sharing "
                         "the settings of two that failed so)")
    if ok:
        lines.append(f"winner: {ok[0][0].flags()}")
    elif over:
        cand, r = over[0]
        closest = apply(config, cand.overrides)
        m = closest.mesh
        advice = fit_advice(closest, rows_per_chip(closest, m.data * m.dcn_data, m.fsdp))
        lines.append(
            f"No candidate fits. Closest: {cand.label()} at {gib(r['total_bytes'])} GiB per chip, "
            f"over the {gib(hbm_budget(usable(r), margin))} GiB budget by "
            f"{gib(r['total_bytes'] - hbm_budget(usable(r), margin))} GiB. To fit: "
            f"{advice}.")
    return "\n".join(lines)
