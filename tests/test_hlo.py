"""The HLO reader (`aot/hlo.py`, `aot/hlo_flops.py`) on HLO text: trip counts, FLOPs,
collectives, kernels, and both tuple syntaxes, with fixtures cut from real libtpu dumps.

`tests/hlo/jax-VERSION/` holds one windowed-einsum loop (libtpu's FSDP weight gather overlapped
with its matmul) of the 7B step on v5p:2x2x4 (`jaxscale compile --topology=v5p:2x2x4
--config=llama:7b --config.model.attention=splash --save_hlo=DIR`), as jax 0.10.2 and jax
0.12.0.1 dump it with libtpu 0.0.52: the loop condition and body from the HLO after SPMD
partitioning (`partitioned.hlo`, where FLOPs are counted) and after optimization
(`optimized.hlo`, where collectives are), with an ENTRY that runs the loop; metadata, backend
configs and layouts are cut. jax 0.10.2 writes `get-tuple-element(%p), index=4`, jax 0.12
`%p#4` in the operand: read as one, the two must count alike. Nothing here needs libtpu.
"""

import os

import pytest

from jaxscale.aot import hlo, hlo_flops
from jaxscale.aot.groups import replica_groups

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hlo")
VERSIONS = ("jax-0.10.2", "jax-0.12.0.1")


def _fixture(version: str, stage: str) -> str:
    with open(os.path.join(FIXTURES, version, f"{stage}.hlo")) as f:
        return f.read()


@pytest.mark.parametrize("version", VERSIONS)
def test_a_windowed_einsum_loop_counts_as_one_gathered_matmul(version):
    partitioned, optimized = _fixture(version, "partitioned"), _fixture(version, "optimized")
    # The fixture is in the syntax its version writes.
    assert ("get-tuple-element" in partitioned) == (version == "jax-0.10.2")
    # The q/k/v projection of x (32, 2048, 4096) with a weight (4096, 32 x 3 x 128) FSDP-sharded
    # 16 ways: the loop runs `i < 8` in steps of 2 (4 times), two 256-wide slices of the
    # contracted 4096 a pass; together exactly the unsplit matmul. A step of 1 read for the
    # counter doubled this (the 1.94x of issue 39).
    assert hlo_flops.flops(hlo.parse(partitioned)) == 2 * 32 * 2048 * 4096 * (32 * 3 * 128)
    permutes = hlo.collectives(hlo.parse(optimized))
    assert {(c.kind, c.executions) for c in permutes} == {("collective-permute", 4)}
    assert sorted(c.channel for c in permutes) == [4, 5, 6, 7]  # two rings, two directions
    # Each pass moves one 6 MiB weight shard a ring; over the loop every chip receives the whole
    # gathered weight once: 4096 x 12288 bf16 (the async form's two u32 flags aside).
    shard = 256 * 32 * 3 * 128 * 2
    assert all(shard <= c.bytes <= shard + 8 for c in permutes)
    assert sum(c.total_bytes for c in permutes) // shard == 4096 * 12288 * 2 // shard


def test_both_tuple_syntaxes_read_alike():
    old, new = (hlo.parse(_fixture(v, "optimized")) for v in VERSIONS)
    assert hlo.summarize(hlo.collectives(old)) == hlo.summarize(hlo.collectives(new))
    old, new = (hlo.parse(_fixture(v, "partitioned")) for v in VERSIONS)
    assert hlo_flops.dot_flops(old) == hlo_flops.dot_flops(new)
    # `%p#k` becomes the instruction older versions wrote, with the element's shape.
    [counter] = [i for i in new.comps["windowed_dot_general_cond_ag"]
                 if i.opcode == "get-tuple-element"]
    assert (counter.name, counter.shape) == ("param.9#4", "u32[]")


def test_tuple_shapes_split_at_their_top_level():
    assert hlo.split_tuple("(f32[8]{0:T(8)}, (s32[], u32[]), /*index=2*/bf16[4,2]{1,0})") == [
        "f32[8]{0:T(8)}", "(s32[], u32[])", "bf16[4,2]{1,0}"]
    assert hlo.split_tuple("f32[8]") == [] and hlo.split_tuple("()") == []


def test_replica_groups_in_every_hlo_format():
    assert replica_groups("replica_groups={{0,1},{2,3}}, x", 4) == [[0, 1], [2, 3]]
    assert replica_groups("replica_groups=[2,4]<=[8], x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == [[0, 4], [1, 5], [2, 6],
                                                                       [3, 7]]
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_1'}, x", 4) == [
        [0, 1], [2, 3]]
    assert replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}, x", 4) == [
        [0, 2], [1, 3]]


