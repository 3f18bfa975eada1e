"""The planner learning from compiler failures (issue 40): the failures use none of the candidate
budget, and once two have failed with the same error signature their untried siblings are
skipped. A stand-in compiler (no TPU) fails where libtpu 0.0.52 did: every candidate with two
accumulation steps.
"""

import pytest

from configs import llama
from jaxscale.aot.compile import compiler_line, error_signature
from jaxscale.aot.frontier import SKIPS, Frontier, same_error_rules, space_line
from jaxscale.aot.plan import SAME_ERROR, Candidate, _all_candidates, format_plan
from jaxscale.aot.topology import parse_topology

RET_CHECK = ("INTERNAL: RET_CHECK failure (third_party/tensorflow/compiler/xla/hlo/transforms/"
             "collectives/while_loop_all_reduce_code_motion.cc:1112) user->opcode() == "
             "HloOpcode::kAdd")


def test_the_error_signature_is_the_compiler_check_without_paths_and_numbers():
    error = RuntimeError(f"jax raised\n\n{RET_CHECK} \n  at some frame 12")
    assert compiler_line(error) == RET_CHECK  # the check's line, not the first
    assert compiler_line(RuntimeError("UNIMPLEMENTED: no\nmore")) == "UNIMPLEMENTED: no"
    sig = error_signature(RET_CHECK)
    assert sig == ("INTERNAL: RET_CHECK failure (while_loop_all_reduce_code_motion.cc:N) "
                   "user->opcode() == HloOpcode::kAdd")
    assert error_signature(RET_CHECK.replace("1112", "1200").replace("third_party/", "")) == sig
    assert error_signature("Mosaic: bad shape f32[128,3]") == "Mosaic: bad shape f32[N,N]"


def _cand(**fields) -> Candidate:
    full = {"mesh.data": 4, "mesh.fsdp": 4, "model.remat": "minimal", "train.grad_accum": 2,
            **fields}
    return Candidate(full, full)


def _failed(cand: Candidate, line: str = RET_CHECK) -> dict:
    return {"error": line, "signature": error_signature(line)}


OK = {"total_bytes": 1.0, "hbm_bytes": 2.0, "estimate": {"no_overlap_s": 1.0}}


def test_two_failures_make_a_rule_of_the_settings_they_share_unless_one_compiled():
    a, b = _cand(), _cand(**{"model.remat": "full"})
    assert same_error_rules([(0, a, _failed(a))]) == []  # one failure teaches nothing
    rules = same_error_rules([(0, a, _failed(a)), (3, b, _failed(b))])
    assert rules == [({"mesh.data": 4, "mesh.fsdp": 4, "train.grad_accum": 2}, a)]
    # Different errors are different causes; a worker that died is no compiler's verdict.
    assert same_error_rules([(0, a, _failed(a)), (3, b, _failed(b, "INTERNAL: other"))]) == []
    died = {"error": "the compiling process died", "signature": ""}
    assert same_error_rules([(0, a, died), (3, b, died)]) == []
    # A candidate with those settings that compiled refutes the rule.
    ok = _cand(**{"model.remat": "none"})
    assert same_error_rules([(0, a, _failed(a)), (1, ok, OK), (3, b, _failed(b))]) == []
    # Three failures: the settings all share, and those each pair shares where nothing that
    # compiled has them (c shares remat=full with b only on another mesh: that pair is refuted
    # by ok2, which compiled with remat=full and grad_accum=2 on a third mesh).
    c = _cand(**{"model.remat": "full", "mesh.data": 2, "mesh.fsdp": 8})
    ok2 = _cand(**{"model.remat": "full", "mesh.data": 1, "mesh.fsdp": 16})
    rules = same_error_rules([(0, a, _failed(a)), (1, b, _failed(b)), (2, c, _failed(c)),
                              (4, ok2, OK)])
    assert ({"train.grad_accum": 2}, a) not in rules  # ok2 has it: refuted
    assert ({"mesh.data": 4, "mesh.fsdp": 4, "train.grad_accum": 2}, a) in rules  # a and b
    assert all(s != {"model.remat": "full", "train.grad_accum": 2} for s, _ in rules)


