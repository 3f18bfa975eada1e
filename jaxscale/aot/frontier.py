"""What the planner's search has learned so far, and which candidate it compiles next.

`plan.py` lists every candidate with its guesses, in search order (the likeliest winners
first); `search.py` runs the compiler. Between them this module decides, from what has been
compiled, what is not worth compiling: a candidate that a fitting one dominates (it costs more
and can save nothing), one that needs no less HBM than one found over HBM, one the memory guess
puts over once scaled as the compiled ones of its remat policy came out, one whose compute alone
is slower than the best step found, one the memory guess puts far over. When the
candidate budget is spent with nothing fitting it goes on in order; with a best, it does not
stop while the best has an untried neighbour (one or two
choices away, e.g. lighter remat with more accumulation, or another data x fsdp split) that
the guess says may beat it and fits: those are compiled too, up to as many again. Every listed
candidate ends up counted by what became of it (`Frontier.space`), which the plan prints.

It also learns from compiler failures (`same_error_rules`). A failure is not a result: it uses
none of the candidate budget, so it never ends the search early. But once two candidates have
failed with the same error signature (`compile.error_signature`: the compiler's line without
paths and numbers), the untried candidates that share every setting those two share (their
"siblings", e.g. every remat policy at grad_accum=2 on that mesh; with more failures, what a
group of them shares, e.g. grad_accum=2 on any mesh) are skipped as "same compiler error as
<the first failure with those settings>", unless a candidate with those settings compiled: the
compiler fails on a construct, and what failures have in common and no success has is the
likeliest cause.
"""

from __future__ import annotations

import itertools
from collections import Counter

import ml_collections as mlc

from jaxscale.aot.compile import error_signature
from jaxscale.aot.plan import (
    SAME_ERROR,
    SKIP_GUESSED,
    SKIP_INVALID,
    Candidate,
    _all_candidates,
    dominated,
    far_over,
    fits,
    implied_over,
    slower_than,
    specified,
    step_s,
)
from jaxscale.aot.topology import Topology
from jaxscale.hardware import hbm_budget

# A neighbour past the budget is compiled when its guessed step is under the best's guess
# times this: the guess cannot tell a data x fsdp split from its sibling (their collectives
# differ by an all-reduce of a shard), so "about as fast" is worth a compile too.
NEAR = 1.02
# The fields a neighbour may differ in, grouped: a mesh (split) is one choice.
CHOICES = (("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.pipeline", "mesh.expert",
            "mesh.context", "model.context_attention", "mesh.dcn_data"),
           ("rules_preset",), ("model.remat",), ("model.attention",), ("model.loss_chunks",),
           ("train.grad_accum",), ("pipeline.schedule", "pipeline.microbatches"))
MAX_STEPS = 2  # choices a neighbour may differ in: lighter remat with more accumulation is 2
MAX_RULES = 256  # same-error rules per signature: their intersections stop growing there

SKIP_DOMINATED = "dominated by a fitting one (costs more, saves nothing)"
SKIP_OVER = "needs no less HBM than one over HBM"
SKIP_SLOWER = "compute alone slower than the best step"
SKIP_SCALED = "guessed over HBM once scaled as compiled ones of its remat"
COMPILED, DROPPED, NEIGHBOURS = "compiled", "compiled, then dominated", "neighbours past the budget"
SKIPS = (SKIP_GUESSED, SKIP_INVALID, SKIP_DOMINATED, SKIP_OVER, SKIP_SCALED, SKIP_SLOWER)


def _remat(cand: Candidate) -> str:
    return (cand.full or cand.overrides).get("model.remat", "")


def signature(result: dict) -> str:
    """A failed result's error signature ("" for none, e.g. a worker that died, which may be
    this machine's doing rather than the compiler's): its own, else its error line's."""
    if "error" not in result:
        return ""
    return result.get("signature", error_signature(result["error"]))


def _shared(group: list[Candidate]) -> dict:
    full = lambda c: c.full or c.overrides
    return {k: v for k, v in full(group[0]).items() if all(full(c).get(k) == v for c in group)}


def _has(cand: Candidate, settings: dict) -> bool:
    full = cand.full or cand.overrides
    return all(full.get(k) == v for k, v in settings.items())