def test_loop_trip_count_from_the_condition_and_dot_flops():
    text = """HloModule m, num_partitions=2

%cond (p: (s32[], f32[8,4])) -> pred[] {
  %p = (s32[], f32[8,4]) parameter(0)
  %c = s32[] constant(5)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%body (q: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %q = (s32[], f32[8,4]) parameter(0)
  %x = f32[8,4] get-tuple-element(%q), index=1
  %w = f32[4,4] constant({...})
  %d = f32[8,4] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag = f32[8,8] all-gather(%d), replica_groups={{0,1}}, dimensions={1}
  ROOT %t = (s32[], f32[8,4]) tuple(%i, %d)
}

ENTRY %main (a: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4] parameter(0)
  %w = (s32[], f32[8,4]) while(%a), condition=%cond, body=%body
  ROOT %r = f32[8,4] get-tuple-element(%w), index=1
}
"""
    module = hlo.parse(text)
    assert hlo_flops.flops(module) == 5 * 2 * 8 * 4 * 4
    [ag] = hlo.collectives(module)
    assert (ag.kind, ag.bytes, ag.executions, ag.group, ag.in_loop) == ("all-gather", 256, 5, 2,
                                                                        True)


WINDOWED = """HloModule w, num_partitions=8

%wcond (p: (f32[8,4], f32[8,4], u32[])) -> pred[] {
  %p = (f32[8,4], f32[8,4], u32[]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=2
  %n = u32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%wbody (q: (f32[8,4], f32[8,4], u32[])) -> (f32[8,4], f32[8,4], u32[]) {
  %q = (f32[8,4], f32[8,4], u32[]) parameter(0)
  %x = f32[8,4] get-tuple-element(%q), index=0
  %acc = f32[8,4] get-tuple-element(%q), index=1
  %i = u32[] get-tuple-element(%q), index=2
  %w = f32[4,4] constant({...})
  %d0 = f32[8,4] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %d1 = f32[8,4] dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %cp = f32[8,4] collective-permute(%x), source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  %one = u32[] constant(1)
  %i1 = u32[] add(%i, %one)
  %i2 = u32[] add(%i1, %one)
  %s = f32[8,4] add(%d0, %d1)
  ROOT %t = (f32[8,4], f32[8,4], u32[]) tuple(%cp, %s, %i2)
}

ENTRY %main (a: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4] parameter(0)
  %w = (f32[8,4], f32[8,4], u32[]) while(%a), condition=%wcond, body=%wbody
  ROOT %r = f32[8,4] get-tuple-element(%w), index=1
}
"""


def test_windowed_einsum_loop_counts_its_own_counter():
    # libtpu's bidirectional windowed-einsum loops keep the counter last, run `i < N/2` in
    # steps of 2 (two iterations unrolled into one body): reading element 0 of the tuple as
    # the counter, or a step of 1, counted each such loop twice (the 1.9x of the 1B/7B steps).
    module = hlo.parse(WINDOWED)
    assert hlo_flops.flops(module) == 2 * 2 * (2 * 8 * 4 * 4)  # 2 iterations x 2 dots
    [cp] = hlo.collectives(module)
    assert (cp.kind, cp.executions, cp.bytes) == ("collective-permute", 2, 8 * 4 * 4)
    # After optimization libtpu copies the counter and adds 2 at once.
    optimized = WINDOWED.replace("%i1 = u32[] add(%i, %one)", "%i1 = u32[] copy(%i)").replace(
        "%one = u32[] constant(1)", "%one = u32[] constant(2)")
    assert hlo_flops.flops(hlo.parse(optimized)) == hlo_flops.flops(module)


def test_pallas_kernel_calls_are_counted_with_their_loop_trips():
    # A Pallas kernel is a `tpu_custom_call` with no dot inside: `flops` cannot see it, so its
    # executions are counted for the report to add (and label) the kernel's FLOPs.
    text = """HloModule k, num_partitions=1

%cond (p: (s32[], f32[8,4])) -> pred[] {
  %p = (s32[], f32[8,4]) parameter(0)
  %c = s32[] constant(3)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%body (q: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %q = (s32[], f32[8,4]) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %x = f32[8,4] get-tuple-element(%q), index=1
  %k = f32[8,4] custom-call(%x), custom_call_target="tpu_custom_call", backend_config={}
  ROOT %t = (s32[], f32[8,4]) tuple(%i, %k)
}

ENTRY %main (a: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4] parameter(0)
  %w = (s32[], f32[8,4]) while(%a), condition=%cond, body=%body
  %o = f32[8,4] custom-call(%a), custom_call_target="Sharding"
  ROOT %r = f32[8,4] get-tuple-element(%w), index=1
}
"""
    module = hlo.parse(text)
    assert hlo_flops.kernel_calls(module) == 3 and hlo_flops.flops(module) == 0


