"""Ahead-of-time compilation for TPU topologies (`launch.compile`): the compile reports, the
roofline estimate, and the config error for an unused mesh axis. The planner's tests are in
test_plan.py, the presets' in test_presets.py, the HLO reader's in test_hlo.py.

The compile tests run the entry point in subprocesses (libtpu is loaded there, never in the
test process) on small v5p / v5e slices; they are skipped without libtpu.
"""

import json
import re

import pytest

from aot_common import TINY, libtpu_test, run_module
from configs import llama
from jaxscale import config as config_lib
from jaxscale.aot.roofline import collective_seconds, estimate
from jaxscale.aot.topology import TopologyError, parse_topology
from jaxscale.errors import ConfigError
from jaxscale.hardware import TPUS


def test_unused_mesh_axis_is_a_config_error():
    c = llama.get_config("tiny")
    c.mesh.update(fsdp=2, tensor=4)
    assert c.rules_preset == "fsdp"
    with pytest.raises(ConfigError, match=r"'tensor' has size 4.*fsdp_tp"):
        config_lib.validate(c)
    c.rules_preset = "fsdp_tp"
    config_lib.validate(c)  # the same mesh under a preset that uses 'tensor' is fine


def test_unknown_topology_lists_the_known_ones():
    with pytest.raises(TopologyError, match=r"v5p:9x9x9.*v5p:2x2x1.*v6e:16x16"):
        parse_topology("v5p:9x9x9")
    assert parse_topology("v5e:4x8").num_chips == 32
    assert parse_topology("v5p:2x2x1", num_slices=2).num_chips == 8


def test_the_planner_guess_is_the_memory_model_and_names_no_model():
    import inspect

    from configs import vit_digits
    from jaxscale.aot import guess
    from jaxscale.aot.memory import state_bytes_per_param, step_bytes

    assert "llama" not in inspect.getsource(guess).lower()
    c = llama.get_config("1b")
    dims = guess.dims_of(c)  # the parameter count from the model table
    assert dims.num_params == llama.num_params("1b") and dims.embed == c.model.embed
    mesh = {"data": 2, "fsdp": 8, "tensor": 1, "pipeline": 1}
    tokens = c.data.batch_size / (2 * 8 * 4) * c.data.seq_len
    assert c.precision == "bf16-mixed"  # f32 weights, bf16 compute copy, an accumulator:
    state = state_bytes_per_param(4, 2, accumulate=True)
    assert guess.remat_bytes(c, dims, mesh, 4, "splash", 8, "none") == pytest.approx(
        guess.CALIBRATION * step_bytes(dims, tokens=tokens, seq_len=c.data.seq_len,
                                       state_bytes=state, param_shards=8, loss_chunks=8))
    assert guess.remat_bytes(c, dims, {**mesh, "pipeline": 2}, 4, "splash", 8, "none") is None
    # A model without an LM head's widths has no guess (and the planner its default order).
    assert guess.dims_of(vit_digits.get_config()) is None