def same_error_rules(results: list[tuple[int, Candidate, dict]]
                     ) -> list[tuple[dict, Candidate]]:
    """(settings, the first failure with them), most general first: the rules learned from
    compiler failures. Per error signature, the settings each two of its failures share, and
    the settings shared by any larger group of them (the intersections of those), each kept
    only while no compiled candidate (one that did not fail) has all of them. A candidate with
    every setting of a rule is a sibling of its failures (`Frontier.why_skip`): the failures
    name a construct the compiler cannot take, and it is in what they have in common that no
    success has. A rule can be wider than the cause (a cause such as "any grad_accum above 1"
    is no one setting); the plan lists what it skipped, for compiling by hand."""
    failed: dict[str, list[Candidate]] = {}
    for _, cand, result in sorted(results, key=lambda x: x[0]):
        if sig := signature(result):
            failed.setdefault(sig, []).append(cand)
    compiled = [cand for _, cand, result in results if "error" not in result]
    holds = lambda s: bool(s) and not any(_has(c, dict(s)) for c in compiled)
    rules = []
    for group in failed.values():
        found = {frozenset(_shared([a, b]).items()) for a, b in itertools.combinations(group, 2)}
        found = {s for s in found if holds(s)}
        grown = True
        while grown and len(found) < MAX_RULES:
            grown = False
            for a, b in itertools.combinations(list(found), 2):
                if (both := a & b) not in found and holds(both):
                    found.add(both)
                    grown = True
        rules += [(dict(s), next(c for c in group if _has(c, dict(s)))) for s in found]
    return sorted(rules, key=lambda rule: (len(rule[0]), rule[1].label()))


def steps_apart(a: Candidate, b: Candidate) -> int:
    """How many `CHOICES` two candidates differ in (every field spelled out: `full`)."""
    fa, fb = a.full or a.overrides, b.full or b.overrides
    return sum(any(fa.get(k) != fb.get(k) for k in group) for group in CHOICES)


