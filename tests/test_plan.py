"""The sharding planner (`launch.plan`): candidates and their order, what cannot win, the
search with several compiling processes, and the table it prints.

The end-to-end tests run the entry point in subprocesses with libtpu (skipped without it).
"""

import json
import os
import re
import time

import pytest

from aot_common import TINY, libtpu_test, run_module
from configs import llama
from jaxscale.aot.topology import parse_topology
from jaxscale.errors import ConfigError


def test_planner_candidates_cover_pipelines_and_skip_equivalent_presets():
    from jaxscale.aot.plan import Candidate, apply, candidates, dominated

    c = llama.get_config("tiny")
    found = [apply(c, cand.overrides) for cand in candidates(c, parse_topology("v5p:2x2x2"))]
    assert found[0].mesh.fsdp == 8 and found[0].mesh.pipeline == 1  # likeliest winner first
    piped = [x for x in found if x.mesh.pipeline > 1]
    assert {x.pipeline.schedule for x in piped} == {"1f1b", "gpipe"}
    assert all(c.model.num_layers % x.mesh.pipeline == 0 for x in piped)
    assert all((x.data.batch_size // x.train.grad_accum) % x.pipeline.microbatches == 0
               for x in piped)
    assert found.index(piped[0]) > max(i for i, x in enumerate(found) if x.mesh.pipeline == 1)
    assert {x.model.remat for x in found} == {"full", "save_qkv_proj", "save_dot_except_mlp",
                                              "dots", "none"}
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
    first = [x for x in found if mesh_of(x) == mesh_of(found[0])]
    assert [(x.train.grad_accum, x.model.loss_chunks) for x in first[:3]] == [
        (1, 1), (1, 8), (2, 1)]
    # The attention implementation is a choice where the splash kernel applies (length on its
    # 128 grid): splash first, einsum too; the tiny preset's 64 tokens keep einsum alone.
    assert {x.model.attention for x in found} == {"einsum"}
    c.data.seq_len = 256
    found = [apply(c, cand.overrides) for cand in candidates(c, parse_topology("v5p:2x2x2"))]
    assert found[0].model.attention == "splash"
    assert {x.model.attention for x in found} == {"splash", "einsum"}


def test_the_planner_shards_long_sequences_over_context_only():
    """A long sequence (`choices.LONG_SEQUENCE`) adds `mesh.context` candidates with each
    attention variant (einsum tiles or splash blocks inside), after those without; a short
    one gets none."""
    from jaxscale.aot.choices import LONG_SEQUENCE
    from jaxscale.aot.plan import apply, candidates

    c = llama.get_config("tiny")
    c.data.update(seq_len=LONG_SEQUENCE, batch_size=2)  # few candidates: a cheap test
    c.model.update(max_len=LONG_SEQUENCE, num_layers=1)
    found = [apply(c, cand.overrides) for cand in candidates(c, parse_topology("v5p:2x2x1"))]
    sharded = [x for x in found if x.mesh.context > 1]
    assert {(x.mesh.context, x.model.context_attention) for x in sharded} == {
        (n, v) for n in (2, 4) for v in ("ring", "allgather")}
    assert {x.model.attention for x in sharded} == {"splash", "einsum"}
    assert all(x.mesh.context * x.mesh.data * x.mesh.fsdp * x.mesh.tensor * x.mesh.pipeline == 4
               for x in found)
    assert found[0].mesh.context == 1 and found.index(sharded[0]) > 0
    c.data.seq_len = LONG_SEQUENCE // 2
    assert all(apply(c, cand.overrides).mesh.context == 1
               for cand in candidates(c, parse_topology("v5p:2x2x1")))


def test_planner_tries_no_remat_first_only_where_the_guess_says_it_fits():
    from jaxscale.aot.plan import Candidate, apply, dominated, iter_candidates

    def first(c, topology):
        return apply(c, next(iter_candidates(c, parse_topology(topology))).overrides)
    # 1B at 4 sequences of 2,048 a chip on v5p-16: compiled without remat it needs 22.7 GiB of
    # 95 (bench/RESULTS.md) and skips the 1.24x recompute, so it is tried first.
    c = llama.get_config("1b")
    c.data.batch_size = 64
    assert first(c, "v5p:2x2x4").model.remat == "none"
    # 7B at 16 sequences a chip on v5p-32 would need about 180 GB of activations: full first.
    assert first(llama.get_config("7b"), "v5p:2x4x4").model.remat == "full"
    # On v5e-16 (16 GB a chip) the same 1B step without remat is guessed over, and so is
    # keeping every dot; keeping the attention's projections (the MLP recomputed) is guessed
    # to fit: the lightest policy that fits first, before full.
    assert first(c, "v5e:4x4").model.remat == "save_dot_except_mlp"
    # Where no remat fits, more remat with the same settings cannot win.
    none = Candidate({"mesh.fsdp": 8, "model.remat": "none"})
    assert dominated(Candidate({"mesh.fsdp": 8, "model.remat": "full"}), [none])
    assert not dominated(Candidate({"mesh.fsdp": 8, "model.remat": "none"}),
                          [Candidate({"mesh.fsdp": 8, "model.remat": "full"})])
    qkv = Candidate({"mesh.fsdp": 8, "model.remat": "save_qkv_proj"})
    assert dominated(Candidate({"mesh.fsdp": 8, "model.remat": "full"}), [qkv])
    assert not dominated(qkv, [Candidate({"mesh.fsdp": 8, "model.remat": "full"})])


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
    assert again.stdout == proc.stdout
    assert sorted(tmp_path.glob("*.json")) == cached  # nothing compiled again


@libtpu_test
def test_plan_with_nothing_fitting_names_the_closest_and_what_is_left_to_try(tmp_path):
    # 1B on one 16 GB v5e chip: its state alone is 13 GB, so libtpu refuses every candidate.
    # The advice leaves out what the candidates do already (full remat, splash attention).
    proc = run_module(["launch.plan", "--topology=v5e:1x1", "--config=configs/llama.py:1b",
                 "--config.data.batch_size=1", "--max_candidates=2",
                 f"--cache_dir={tmp_path}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 fit with a 10% HBM margin, 2 do not" in proc.stdout
    advice = re.search(r"No candidate fits\. Closest: (.*) at [\d.]+ GiB per chip, over the "
                       r"14\.2 GiB budget by [\d.]+ GiB\. To fit: (.*)\.", proc.stdout)
    assert advice, proc.stdout
    assert "attention=splash" in advice[1]
    assert "more chips" in advice[2] and "optim.name=adam8bit" in advice[2]
    assert "remat=full" not in advice[2] and "attention=splash" not in advice[2]


def _dies(config_json: str) -> bool:
    return json.loads(config_json)["model"]["loss_chunks"] > 1


def _compile_or_die(config_json: str, topology, cache_dir: str) -> dict:
    """A stand-in for the compiler, to test the search's handling of its processes: the worker
    dies at once on the candidates with a chunked loss (the second in search order, then every
    other), and elsewhere answers after a second (so that it is still compiling when its
    neighbour dies) with a result over HBM, so that the search compiles its candidates in order
    (what one that fits rules out is not under test here)."""
    if _dies(config_json):
        os._exit(1)  # a compile killed mid-way (out of memory, a libtpu crash)
    time.sleep(1.0)
    fsdp = json.loads(config_json)["mesh"]["fsdp"]
    return {"total_bytes": 2.0**31, "hbm_bytes": 2.0**30,
            "estimate": {"full_overlap_s": 1.0 / fsdp, "no_overlap_s": 1.0,
                         "mfu_full_overlap": None}}


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
            if _dies(config_json):
                cf.wait([job])  # failed by the dead worker, with every other job in the pool
            return job

    return Pool(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=compile_only_env)


def test_a_compiling_process_that_dies_fails_only_its_candidate(tmp_path, monkeypatch):
    # With 3 workers the dead one breaks the pool under the others' compiles, before the search
    # has submitted all it can: the others run again, each alone, the refused one goes to a new
    # pool, and the result is the one a single worker gets.
    from jaxscale.aot import search as search_lib

    monkeypatch.setattr(search_lib, "_pool", _pool_broken_before_next_submit)
    c, topology = llama.get_config("tiny"), parse_topology("v5p:2x2x1")
    runs = [search_lib.search(c, topology, str(tmp_path), max_candidates=4, workers=w,
                              compile_fn=_compile_or_die) for w in (1, 3)]
    for results in runs:
        died = [cand.full for cand, r in results if "error" in r]
        assert died and all(f["model.loss_chunks"] > 1 for f in died)
        assert all(r["error"].startswith("the compiling process died") for _, r in results
                   if "error" in r)
        assert len(results) == 4 and len(died) == 2
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