def test_what_a_group_of_failures_shares_is_a_wider_rule():
    # No two of the three share only grad_accum=2 (and the mesh's fsdp=4), all three do: that
    # group's rule is the most general, and comes first.
    a = _cand(**{"model.loss_chunks": 1})
    b = _cand(**{"model.loss_chunks": 8, "mesh.data": 2})
    c = _cand(**{"model.loss_chunks": 1, "mesh.data": 2, "model.remat": "full"})
    rules = same_error_rules([(i, x, _failed(x)) for i, x in enumerate((a, b, c))])
    assert rules[0] == ({"mesh.fsdp": 4, "train.grad_accum": 2}, a)
    assert ({"mesh.data": 2, "mesh.fsdp": 4, "train.grad_accum": 2}, b) in rules  # b and c
    # A success with those settings leaves only the rules it does not have.
    ok = _cand(**{"model.loss_chunks": 8, "model.remat": "none"})
    rules = same_error_rules([(i, x, _failed(x)) for i, x in enumerate((a, b, c))]
                             + [(3, ok, OK)])
    assert all(not all(ok.full.get(k) == v for k, v in s.items()) for s, _ in rules)
    assert ({"mesh.data": 2, "mesh.fsdp": 4, "train.grad_accum": 2}, b) in rules


def _simulate(front: Frontier, max_candidates: int, compile_fn) -> list:
    """`search`'s loop without processes (failures use none of the budget, as there)."""
    results = []
    while True:
        front.learn(results)
        got = front.next(front.counted < max_candidates, extra=front.counted < 2 * max_candidates)
        if got is None:
            front.finish(results)
            return results
        results.append((*got, compile_fn(got[1])))


@pytest.fixture(scope="module")
def listed():
    c = llama.get_config("1b")
    c.data.batch_size = 256  # 16 sequences a chip: accumulation comes first in the order
    topology = parse_topology("v5e:4x4")
    return c, topology, _all_candidates(c, topology)


def test_the_search_skips_the_siblings_of_two_same_failures_and_goes_on(listed):
    c, topology, candidates = listed
    budget = topology.chip.hbm_limit_bytes * 0.9

    def compile_fn(cand):  # fails as libtpu 0.0.52 did: every step with 2 micro-batches
        if cand.full["train.grad_accum"] == 2:
            return {"error": RET_CHECK}  # no signature: the frontier derives it from the line
        return {"total_bytes": cand.guess_bytes or 2 * budget, "hbm_bytes": budget / 0.9,
                "estimate": {"no_overlap_s": cand.guess_s, "full_overlap_s": 0.0,
                             "mfu_full_overlap": None}}

    front = Frontier(c, topology, 0.1, listed=candidates)
    results = _simulate(front, 4, compile_fn)
    failed = [(i, cand) for i, (_, cand, r) in enumerate(results) if "error" in r]
    assert len(failed) >= 2, [cand.label() for _, cand, _ in results]
    # No failure ended the search: the 4 of the budget compiled beside the failures.
    assert front.counted >= 4 and len(results) >= 4 + len(failed)
    # After the second failure, nothing that has the settings of the first two was compiled.
    second = failed[1][0]
    settings = {k: v for k, v in failed[0][1].full.items() if failed[1][1].full.get(k) == v}
    assert settings["train.grad_accum"] == 2
    assert not any(all(cand.full.get(k) == v for k, v in settings.items())
                   for _, cand, _ in results[second + 1:])
    reason = SAME_ERROR + failed[0][1].label()
    assert front.space[reason] > 0, dict(front.space)
    # Every listed candidate counted once, the skipped siblings included, and said so.
    counted = ("compiled", "not reached", *SKIPS, reason)
    assert sum(front.space[k] for k in counted) == front.space["listed"] == len(candidates)
    assert f"{front.space[reason]} {reason}" in space_line(front.space)
    plan = format_plan([(cand, r) for _, cand, r in results], 0.1, 3, topology, c, front.space)
    assert f"   failed to compile: {failed[0][1].label()}: {RET_CHECK}" in plan
    assert f"   skipped: {reason} ({front.space[reason]} untried candidate" in plan
    assert "winner: " in plan


def test_failures_alone_do_not_end_the_search(listed):
    # Every candidate fails alike: the budget never fills, and the rules learned from the
    # failures (their shared settings widen as they differ more) end the search instead.
    c, topology, candidates = listed
    front = Frontier(c, topology, 0.1, listed=candidates)
    results = _simulate(front, 2, lambda cand: {"error": RET_CHECK})
    assert len(results) > 2 and front.counted == 0
    assert sum(n for k, n in front.space.items() if k.startswith(SAME_ERROR)) > 0
    assert front.space["not reached"] == 0  # each was compiled or skipped, none left waiting


def test_a_cached_result_is_keyed_on_the_code_and_the_compiler(monkeypatch):
    # A plan replayed from a cache written before the accumulation fix reported a winner that
    # no longer compiled: the key names the sources and the jax / libtpu versions too.
    from jaxscale.aot import search

    c, topology = llama.get_config("tiny"), parse_topology("v5e:2x2")
    key = search.cache_key(c, topology)
    assert key == search.cache_key(llama.get_config("tiny"), topology)
    assert len(search.code_version()) == 16
    monkeypatch.setattr(search, "code_version", lambda: "another tree")
    assert search.cache_key(c, topology) != key