class Frontier:
    """The listed candidates, what has been taken from them, and what the compiled ones say."""

    def __init__(self, config: mlc.ConfigDict, topology: Topology, margin: float,
                 space: Counter | None = None, listed: list[Candidate] | None = None):
        """`listed`: `plan._all_candidates` of these arguments, where the caller has it."""
        self.config, self.topology, self.margin = config, topology, margin
        self.listed = _all_candidates(config, topology, margin) if listed is None else listed
        self.space = Counter() if space is None else space
        self.taken: set[int] = set()
        self.kept: list[tuple[int, Candidate, dict]] = []
        self.fitting: list[Candidate] = []
        self.over: list[Candidate] = []
        self.best: tuple[int, Candidate, dict] | None = None
        self.scale: dict[str, float] = {}  # remat -> compiled / guessed bytes, mean
        self.rules: list[tuple[dict, Candidate]] = []  # `same_error_rules`
        self._main = 0  # the next index of the search order

    def learn(self, results: list[tuple[int, Candidate, dict]]) -> None:
        """The results in search order without those an earlier fitting one dominates; the
        fitting ones, those over HBM, and the best (fastest fitting) of them."""
        self.kept, self.fitting, self.over = [], [], []
        for index, cand, result in sorted(results, key=lambda x: x[0]):
            if dominated(cand, self.fitting):
                continue
            self.kept.append((index, cand, result))
            if fits(result, self.margin):
                self.fitting.append(cand)
            elif "error" not in result:
                self.over.append(cand)
        ratios: dict[str, list[float]] = {}
        for _, cand, result in results:
            if "error" not in result and cand.guess_bytes:
                ratios.setdefault(_remat(cand), []).append(result["total_bytes"] / cand.guess_bytes)
        self.scale = {r: sum(v) / len(v) for r, v in ratios.items()}
        ok = [k for k in self.kept if fits(k[2], self.margin)]
        self.best = min(ok, key=lambda k: (step_s(k[2]), k[0])) if ok else None
        self.rules = same_error_rules(results)

    @property
    def counted(self) -> int:
        """The kept results that use the candidate budget: all but failures (a failure never
        ends the search early; its siblings are skipped instead, `same_error_rules`)."""
        return sum("error" not in result for _, _, result in self.kept)

    def why_skip(self, cand: Candidate) -> str | None:
        """The reason `cand` cannot win, from the guess and the compiled results, or None."""
        if far_over(cand, self.topology, self.margin):
            return SKIP_GUESSED
        if dominated(cand, self.fitting):
            return SKIP_DOMINATED
        if implied_over(cand, self.over):
            return SKIP_OVER
        if self._scaled_over(cand):
            return SKIP_SCALED
        if self.best is not None and slower_than(cand, step_s(self.best[2])):
            return SKIP_SLOWER
        for settings, first in self.rules:
            if _has(cand, settings):
                return SAME_ERROR + first.label()
        return None

    def _scaled_over(self, cand: Candidate) -> bool:
        """The memory guess is off by a factor that depends on the remat policy and the shape
        (`guess.CALIBRATION`): scaled by what compiled candidates of the same policy came to
        (a refusal's temporaries, a lower bound, included), is it over the HBM budget?"""
        scale = self.scale.get(_remat(cand))
        budget = hbm_budget(self.topology.chip.hbm_limit_bytes, self.margin)
        return bool(scale and cand.guess_bytes and cand.guess_bytes * scale > budget)

    def _doubted(self, cand: Candidate) -> bool:
        """Whether the memory guess (scaled as compiled ones of its remat, where there are)
        puts `cand` over the budget, or there is none: past the budget only a likely fit is
        worth a compile."""
        budget = hbm_budget(self.topology.chip.hbm_limit_bytes, self.margin)
        if cand.guess_bytes is None:  # no guess (pipeline stages): nothing says it may win
            return True
        return cand.guess_bytes * self.scale.get(_remat(cand), 1.0) > budget

    def next(self, room: bool, extra: bool) -> tuple[int, Candidate] | None:
        """The next candidate to compile (its index in the search order): the next in order
        that may win while the budget has `room`; past it, while there is `extra` room, the
        next in order while nothing fits yet, else an untried neighbour of the best that may
        beat it; None when there is none."""
        onward = room or (extra and self.best is None)  # nothing fits yet: the budget buys a plan
        while onward and self._main < len(self.listed):
            self._main += 1
            if self._main - 1 not in self.taken and (got := self._take(self._main - 1)):
                return got
        return self._neighbour() if extra and not room else None

    def _take(self, index: int) -> tuple[int, Candidate] | None:
        self.taken.add(index)
        cand = self.listed[index]
        why = self.why_skip(cand)
        if why is None and (spec := specified(self.config, cand)) is not None:
            return index, spec
        self.space[why or SKIP_INVALID] += 1
        return None

    def _neighbour(self) -> tuple[int, Candidate] | None:
        if self.best is None:
            return None
        best = self.best[1]
        for index, cand in enumerate(self.listed):
            if (index in self.taken or steps_apart(cand, best) > MAX_STEPS
                    or (cand.guess_s or 0.0) > (best.guess_s or 0.0) * NEAR
                    or self._doubted(cand)):
                continue
            if got := self._take(index):
                self.space[NEIGHBOURS] += 1
                return got
        return None

    def finish(self, results: list[tuple[int, Candidate, dict]]) -> None:
        """Counts the compiled, those dropped after compiling, and those never reached."""
        self.learn(results)
        self.space[COMPILED] += len(results)
        self.space[DROPPED] += len(results) - len(self.kept)
        self.space["listed"] = len(self.listed)
        self.space["not reached"] = len(self.listed) - len(self.taken)


def space_line(space: Counter) -> str:
    """The search space in one line: how much was compiled, what was skipped and why (every
    listed candidate is counted once: compiled, skipped for a reason, or not reached)."""
    extra = [f"{space[k]} {k}" for k in (NEIGHBOURS, DROPPED) if space.get(k)]
    skips = [f"{space[k]} {k}" for k in SKIPS if space.get(k)] + [
        f"{n} {k}" for k, n in space.items() if k.startswith(SAME_ERROR) and n]
    return (f"Search space: {space.get('listed', 0)} candidates; {space.get(COMPILED, 0)} "
            f"compiled" + (f" ({', '.join(extra)})" if extra else "") + "; skipped: "
            + (", ".join(skips) or "none") + f"; {space.get('not reached', 0)} not reached.")
