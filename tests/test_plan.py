"""The sharding planner (`launch.plan`): candidates and their order, what cannot win, the
search with several compiling processes, and the table it prints.

The end-to-end tests run the entry point in subprocesses with libtpu (skipped without it).
"""

import re
from types import SimpleNamespace

import pytest

from aot_common import TINY, libtpu_test, run_module
from configs import llama
from jaxscale.aot.topology import parse_topology
from jaxscale.errors import ConfigError
from jaxscale.weights.tree import unflatten
from plan_stand_in import DYING, compile_or_die, dies


def test_planner_candidates_cover_pipelines_and_skip_equivalent_presets():
    # The listing before validation (validating all 1,000 costs a minute): what is listed.
    from jaxscale.aot.plan import Candidate, _all_candidates, apply, dominated, iter_candidates

    c, topology = llama.get_config("tiny"), parse_topology("v5p:2x2x2")
    found = [_view(cand.overrides) for cand in _all_candidates(c, topology)]
    first = apply(c, next(iter_candidates(c, topology)).overrides)
    # Likeliest winner first: the tiny model's state fits every chip, so data parallelism (no
    # weight gathers) is guessed fastest.
    assert first.mesh.data == 8 and first.mesh.pipeline == 1 and first.rules_preset == "dp"
    assert found[0] == _view(next(iter_candidates(c, topology)).full)
    piped = [x for x in found if x.mesh.pipeline > 1]
    assert {x.pipeline.schedule for x in piped} == {"1f1b", "gpipe"}
    assert all(c.model.num_layers % x.mesh.pipeline == 0 for x in piped)
    assert all((c.data.batch_size // x.train.grad_accum) % x.pipeline.microbatches == 0
               for x in piped)
    assert found.index(piped[0]) > max(i for i, x in enumerate(found) if x.mesh.pipeline == 1)
    assert {x.model.remat for x in found} == {"full", "save_qkv_proj", "save_dot_except_mlp",
                                              "minimal", "dots_no_batch", "dots", "none"}
    # bf16 logits are searched beside float32 ones under bf16-mixed (the same work), first;
    # where they fit, the float32 twin cannot win
    # (`test_the_search_order...`); other policies are searched as they are.
    assert {x.precision for x in found} == {c.precision} == {"32-true"}
    bf16 = Candidate({"mesh.fsdp": 8, "precision": "bf16-mixed,logits=bfloat16"})
    assert dominated(Candidate({"mesh.fsdp": 8, "precision": "bf16-mixed"}), [bf16])
    assert not dominated(bf16, [Candidate({"mesh.fsdp": 8, "precision": "bf16-mixed"})])
    # `tp` without tensor parallelism is `dp`, and `dp` over fsdp is `dp` over data: not searched.
    assert not any(x.rules_preset in ("tp", "fsdp_tp") and x.mesh.tensor == 1 for x in found)
    assert not any(x.rules_preset == "dp" and x.mesh.fsdp > 1 for x in found)
    # More accumulation than a fitting candidate with the same settings cannot win.
    fits = Candidate({"mesh.fsdp": 8, "train.grad_accum": 2})
    assert dominated(Candidate({"mesh.fsdp": 8, "train.grad_accum": 4}), [fits])
    assert not dominated(Candidate({"mesh.fsdp": 8}), [fits])
    assert not dominated(Candidate({"mesh.fsdp": 4, "train.grad_accum": 4}), [fits])
    # So does a chunked loss where the whole one fits; where it does not, chunking is tried
    # before more accumulation.
    whole = Candidate({"mesh.fsdp": 8, "model.loss_chunks": 1})
    assert dominated(Candidate({"mesh.fsdp": 8, "model.loss_chunks": 8}), [whole])
    assert not dominated(Candidate({"mesh.fsdp": 8, "model.loss_chunks": 1}), [whole])
    assert not dominated(Candidate({"mesh.fsdp": 8, "model.loss_chunks": 1}),
                          [Candidate({"mesh.fsdp": 8, "model.loss_chunks": 8})])
    mesh_of = lambda x: (x.mesh.pipeline, x.mesh.fsdp, x.mesh.data, x.mesh.tensor, x.rules_preset,
                         x.model.remat, x.model.attention)
    found = [x for x in found if x.mesh.pipeline == 1]
    first = [x for x in found if mesh_of(x) == mesh_of(found[0])]
    assert [(x.train.grad_accum, x.model.loss_chunks) for x in first][:1] == [(1, 1)]
    assert {(x.train.grad_accum, x.model.loss_chunks) for x in first} >= {(1, 8), (2, 1)}
    # The attention implementation is a choice where the splash kernel applies (length on its
    # 128 grid): splash first, einsum too; the tiny preset's 64 tokens keep einsum alone.
    assert {x.model.attention for x in found} == {"einsum"}
    c.data.seq_len = 256
    found = [_view(cand.overrides) for cand in _all_candidates(c, topology)]
    assert found[0].model.attention == "splash"
    assert {x.model.attention for x in found} == {"splash", "einsum"}


def _view(fields: dict) -> SimpleNamespace:
    """A candidate's dotted fields as attributes (`x.mesh.fsdp`), without building a config."""
    as_ns = lambda d: SimpleNamespace(**{k: as_ns(v) if isinstance(v, dict) else v
                                         for k, v in d.items()})
    return as_ns(unflatten({key.replace(".", "/"): value for key, value in fields.items()}))


def test_the_planner_shards_long_sequences_over_context_only():
    """A long sequence (`choices.LONG_SEQUENCE`) adds `mesh.context` candidates with each
    attention variant (einsum tiles or splash blocks inside), after those without; a short
    one gets none."""
    from jaxscale.aot.choices import LONG_SEQUENCE
    from jaxscale.aot.plan import _all_candidates, specified

    c = llama.get_config("tiny")
    c.data.update(seq_len=LONG_SEQUENCE, batch_size=2)  # few candidates: a cheap test
    c.model.update(max_len=LONG_SEQUENCE, num_layers=1)
    listed = _all_candidates(c, parse_topology("v5p:2x2x1"))
    found = [_view({"mesh.context": 1, **cand.overrides}) for cand in listed]
    sharded = [x for x in found if x.mesh.context > 1]
    # Validated (a few: validating all costs): splash blocks and einsum tiles both run on shards.
    some = [cand for cand in listed if cand.overrides.get("mesh.context", 1) > 1
            and cand.overrides["model.remat"] == "full" and cand.overrides["train.grad_accum"] == 1]
    valid = [_view(cand.overrides) for cand in some if specified(c, cand)]
    assert {x.model.attention for x in valid} == {"splash", "einsum"}
    assert len(valid) == len(some)
    assert {x.model.attention for x in sharded} == {"splash", "einsum"}
    sharded = [x for x in sharded if x.model.attention == "einsum"]
    assert {(x.mesh.context, x.model.context_attention) for x in sharded} == {
        (n, v) for n in (2, 4) for v in ("ring", "allgather")}
    assert all(x.mesh.context * x.mesh.data * x.mesh.fsdp * x.mesh.tensor * x.mesh.pipeline == 4
               for x in found)
    assert found[0].mesh.context == 1 and found.index(sharded[0]) > 0
    c.data.seq_len = LONG_SEQUENCE // 2
    assert all(cand.overrides.get("mesh.context", 1) == 1
               for cand in _all_candidates(c, parse_topology("v5p:2x2x1")))


def test_the_search_order_is_the_guessed_step_time_of_what_is_guessed_to_fit():
    """Candidates the memory guess says fit come first, fastest guessed step first (compute
    with the remat's recompute, plus the mesh's and accumulation's collectives); then those it
    doubts, least guessed bytes first; those guessed over `FAR_OVER` x the budget are never
    compiled."""
    from collections import Counter

    from jaxscale.aot.choices import BF16_LOGITS
    from jaxscale.aot.plan import FAR_OVER, _all_candidates, far_over, iter_candidates

    c = llama.get_config("1b")
    c.data.batch_size = 64
    for name in ("v5p:2x2x4", "v5e:4x4"):
        topology = parse_topology(name)
        budget = topology.chip.hbm_limit_bytes * 0.9
        listed = _all_candidates(c, topology)
        flat = [x for x in listed if x.overrides["mesh.pipeline"] == 1]
        doubts = [x.guess_bytes > budget for x in flat]
        assert doubts == sorted(doubts) and not doubts[0] and doubts[-1]
        times = [float(f"{x.guess_s:.4g}") for x, d in zip(flat, doubts) if not d]
        assert times == sorted(times), name
        doubted = [x.guess_bytes for x, d in zip(flat, doubts) if d]
        assert doubted == sorted(doubted), name
        # The first recomputes little: nothing on v5p-16 (1B, 4 sequences a chip: 22.7 GiB
        # compiled of 95, bench/RESULTS.md), attention only on v5e-16 (the projections kept).
        assert flat[0].overrides["model.remat"] == {"v5p:2x2x4": "dots",
                                                    "v5e:4x4": "minimal"}[name]
        skipped = Counter()
        first = next(iter_candidates(c, topology, skipped=skipped, listed=listed))
        assert first.full == flat[0].overrides
        assert not any(far_over(x, topology, 0.1) for x in listed[:listed.index(flat[0])])
    assert first.full["model.remat"] == "minimal"
    assert first.full["precision"] == "bf16-mixed,logits=bfloat16" == c.precision + BF16_LOGITS
    assert {x.overrides["precision"] for x in listed} == {c.precision, c.precision + BF16_LOGITS}
    assert any(x.guess_bytes > FAR_OVER * budget for x in listed)  # v5e: no remat at 4 a chip
    assert far_over(next(x for x in listed if x.guess_bytes > FAR_OVER * budget), topology, 0.1)


def test_what_cannot_win_or_cannot_fit_is_not_compiled():
    from jaxscale.aot.plan import Candidate, dominated, implied_over, slower_than

    # Where no remat fits, more remat with the same settings cannot win.
    none = Candidate({"mesh.fsdp": 8, "model.remat": "none"})
    assert dominated(Candidate({"mesh.fsdp": 8, "model.remat": "full"}), [none])
    assert not dominated(Candidate({"mesh.fsdp": 8, "model.remat": "none"}),
                          [Candidate({"mesh.fsdp": 8, "model.remat": "full"})])
    qkv = Candidate({"mesh.fsdp": 8, "model.remat": "save_qkv_proj"})
    assert dominated(Candidate({"mesh.fsdp": 8, "model.remat": "full"}), [qkv])
    assert not dominated(qkv, [Candidate({"mesh.fsdp": 8, "model.remat": "full"})])
    # Where one is over HBM, what needs no less (lighter remat, less accumulation, fewer loss
    # chunks, einsum's scores) is over too; what needs less in one field may fit.
    over = Candidate({"mesh.fsdp": 8, "model.remat": "minimal", "train.grad_accum": 2,
                      "model.attention": "splash"})
    same = {"mesh.fsdp": 8, "model.attention": "splash"}
    assert implied_over(Candidate({**same, "model.remat": "none", "train.grad_accum": 1}), [over])
    assert implied_over(Candidate({**over.overrides, "model.attention": "einsum"}), [over])
    assert not implied_over(Candidate({**same, "model.remat": "none", "train.grad_accum": 4}),
                            [over])
    assert not implied_over(Candidate({**same, "model.remat": "full", "train.grad_accum": 2}),
                            [over])
    assert not implied_over(Candidate({**over.overrides, "mesh.fsdp": 4}), [over])
    # Compute alone slower than the best step cannot win.
    assert slower_than(Candidate({}, compute_s=2.0), 1.9)
    assert not slower_than(Candidate({}, compute_s=1.8), 1.9)
    assert not slower_than(Candidate({}, compute_s=2.0), None)


def test_the_guess_orders_the_remat_policies_by_what_they_save():
    from jaxscale.aot.guess import dims_of, remat_bytes
    from jaxscale.aot.memory import host_bytes
    from jaxscale.aot.plan import REMATS

    c = llama.get_config("7b")
    dims = dims_of(c)
    mesh = {"data": 1, "fsdp": 16, "tensor": 1, "pipeline": 1}
    guess = {r: remat_bytes(c, dims, mesh, 1, "splash", 1, r)
             for r in REMATS + ("save_out_proj", "minimal", "qkv_proj_offloaded")}
    # Searched order is most recompute (least memory) first.
    assert [guess[r] for r in REMATS] == sorted(guess[r] for r in REMATS)
    assert guess["full"] < guess["save_out_proj"] < guess["save_qkv_proj"]
    assert guess["save_dot_except_mlp"] < guess["minimal"] < guess["none"] == guess["dots"]
    # Offloading keeps the saved activations off the chip: HBM as full, the rest on the host
    # (q/k/v of 7B: (32 + 2 x 32) x 128 bf16 values a token and layer).
    assert guess["qkv_proj_offloaded"] == guess["full"]
    tokens = c.data.batch_size / 16 * c.data.seq_len
    assert host_bytes(dims, tokens=tokens, remat="qkv_proj_offloaded") == (
        tokens * dims.num_layers * 96 * 128 * 2)
    assert host_bytes(dims, tokens=tokens, remat="save_qkv_proj") == 0


@libtpu_test
@pytest.mark.slow
def test_plan_ranks_compiled_candidates_and_caches(tmp_path):
    # Two compiling processes at once (libtpu's process lock is lifted for compile-only use);
    # the rerun, one process from the cache, prints the same table in the same order.
    args = ["launch.plan", "--topology=v5p:2x2x1", *TINY, "--max_candidates=3", "--top=3",
            f"--cache_dir={tmp_path}"]
    proc = run_module([*args, "--workers=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 candidates compiled" in proc.stdout and "winner: --config." in proc.stdout
    cached = sorted(tmp_path.glob("*.json"))  # 3, and any compiled alongside, then dropped
    assert len(cached) >= 3
    again = run_module([*args, "--workers=1"], tmp_path)
    # The search-space line may differ: two workers can have one more compile in flight when
    # the first ones rule it out ("1 compiled, then dominated"); the table may not.
    table = lambda out: [line for line in out.splitlines() if not line.startswith("Search space:")]
    assert table(again.stdout) == table(proc.stdout)
    assert "Search space:" in again.stdout and "Search space:" in proc.stdout
    assert sorted(tmp_path.glob("*.json")) == cached  # nothing compiled again


@libtpu_test
def test_plan_with_nothing_fitting_names_the_closest_and_what_is_left_to_try(tmp_path):
    # 1B on one 16 GB v5e chip: its state alone is 13 GB, so libtpu refuses every candidate.
    # Nothing is guessed to fit, so the least memory is tried first (full remat, splash, the
    # loss in chunks); its refusal rules out every other candidate (each needs no less), so one
    # compile answers. The advice leaves out what the candidate does already.
    proc = run_module(["launch.plan", "--topology=v5e:1x1", "--config=configs/llama.py:1b",
                 "--config.data.batch_size=1", "--max_candidates=2",
                 f"--cache_dir={tmp_path}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]  # nothing fits: not a success (issue 44)
    assert "jaxscale: error: No candidate fits v5e:1x1" in proc.stderr
    assert "0 fit with a 10% HBM margin, 1 do not" in proc.stdout
    space = re.search(r"Search space: (\d+) candidates; 1 compiled; skipped: .*?(\d+) needs no "
                      r"less HBM than one over HBM; 0 not reached\.", proc.stdout)
    assert space and int(space[2]) > 0, proc.stdout
    advice = re.search(r"No candidate fits\. Closest: (.*) at [\d.]+ GiB per chip, over the "
                       r"14\.2 GiB budget by [\d.]+ GiB\. To fit: (.*)\.", proc.stdout)
    assert advice, proc.stdout
    assert "attention=splash" in advice[1]
    assert "more chips" in advice[2] and "optim.name=adam8bit" in advice[2]
    assert "remat=full" not in advice[2] and "attention=splash" not in advice[2]
    assert "loss_chunks" not in advice[2]


def _pool_broken_before_next_submit(workers: int):
    """The search's process pool, except that submitting a compile that kills its worker
    returns only once the pool is broken: the search's next submit then meets the broken pool
    (on a busy machine that happens by chance)."""
    import concurrent.futures as cf
    import multiprocessing

    from jaxscale.aot.topology import compile_only_env

    class Pool(cf.ProcessPoolExecutor):
        def submit(self, fn, config_json, *args):
            job = super().submit(fn, config_json, *args)
            if dies(config_json):
                cf.wait([job])  # failed by the dead worker, with every other job in the pool
            return job

    return Pool(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=compile_only_env)


def test_a_compiling_process_that_dies_fails_only_its_candidate(tmp_path, monkeypatch):
    # With 3 workers the dead one breaks the pool under the others' compiles, before the search
    # has submitted all it can: the others run again, each alone, the refused one goes to a new
    # pool, and the result is the one a single worker gets.
    from jaxscale.aot import frontier
    from jaxscale.aot import search as search_lib

    monkeypatch.setattr(search_lib, "_pool", _pool_broken_before_next_submit)
    monkeypatch.setattr(frontier, "implied_over", lambda cand, over: False)  # all compiled in turn
    c, topology = llama.get_config("tiny"), parse_topology("v5p:2x2x1")
    # 2 candidates, then 2 more: nothing fits (every stand-in result is over HBM); the deaths
    # use none of that budget.
    runs = [search_lib.search(c, topology, str(tmp_path), max_candidates=2, workers=w,
                              compile_fn=compile_or_die) for w in (1, 3)]
    for results in runs:
        died = [cand.full for cand, r in results if "error" in r]
        assert died and all(f["model.remat"] in DYING for f in died)
        assert all(r["error"].startswith("the compiling process died") for _, r in results
                   if "error" in r)
        assert len(results) - len(died) == 4 and len(died) >= 2
    assert [(cand.overrides, r) for cand, r in runs[0]] == [
        (cand.overrides, r) for cand, r in runs[1]]


def test_a_vision_model_is_refused_in_one_paragraph():
    from configs import vit_digits
    from jaxscale.aot.plan import candidates

    with pytest.raises(ConfigError, match="model.name='vit' is not one"):
        candidates(vit_digits.get_config(), parse_topology("v5p:2x2x1"))


def test_the_planner_searches_the_expert_axis_for_moe_models_only():
    # An MoE model's experts split over `expert` as well as data / fsdp / tensor (most expert
    # parallelism first: each chip computes its own experts, no expert weight moves); the batch
    # splits over it too. A dense model gets no expert axis (validation refuses one); dropless
    # MoE gets it as the capacity path does. The listing is read before validation
    # (`_all_candidates`), which is what costs.
    from configs import mixtral
    from jaxscale.aot.plan import _all_candidates, _valid, apply, iter_candidates

    topology = parse_topology("v5p:2x2x1")
    moe = mixtral.get_config("tiny")
    listed = [apply(moe, cand.overrides) for cand in _all_candidates(moe, topology)]
    assert {x.mesh.expert for x in listed} == {1, 2, 4}
    assert any(x.mesh.expert == 2 and x.mesh.fsdp == 2 for x in listed)
    assert all(x.data.batch_size // x.train.grad_accum % (x.mesh.expert * x.mesh.fsdp
                                                          * x.mesh.data) == 0 for x in listed)
    first = next(iter_candidates(moe, topology))
    assert first.full["mesh.expert"] == 4 and first.full["mesh.fsdp"] == 1
    dense = llama.get_config("tiny")
    assert all("mesh.expert" not in cand.full for cand in _all_candidates(dense, topology))
    assert _valid(moe, first.full)
    moe.model.moe.capacity_factor = 0.0
    assert _valid(moe, first.full)


def _simulate(front, max_candidates: int, compile_fn) -> list:
    """`search`'s loop without processes: what the frontier hands out, compiled in turn."""
    results = []
    while True:
        front.learn(results)
        got = front.next(len(front.kept) < max_candidates,
                         extra=len(front.kept) < 2 * max_candidates)
        if got is None:
            front.finish(results)
            return results
        results.append((*got, compile_fn(got[1])))


def test_the_frontier_skips_what_compiled_results_rule_out_and_expands_the_best():
    # A stand-in compiler (no TPU): a candidate fits where its memory guess does, and its step is the guessed one, except that the search order's very first is
    # slower than guessed. With a 2-candidate budget the search keeps going past it to the
    # best's untried neighbours that the guess says may beat it, up to as many again.
    from jaxscale.aot.frontier import (
        MAX_STEPS,
        NEIGHBOURS,
        SKIP_DOMINATED,
        SKIP_OVER,
        SKIP_SCALED,
        SKIPS,
        Frontier,
        space_line,
        steps_apart,
    )
    from jaxscale.aot.plan import _all_candidates, dominated, fits, implied_over

    c = llama.get_config("1b")
    c.data.batch_size = 64
    topology = parse_topology("v5e:4x4")
    budget = topology.chip.hbm_limit_bytes * 0.9
    listed = _all_candidates(c, topology)  # once: each frontier below starts from it

    def compile_fn(cand):
        slow = 1.5 if cand.full == front.listed[0].overrides else 1.0
        return {"total_bytes": cand.guess_bytes or 2 * budget, "hbm_bytes": budget / 0.9,
                "estimate": {"no_overlap_s": cand.guess_s * slow, "full_overlap_s": 0.0,
                             "mfu_full_overlap": None}}

    front = Frontier(c, topology, 0.1, listed=listed)
    results = _simulate(front, 2, compile_fn)
    space = front.space
    compiled = [cand for _, cand, _ in results]
    assert 2 < len(compiled) <= 4 and space[NEIGHBOURS] == len(compiled) - 2
    counted = ("compiled", "not reached", *SKIPS)  # each listed candidate once
    assert sum(space[k] for k in counted) == space["listed"] == len(front.listed)
    best = front.best[1]
    assert best.full != front.listed[0].overrides  # a neighbour beat the first
    assert any(steps_apart(cand, best) <= MAX_STEPS for cand in compiled[2:])
    assert all(cand.guess_bytes <= budget for cand in compiled[2:])  # likely fits only
    assert f"{space['compiled']} compiled" in space_line(space)
    # Nothing compiled after a result that rules it out.
    for i, (_, cand, _) in enumerate(results):
        earlier = [(x, r) for _, x, r in results[:i]]
        assert not dominated(cand, [x for x, r in earlier if fits(r, 0.1)])
        assert not implied_over(cand, [x for x, r in earlier if not fits(r, 0.1)])
    # A larger budget meets over-HBM results and what they rule out.
    front = Frontier(c, topology, 0.1, listed=listed)
    _simulate(front, 12, compile_fn)
    assert front.space[SKIP_OVER] + front.space[SKIP_DOMINATED] > 0, dict(front.space)
    # The guess scaled as compiled ones came out: at 1.25x, those guessed over 80% of the
    # budget are not compiled once a candidate of their remat policy has been.
    scaled = lambda cand: {**compile_fn(cand), "total_bytes": 1.25 * compile_fn(cand)["total_bytes"]}
    front = Frontier(c, topology, 0.1, listed=listed)
    results = _simulate(front, 12, scaled)
    assert front.space[SKIP_SCALED] > 0 and front.scale
    remat = lambda cand: cand.full["model.remat"]
    for i, (_, cand, _) in enumerate(results):
        if cand.guess_bytes and remat(cand) in {remat(x) for _, x, _ in results[:i]}:
            assert cand.guess_bytes * 1.25 <= budget
    # Nothing fitting when the budget is spent: the search goes on in order, up to as many again.
    over = lambda cand: {**compile_fn(cand), "total_bytes": 2 * budget}
    front = Frontier(c, topology, 0.1, listed=listed)
    assert len(_simulate(front, 2, over)) == 4 and front.best is None