def test_roofline_ring_formula_and_bounds():
    chip = TPUS["v5p"]
    bw = chip.ring_bandwidth
    assert collective_seconds("all-gather", 8e9, 8, bw) == pytest.approx(7e9 / bw)
    assert collective_seconds("all-reduce", 8e9, 8, bw) == pytest.approx(14e9 / bw)
    assert collective_seconds("all-reduce", 8e9, 1, bw) == 0.0
    coll = [{"kind": "all-reduce", "bytes": 4e9, "group": 2, "executions": 3, "dcn": False}]
    est = estimate(chip, chip.peak_bf16_flops * 0.5, coll, chip.peak_bf16_flops * 0.25)
    assert est.compute_s == pytest.approx(0.5)
    assert est.ici_s == pytest.approx(3 * 4e9 / bw)
    assert est.no_overlap_s == pytest.approx(est.compute_s + est.ici_s)
    assert est.full_overlap_s == pytest.approx(max(est.compute_s, est.ici_s))
    assert est.mfu_full_overlap == pytest.approx(0.25 / est.full_overlap_s)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "report.json"
    proc = run_module(["launch.compile", "--topology=v5p:2x2x1", *TINY, "--config.mesh.fsdp=4",
                 f"--out={out}"], out.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@libtpu_test
def test_compile_reports_memory_flops_and_collectives(compiled):
    text, report = compiled
    assert report["num_chips"] == 4 and report["mesh"]["fsdp"] == 4
    assert 0 < report["total_bytes"] < report["hbm_bytes"] and report["fits"]
    # The verdict is against what libtpu lets a program use, which the report names.
    assert report["hbm_limit_bytes"] == TPUS["v5p"].usable_hbm_bytes
    assert "HBM (libtpu lets a program use 95.73 GiB): fits" in text
    # Loop bodies x trip counts: without remat the matmul FLOPs are the model's (PaLM count,
    # whose attention term equals the einsum attention's); the cost analysis counts each loop
    # body once and so reports less.
    assert report["flops"] == pytest.approx(report["model_flops"], rel=0.02)
    assert report["flops_cost_analysis"] < 0.9 * report["flops"]
    kinds = {c["kind"] for c in report["collectives"]}
    assert {"all-gather", "reduce-scatter"} <= kinds  # FSDP: gathers and reduce-scatters
    assert all(c["group"] in (2, 4) for c in report["collectives"])
    assert "fits" in text and "ESTIMATE" in text
    assert report["estimate"]["full_overlap_s"] <= report["estimate"]["no_overlap_s"]


@libtpu_test
def test_a_single_chip_compiles_and_counts_the_whole_step(tmp_path):
    # One chip: the SPMD partitioner has nothing to do and libtpu dumps no partitioned module;
    # the FLOPs are counted on the module as it entered the compiler (the chip's whole share).
    out = tmp_path / "r.json"
    proc = run_module(["launch.compile", "--topology=v6e:1x1", "--config=configs/tiny_lm.py:test",
                       f"--out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["num_chips"] == 1 and r["flops"] == pytest.approx(r["expected_flops"], rel=0.01)


@pytest.mark.exhaustive
@libtpu_test
@pytest.mark.slow
def test_compiled_flops_match_model_plus_remat_recompute(tmp_path):
    # 1B widths, 2 layers, 2,048 tokens a chip over fsdp=8: large enough that libtpu turns the
    # FSDP gathers into windowed-einsum loops (collective-permutes in loops), which the loop
    # accounting once counted twice (1.9x). Full remat recomputes each layer's forward but its
    # down projection: compiled = model + that recompute (aot.flops), 1.20x the model count.
    out = tmp_path / "r.json"
    proc = run_module(["launch.compile", "--topology=v5p:2x2x2", "--config=configs/llama.py:1b",
                 "--config.model.num_layers=2", "--config.data.batch_size=8",
                 "--config.mesh.fsdp=8", f"--out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert any(c["kind"] == "collective-permute" and c["in_loop"] for c in r["collectives"])
    assert r["flops"] == pytest.approx(r["expected_flops"], rel=0.01)
    assert 1.15 < r["expected_flops"] / r["model_flops"] < 1.25  # the remat factor
    assert "compiled / expected = 1.00" in proc.stdout


@libtpu_test
@pytest.mark.slow
def test_splash_attention_compiles_for_tpu_with_its_flops_labelled(tmp_path):
    # The Pallas kernel lowers for the TPU topology (Mosaic), runs in the layer loop (fwd, the
    # remat's fwd again, dq, dkv per layer) and its FLOPs, invisible to the dot count, are
    # added analytically and said so; with them compiled = model + recompute, as for einsum.
    # The chunked loss recomputes the head's forward (2·E·V a token), which the expected count
    # includes. 1B's sequences, head width and vocabulary, but 4 heads (embed 256): the
    # kernels' FLOPs and the head's recompute are each 18% of the count (at 1B's 2,048 wide,
    # 9% and 11%, and three times the compile).
    out = tmp_path / "r.json"
    proc = run_module(["launch.compile", "--topology=v5p:2x2x1", "--config=configs/llama.py:1b",
                 "--config.model.num_layers=2", "--config.model.embed=256",
                 "--config.model.num_heads=4", "--config.model.num_kv_heads=2",
                 "--config.model.mlp=512", "--config.data.batch_size=4",
                 "--config.mesh.fsdp=4", "--config.model.attention=splash",
                 "--config.model.loss_chunks=4", f"--out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["kernel_calls"] == 4 * 2 and r["kernel_flops"] > 0
    assert r["flops"] == pytest.approx(r["expected_flops"], rel=0.01)
    assert "ANALYTIC for 8 Pallas kernel calls" in proc.stdout


@libtpu_test
@pytest.mark.parametrize("dcn, kinds, groups", [
    (["--num_slices=2", "--config.mesh.dcn_data=2"], {"all-reduce"}, {2}),
    # FSDP and data parallelism over 2 x 2 slices: pairs of slices, and the loss over all 4;
    # the vocabulary matrices' gradients reduce-scattered over fsdp (`models/nn/shard_sums.py`).
    (["--num_slices=4", "--config.mesh.dcn_data=2", "--config.mesh.dcn_fsdp=2"],
     {"all-reduce", "all-gather", "all-to-all", "reduce-scatter"}, {2, 4}),
    (["--num_slices=2", "--config.mesh.dcn_pipeline=2", "--config.pipeline.microbatches=4"],
     {"all-reduce", "all-gather", "reduce-scatter", "collective-permute"}, {2}),
], ids=["dcn_data", "dcn_data_fsdp", "dcn_pipeline"])
def test_multislice_collectives_cross_dcn(dcn, kinds, groups, tmp_path):
    # libtpu compiles one slice's program and hands what crosses slices to the Megascale
    # runtime as host-transfer sends: those are the DCN collectives, in groups of slices, and
    # the collectives that only feed them (the FSDP reduce-scatter before the data-parallel
    # all-reduce) still count.
    out = tmp_path / "r.json"
    proc = run_module(["launch.compile", "--topology=v5e:2x2", *TINY, "--config.mesh.fsdp=4",
                 *dcn, f"--out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    across = [c for c in r["collectives"] if c["dcn"]]
    assert {c["kind"] for c in across} == kinds
    assert {c["group"] for c in across} == groups
    assert all(c["executions"] >= 1 for c in r["collectives"]), r["collectives"]
    assert r["estimate"]["dcn_s"] > 0 and re.search(r"all-reduce +DCN", proc.stdout)
    if dcn[-1] == "--config.mesh.dcn_data=2":  # the gradients, reduce-scattered within a slice
        params = llama.num_params("tiny")
        grads = sum(c["bytes"] * c["executions"] for c in across)
        assert params * 2 / 4 <= grads <= params * 2, grads  # bf16: a shard .. one copy


@libtpu_test
def test_compile_refused_for_hbm_is_one_paragraph_with_the_fixes(tmp_path):
    # libtpu stops with CompileTimeHbmOom (einsum scores of 256 sequences of 2,048 tokens a
    # chip): one paragraph with its sizes and what would make the step fit, no traceback.
    proc = run_module(["launch.compile", "--topology=v5e:2x2", *TINY, "--config.mesh.fsdp=4",
                 "--config.data.seq_len=2048", "--config.model.max_len=2048",
                 "--config.data.batch_size=1024"], tmp_path)
    assert proc.returncode == 2
    err = proc.stderr[proc.stderr.index("jaxscale: error:"):]
    assert re.search(r"Does not fit v5e:2x2: .* temporaries alone need [\d.]+ GiB per chip "
                     r"against the 15.75 GiB .* model.loss_chunks=8", err), err
    assert "Traceback" not in proc.stderr


@libtpu_test
def test_compile_mesh_mismatch_is_one_paragraph(tmp_path):
    proc = run_module(["launch.compile", "--topology=v5p:2x2x1", *TINY, "--config.mesh.fsdp=3"],
                tmp_path)
    assert proc.returncode == 2
    assert "v5p:2x2x1 (4 chips)" in proc.stderr and "Traceback" not in proc.stderr


def test_moe_flops_per_token_count_the_active_experts():
    # 8 experts, top-2, one shared: a token passes through 3 expert-wide SwiGLUs and the router,
    # as a dense model 3x as wide plus the router's matmul; the other 6 experts cost nothing.
    from jaxscale.models.decoder.flops import flops_per_token

    c = llama.get_config("tiny")
    dense = flops_per_token({**c.model, "mlp": 3 * 32}, 64)
    moe = dict(num_experts=8, experts_per_token=2, shared_experts=1, mlp=32)
    m = {**c.model, "moe": moe}
    assert flops_per_token(m, 64) == dense + 6 * c.model.num_layers * c.model.embed * 8


# The MoE capacity path with the expert axis, full remat and a shared expert: compiled FLOPs
# are model (active experts) + recompute + the buffers' empty slots, and the all-to-alls the
# analytic dispatch. Exhaustively also two other remat policies (the experts' matmuls are
# recomputed under both, the router only under the named one) and the dropless path (grouped
# matmuls, `ragged-dot`).
_EXPERT2 = ["--config.mesh.fsdp=2", "--config.mesh.expert=2", "--config.model.moe.shared_experts=1"]
MOE_MESHES = [[*_EXPERT2, "--config.model.remat=full"],
              *(pytest.param([*_EXPERT2, f"--config.model.remat={r}"],
                             marks=pytest.mark.exhaustive)
                for r in ("save_qkv_proj", "dots_no_batch")),
              pytest.param(["--config.mesh.fsdp=4", "--config.model.moe.capacity_factor=0"],
                           marks=pytest.mark.exhaustive)]


@libtpu_test
@pytest.mark.parametrize("flags", MOE_MESHES, ids=["capacity_expert2", "save_qkv_proj",
                                                   "dots_no_batch", "dropless"])
def test_moe_compile_matches_active_flops_and_the_dispatch(flags, tmp_path):
    out = tmp_path / "r.json"
    proc = run_module(["launch.compile", "--topology=v5p:2x2x1",
                       "--config=configs/mixtral.py:tiny", "--config.precision=bf16-mixed",
                       *flags, f"--out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["flops"] == pytest.approx(r["expected_flops"], rel=0.01)
    a2a = sum(c["bytes"] * c["executions"] for c in r["collectives"] if c["kind"] == "all-to-all")
    if "--config.mesh.expert=2" in flags:
        assert r["padding_flops"] > 0  # capacity 2.0: half the slots are empty
        assert a2a == pytest.approx(r["expected_collectives"]["all-to-all"], rel=1e-6)
        assert "all-to-all expected" in proc.stdout
    else:
        assert r["padding_flops"] == 0 and not r["expected_collectives"]
    assert proc.stdout.count("compiled / expected = 1.00") == 1 + bool(r["expected_collectives"])


def test_routed_flops_count_the_routed_rows_of_the_expert_layers():
    # DeepSeek's tiny: 2 layers, the first dense; 8 experts of width 32, top-2, dropless. The
    # routed rows are tokens x 2 on the one expert layer: 3 matmuls x (3 passes + the remat
    # recompute) x 2 FLOPs x rows x embed x width, over the chips.
    from jaxscale.aot.flops import routed_flops
    from jaxscale.configs import deepseek

    c = deepseek.get_config("tiny")
    c.model.remat = "full"
    rows = c.data.batch_size * c.data.seq_len * 2
    assert routed_flops(c, 4) == 1 * 3 * 4 * 2 * rows * 64 * 32 / 4
    c.model.remat = "dots"  # keeps the experts' outputs: no recompute
    assert routed_flops(c, 4) == 1 * 3 * 3 * 2 * rows * 64 * 32 / 4
    c.model.moe.capacity_factor = 1.25  # static buffers: the HLO counts them itself
    assert routed_flops(c, 4) == 0.0


@libtpu_test
def test_dropless_grouped_matmuls_are_charged_at_the_routed_rows(tmp_path):
    # Over expert=2 each chip's ragged dot is compiled for the worst-case received rows (an
    # upper bound); the step's FLOPs put the routed rows in their place and then equal the
    # model count (latent attention, a dense first layer, shared and routed experts), and the
    # estimate charges those.
    out = tmp_path / "r.json"
    proc = run_module(["launch.compile", "--topology=v5p:2x2x1", "--config=deepseek:tiny",
                       "--config.precision=bf16-mixed", "--config.mesh.fsdp=2",
                       "--config.mesh.expert=2", f"--out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["grouped_flops"] > 1.5 * r["routed_flops"] > 0
    assert r["step_flops"] == pytest.approx(r["expected_flops"], rel=0.01)
    assert r["flops"] > 1.1 * r["expected_flops"]
    peak = TPUS["v5p"].peak_bf16_flops
    assert r["estimate"]["compute_s"] == pytest.approx(r["step_flops"] / peak, rel=1e-6)
    assert "at the routed rows" in proc.stdout and "compiled / expected = 1.00" in proc.stdout


def test_the_memory_guess_shards_routed_experts_over_the_expert_axis():
    # DeepSeek-V3: 58 expert layers of 256 experts (3 x 7168 x 2048 each) are 653.9B of the
    # 671B parameters. Over expert=16 x fsdp=16 a chip holds 1/256 of the experts' state and
    # 1/16 of the rest; gathering a layer fetches only its own 16 experts. Before, every
    # parameter counted as split over fsdp alone, which put every expert-parallel mesh of
    # the planner far over HBM.
    from jaxscale.aot import guess
    from jaxscale.aot.memory import step_bytes
    from jaxscale.configs import deepseek

    c = deepseek.get_config("v3")
    dims = guess.dims_of(c)
    assert dims.expert_params == 58 * 256 * 3 * 7168 * 2048
    rest = dims.num_params - dims.expert_params
    assert 15e9 < rest < 20e9
    kw = dict(tokens=0.0, seq_len=4096, state_bytes=18, tensor=1)
    expected = 18 * (rest / 16 + dims.expert_params / 256) + 2 * 2 * (
        rest + dims.expert_params / 16) / 61
    assert step_bytes(dims, param_shards=16, expert=16, **kw) == pytest.approx(expected)
    dense_view = step_bytes(dims, param_shards=16, **kw)
    assert dense_view > 10 * step_bytes(dims, param_shards=16, expert=16, **kw)


def test_automatic_loss_chunks_count_the_heads_recompute_as_the_step_chooses():
    # model.loss_chunks=0 chooses at trace time (lm_task.choose_loss_chunks): a chip's float32
    # logits of 4 x 2,048 positions over 65,536 words are 2 GiB, so 2 chunks, and the backward
    # pass recomputes the head's logits (2 x embed x vocab a token) as under an explicit 2.
    # The tiny vocabulary's 8 MiB stays whole: nothing recomputed.
    from jaxscale.aot.flops import expected_flops, resolved_model

    c = llama.get_config("tiny")
    assert c.model.loss_chunks == 0 and resolved_model(c, 1).loss_chunks == 1
    c.model.vocab_size, c.data.batch_size, c.data.seq_len = 65536, 4, 2048
    assert resolved_model(c, 1).loss_chunks == 2
    auto = expected_flops(c, 1)
    c.model.loss_chunks = 1
    whole = expected_flops(c, 1)
    assert auto == pytest.approx(whole + 2 * c.model.embed * 65536 * 4 * 2048, rel=1e-12)
    c.model.loss_chunks = 2
    assert expected_flops(c, 1) == auto


def test_an_hbm_refusal_in_terabytes_is_read_as_one():
    # libtpu prints sizes with their own unit: a step needing terabytes says "T", not "G".
    from jaxscale.aot.compile import _hbm_oom
    error = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. HLO "
                         "temporaries (1.50T) exceeds available HBM (85.50G) by 1.42T.")
    refused = _hbm_oom(error, parse_topology("v5p:2x2x1"), config_lib.base_config(), 4.0)
    assert refused.temp_bytes == 1.5 * 2**40 and refused.available_bytes == 85.5 * 2**30
    assert "1536.00 GiB per chip against the 85.50 GiB" in str(refused)