def test_a_collective_repeated_in_async_collective_fusions_counts_once():
    # libtpu starts a weight gather in one fusion and finishes it in the fusion that computes
    # with it: the same all-gather (same channel_id) appears in both computations.
    text = """HloModule f, num_partitions=4

%start (p0: bf16[2,8]) -> bf16[8,8] {
  %p0 = bf16[2,8] parameter(0)
  ROOT %ag1 = bf16[8,8] all-gather(%p0), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}
}

%cont (p1: bf16[2,8]) -> bf16[8,8] {
  %p1 = bf16[2,8] parameter(0)
  ROOT %ag2 = bf16[8,8] all-gather(%p1), channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (a: bf16[2,8]) -> bf16[8,8] {
  %a = bf16[2,8] parameter(0)
  %s = bf16[8,8] fusion(%a), kind=kCustom, calls=%start
  ROOT %c = bf16[8,8] fusion(%a), kind=kOutput, calls=%cont
}
"""
    [ag] = hlo.collectives(text)
    assert (ag.kind, ag.bytes, ag.executions, ag.channel) == ("all-gather", 128, 1, 7)
    other = text.replace("channel_id=7, replica_groups={{0,1,2,3}}, dimensions={0}\n}\n\nENTRY",
                         "channel_id=8, replica_groups={{0,1,2,3}}, dimensions={0}\n}\n\nENTRY")
    assert len(hlo.collectives(other)) == 2  # two channels: two collectives
    # One channel twice in one computation (a permute split in halves) is two transfers.
    halves = text.replace("ROOT %ag2 = bf16[8,8] all-gather(%p1), channel_id=7",
                          "%h = bf16[8,8] all-gather(%p1), channel_id=7, replica_groups={{0,1,2,3}}"
                          ", dimensions={0}\n  ROOT %ag2 = bf16[8,8] all-gather(%p1), channel_id=7")
    assert sum(c.total_bytes for c in hlo.collectives(halves)) == 2 * 128
    # Outside fusions one channel is not a repeat: a shard_map ppermute keeps channel_id 1 in
    # the forward and the backward loops of a ring (models/attention/sequence/context.py), two
    # transfers.
    calls = text.replace("fusion(%a), kind=kCustom, calls=", "call(%a), to_apply=").replace(
        "fusion(%a), kind=kOutput, calls=", "call(%a), to_apply=").replace(
        "ROOT %c = bf16[8,8]", "%c = bf16[8,8]").replace(
        "to_apply=%cont\n}", "to_apply=%cont\n  ROOT %t = (bf16[8,8], bf16[8,8]) tuple(%s, %c)\n}")
    assert sum(c.total_bytes for c in hlo.collectives(calls)) == 2 * 128



RAGGED = """HloModule r, num_partitions=1

ENTRY %main (x: bf16[12,8], w: bf16[3,8,4], g: bf16[12,4], s: s32[3]) -> (bf16[12,4], bf16[3,8,4]) {
  %x = bf16[12,8] parameter(0)
  %w = bf16[3,8,4] parameter(1)
  %g = bf16[12,4] parameter(2)
  %s = s32[3] parameter(3)
  %f = bf16[12,4] ragged-dot(%x, %w, %s), lhs_contracting_dims={1}, rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}
  %dw = bf16[3,8,4] ragged-dot(%x, %g, %s), lhs_contracting_dims={0}, rhs_contracting_dims={0}, lhs_ragged_dims={0}
  ROOT %t = (bf16[12,4], bf16[3,8,4]) tuple(%f, %dw)
}
"""


def test_ragged_dot_flops_count_each_row_against_its_own_group():
    # The dropless MoE's grouped matmuls: the forward (rows split into groups, each row meets
    # one group's (8, 4) weights) and the weight gradient (one (8, 4) output per group, each
    # contracting only its group's rows): 2 x 12 x 8 x 4 each, never x the 3 groups.
    assert hlo_flops.flops(hlo.parse(RAGGED)) == 2 * (2 * 12 * 8 * 4)
