"""MoE across devices: the dropless path's expert parallelism (models/moe/dropless.py) equals
the per-token loop and trains as one device, the capacity path's all-to-all too, pipeline
stages carry the router's statistics out (parallel/gpipe.py), the grouped matmul's forms agree
under nested vmaps, and the dropless path compiles for TPU."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aot_common import TINY, libtpu_test, run_module
from jaxscale.config import validate
from jaxscale.errors import ConfigError
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.decoder.llama import Llama
from jaxscale.models.moe.layer import check_moe
from jaxscale.models.moe.routers import STATS
from jaxscale.train.loop import Trainer
from test_moe import _block, _loop, _tiny_moe_config, _train


def test_the_dense_grouped_matmul_equals_ragged_dot():
    """Off TPU the dropless path runs `grouped_matmul`'s dense form; it equals ragged_dot,
    rows past the last group zero, an empty group included."""
    from jaxscale.models.moe.gmm import grouped_matmul

    x = jax.random.normal(jax.random.key(6), (10, 8))
    w = jax.random.normal(jax.random.key(7), (4, 8, 5))
    sizes = jnp.array([3, 0, 4, 2], jnp.int32)
    dense = np.asarray(grouped_matmul(x, w, sizes, "dense"))
    np.testing.assert_allclose(dense, grouped_matmul(x, w, sizes, "ragged_dot"), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(dense[3:7], x[3:7] @ w[2], rtol=1e-5, atol=1e-6)
    assert not dense[9].any()


def test_megablox_equals_ragged_dot_forward_and_backward():
    """The Pallas megablox grouped matmul (`moe/gmm.megablox`, interpreted on CPU; on TPU the
    kernel itself) equals jax's ragged_dot, value and both gradients (megablox's gmm / tgmm
    backward), with rows past the last group zero (its extra weightless group) and an empty
    group; 13 rows are padded to the row tile."""
    from jaxscale.models.moe.gmm import grouped_matmul, megablox_tiling

    keys = jax.random.split(jax.random.key(9), 3)
    x = jax.random.normal(keys[0], (13, 8))
    w = jax.random.normal(keys[1], (3, 8, 5))
    g = jax.random.normal(keys[2], (13, 5))
    sizes = jnp.array([4, 0, 6], jnp.int32)
    assert megablox_tiling(13, 8, 5) == (16, 8, 5)
    loss = lambda kernel: lambda x, w: jnp.sum(grouped_matmul(x, w, sizes, kernel) * g)
    got = jax.value_and_grad(loss("megablox"), argnums=(0, 1))(x, w)
    want = jax.value_and_grad(loss("ragged_dot"), argnums=(0, 1))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    out = grouped_matmul(x, w, sizes, "megablox")
    assert not np.asarray(out[10:]).any() and not np.asarray(got[1][1][1]).any()


@pytest.mark.parametrize("kernels", [("ragged_dot",),
                                     pytest.param(("megablox",), marks=pytest.mark.exhaustive)])
def test_the_native_grouped_matmuls_vmap_and_differentiate_as_the_dense_form(kernels):
    """TPU's ragged_dot and megablox (`models/moe/gmm.py`; megablox interpreted on CPU, the
    Pallas kernel's own gmm/tgmm backward) take no batch dimensions: `_folding` folds a vmapped
    batch into the groups, forward and backward. Under two nested vmaps (pipeline stages:
    weights batched; per-replica accumulation inside: weights not) their values and gradients
    equal the dense form's."""
    from jaxscale.models.moe.gmm import grouped_matmul

    keys = jax.random.split(jax.random.key(8), 4)
    x = jax.random.normal(keys[0], (2, 3, 10, 4))          # (stages, replicas, rows, embed)
    w = jax.random.normal(keys[1], (2, 3, 4, 5))            # (stages, experts, embed, out)
    sizes = jax.random.randint(keys[2], (2, 3, 3), 0, 4).astype(jnp.int32)
    g = jax.random.normal(keys[3], (2, 3, 10, 5))

    def loss(kernel):
        per_replica = lambda x, w, s: jax.vmap(lambda xx, ss: grouped_matmul(xx, w, ss, kernel)
                                               )(x, s)
        return lambda x, w: jnp.sum(jax.vmap(per_replica)(x, w, sizes) * g)

    want = jax.value_and_grad(loss("dense"), argnums=(0, 1))(x, w)
    for kernel in kernels:
        got = jax.jit(jax.value_and_grad(loss(kernel), argnums=(0, 1)))(x, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=kernel)


@pytest.mark.parametrize("mesh", [dict(fsdp=2, tensor=2, expert=2),
                                  pytest.param(dict(context=2, expert=4),
                                               marks=pytest.mark.exhaustive)])
def test_expert_parallel_dropless_equals_a_loop_over_experts(mesh):
    """Dropless with the experts split over `expert` (models/moe/dropless.py): tokens gathered
    over the expert group, local experts, outputs reduce-scattered back, the hidden width split
    over tensor and summed; equal to the per-token loop."""
    from jaxscale.mesh import make_mesh
    from jaxscale.rules import PRESETS, AxisRules, normalize_rules, use_rules

    device_mesh = make_mesh(mesh, jax.devices())
    rules = AxisRules(normalize_rules(PRESETS["fsdp_tp"]))
    block = _block(num_experts=4, experts_per_token=2, shared_experts=1)
    x = jax.random.normal(jax.random.key(1), (4, 6, 8))

    @nnx.jit
    def apply(block, x):
        with use_rules(rules, device_mesh):
            return block(x)

    np.testing.assert_allclose(np.asarray(apply(block, x)), _loop(block, x), rtol=1e-5,
                               atol=1e-6)
    hlo = apply.lower(block, x).compile().as_text()
    assert "all-gather" in hlo and "reduce-scatter" in hlo


@pytest.mark.parametrize("mesh, capacity_factor", [
    (dict(expert=2, fsdp=2, data=2), 2.0),
    (dict(expert=4, data=2), 0.0),  # dropless: gather over the expert group, reduce-scatter
    pytest.param(dict(expert=4, data=2), 2.0, marks=pytest.mark.exhaustive),
    pytest.param(dict(expert=2, fsdp=2, tensor=2), 0.0, marks=pytest.mark.exhaustive),
    pytest.param(dict(expert=2, pipeline=2, data=2), 0.0, marks=pytest.mark.exhaustive),
])
def test_experts_shard_over_the_expert_axis_and_train_as_on_one_device(mesh, capacity_factor):
    """Expert parallelism from the rules alone: on an `expert` mesh axis every expert weight
    is split over it (num_experts / expert per device, also over fsdp on embed), the batch too;
    the capacity path's tokens reach their experts by all-to-all, the dropless path's by an
    all-gather over the expert group and back by reduce-scatter (models/moe/dropless.py); both
    train with one device's losses. With pipeline stages the Switch loss is one per
    microbatch (as under gradient accumulation), no longer the whole batch's: its coefficient
    is 0 there, the z-loss (a mean over tokens) still trains."""
    stages = mesh.get("pipeline", 1)
    c = _tiny_moe_config(capacity_factor=capacity_factor, shared_experts=1,
                         router_aux_loss_coef=0.1 if stages == 1 else 0.0)
    one, _ = _train(c, jax.devices()[:1], steps=3)
    c.mesh.update(mesh)
    c.pipeline.microbatches = stages
    validate(c)
    trainer = Trainer.build(c, workdir=None, devices=jax.devices())
    it, state, losses = trainer.batches.iterator(), trainer.state, []
    for _ in range(3):
        batch = trainer.to_global(next(it))
        state, metrics = trainer.train_fn(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, one, rtol=1e-5)
    assert "expert" in batch["tokens"].sharding.spec[0]
    experts = state.params["layers"]["mlp"]
    for name in ("w_gate", "w_up", "w_down"):  # (layers, expert, embed / mlp, mlp / embed)
        spec = experts[name].sharding.spec
        assert spec[1] == "expert", (name, spec)
        assert experts[name].addressable_shards[0].data.shape[1] == 4 // mesh["expert"], name
    hlo = trainer.train_fn.lower(state, batch).compile().as_text()
    assert ("all-to-all" if capacity_factor else "reduce-scatter") in hlo


@pytest.mark.parametrize("microbatches, repeats", [
    (2, 2),  # circular: repeats and bubbles
    pytest.param(1, 1, marks=pytest.mark.exhaustive),  # GPipe, one microbatch: all stats exact
])
def test_pipeline_stages_carry_the_router_statistics_out(microbatches, repeats):
    """GPipe / circular stages (parallel/gpipe.py) leave the layers' sown router statistics on
    the block as the plain scan does, (layers, stats) in natural layer order, bubbles masked:
    with one microbatch all equal the scan's; with two, each layer's is the mean over the
    microbatches, which for the z-loss (a mean over tokens) is still the scan's."""
    from jaxscale.mesh import make_mesh
    from jaxscale.models.nn.scan import scan_layers
    from jaxscale.parallel.gpipe import pipeline_layers
    from jaxscale.rules import PRESETS, AxisRules, normalize_rules, use_rules

    c = _tiny_moe_config()
    c.model.num_layers = 4
    block = Llama(LlamaConfig.from_config(c.model), nnx.Rngs(0)).layers
    mesh = make_mesh(dict(pipeline=2, data=4), jax.devices())
    rules = AxisRules(normalize_rules(PRESETS["pp"]))
    h = jax.random.normal(jax.random.key(5), (8, 6, c.model.embed))
    positions = jnp.broadcast_to(jnp.arange(6), (8, 6))

    @nnx.jit
    def both(block, h):
        with use_rules(rules, mesh):
            out = pipeline_layers(block, h, positions, mesh=mesh, stages=2,
                                  microbatches=microbatches, repeats=repeats)
            piped = block.mlp.router_stats.get_value()
            want = scan_layers(block, h, positions)
            return out, piped, want, block.mlp.router_stats.get_value()

    out, piped, want, scanned = both(block, h)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert piped.shape == scanned.shape == (4, len(STATS))
    z = STATS.index("z")
    compared = slice(None) if microbatches == 1 else slice(z, z + 1)  # the Switch loss and
    # the loads of a microbatch are not those of the batch
    np.testing.assert_allclose(piped[:, compared], scanned[:, compared], rtol=1e-5)


@pytest.mark.exhaustive
@pytest.mark.slow
@libtpu_test
@pytest.mark.parametrize("mesh, flags", [
    # the ragged all-to-all dispatch (auto on TPU), megablox (auto: embed and width of 256)
    (dict(expert=4), ["--config.model.embed=256", "--config.model.moe.mlp=256"]),
    (dict(expert=4), ["--config.model.moe.dispatch=allgather"]),  # gathered, ragged_dot
    (dict(expert=2, pipeline=2, data=2, microbatches=2), []),  # inside stages and replicas
])
def test_dropless_expert_parallel_compiles_for_tpu(mesh, flags, tmp_path):
    """The TPU lowering of the dropless path (libtpu, ahead of time: launch.compile): the
    ragged all-to-all dispatch, its bytes as `aot/traffic.py` expects (every assignment out
    and back), megablox's Pallas calls; the all-gather dispatch's reduce-scatter; and under
    the pipeline's and the replicas' vmaps the grouped matmul folded (`moe/gmm._folding`: TPU's
    ragged dot takes no batch dimensions) and the ragged all-to-all batched."""
    import json

    sizes = {"data": 1, **mesh}
    microbatches = sizes.pop("microbatches", 1)
    axes = [f"--config.mesh.{axis}={size}" for axis, size in sizes.items()]
    out = tmp_path / "report.json"
    proc = run_module(["launch.compile", f"--topology=v5p:2x2x{math.prod(sizes.values()) // 4}",
                       *TINY, "--config.model.moe.num_experts=4", *axes, *flags,
                       f"--config.pipeline.microbatches={microbatches}", f"--out={out}"],
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    ragged = [c for c in report["collectives"] if c["name"].startswith("ragged_all_to_all")]
    if "--config.model.moe.dispatch=allgather" in flags:
        assert not ragged and "reduce-scatter" in proc.stdout
        return
    assert ragged
    if flags:  # megablox's kernels; the dispatch's bytes as expected
        assert report["kernel_calls"] > 0
        sent = sum(c["bytes"] * c["executions"] for c in ragged)
        assert sent == report["expected_collectives"]["all-to-all"]


def test_the_ragged_dispatch_plan_sends_every_assignment_to_its_expert_and_back():
    """`moe/dispatch.plan`, the ragged all-to-all's offsets and sizes, simulated device by device
    in numpy: every device's sorted assignments land in their experts' devices' buffers (by
    source device, then expert, within the static buffer) and the way back returns each row to
    the slot it left."""
    from jaxscale.models.moe.dispatch import buffer_rows, plan

    rng = np.random.default_rng(0)
    D, L, n, k = 4, 2, 5, 2
    experts = np.stack([rng.choice(D * L, size=(n, k), replace=True) for _ in range(D)])
    experts[0] = 2  # device 0 routes everything to device 1's first expert
    counts = np.stack([np.bincount(e.reshape(-1), minlength=D * L) for e in experts])
    sorted_rows = [np.sort(e.reshape(-1)) for e in experts]  # each row named by its expert
    rows = buffer_rows(n, k, D, L)
    buffers = [np.full(rows, -1) for _ in range(D)]
    plans = [plan(jnp.asarray(counts), me, L) for me in range(D)]
    for src in range(D):
        starts, sizes, lands, _ = (np.asarray(a) for a in plans[src].send)
        for dst in range(D):
            chunk = sorted_rows[src][starts[dst]:starts[dst] + sizes[dst]]
            buffers[dst][lands[dst]:lands[dst] + sizes[dst]] = chunk
    for dst in range(D):
        got = buffers[dst][buffers[dst] >= 0]
        want = np.concatenate([s[(s // L) == dst] for s in sorted_rows])
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.asarray(plans[dst].local_DL).sum(),
                                      len(want))
        assert (buffers[dst][len(want):] == -1).all()
    back = [np.full(n * k, -1) for _ in range(D)]
    for src in range(D):  # each buffer's chunks home again
        starts, sizes, lands, _ = (np.asarray(a) for a in plans[src].back)
        for dst in range(D):
            back[dst][lands[dst]:lands[dst] + sizes[dst]] = \
                buffers[src][starts[dst]:starts[dst] + sizes[dst]]
    for d in range(D):
        np.testing.assert_array_equal(back[d], sorted_rows[d])


@pytest.mark.parametrize("mesh", [dict(fsdp=2, tensor=2, expert=2),
                                  pytest.param(dict(expert=4, data=2),
                                               marks=pytest.mark.exhaustive)])
def test_the_ragged_all_to_all_dispatch_equals_the_loop_and_the_allgather(mesh, monkeypatch):
    """`model.moe.dispatch=ragged_all_to_all` (models/moe/dispatch.py) with the collective's
    semantics emulated from an all-gather (XLA:CPU has no ragged-all-to-all): the output equals
    the per-token loop, and its gradients (the collective's transpose: jax's rule, applied to
    the emulation) the all-gather dispatch's. Two local experts per device (sorted in the
    buffer), the hidden width split over tensor."""
    from jaxscale.mesh import make_mesh
    from jaxscale.models.moe import dispatch as dispatch_lib
    from jaxscale.rules import PRESETS, AxisRules, normalize_rules, use_rules

    device_mesh = make_mesh(mesh, jax.devices())
    rules = AxisRules(normalize_rules(PRESETS["fsdp_tp"]))
    x = jax.random.normal(jax.random.key(1), (8, 6, 8))
    g = jax.random.normal(jax.random.key(2), (8, 6, 8))

    def run(dispatch):
        block = _block(num_experts=4, experts_per_token=2, dispatch=dispatch)

        @nnx.jit
        def loss(block, x):
            def f(block, x):
                with use_rules(rules, device_mesh):
                    out = block(x)
                return jnp.sum(out * g), out
            return nnx.value_and_grad(f, argnums=(0, 1), has_aux=True)(block, x)

        (_, out), grads = loss(block, x)
        return block, out, grads

    with pytest.raises(ConfigError, match="XLA on cpu has no ragged-all-to-all"):
        run("ragged_all_to_all")
    monkeypatch.setattr(dispatch_lib, "ragged_all_to_all",
                        dispatch_lib.emulated_ragged_all_to_all)
    block, out, grads = run("ragged_all_to_all")
    np.testing.assert_allclose(np.asarray(out), _loop(block, x), rtol=1e-5, atol=1e-6)
    _, _, want = run("allgather")
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


_RAGGED_HLO = """HloModule m, num_partitions=4

ENTRY %main (p0: bf16[8,16], p1: bf16[32,16], o: s32[4], x: bf16[64,32]) -> (bf16[32,16], bf16[64,128]) {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  %o = s32[4]{0} parameter(2)
  %ragged_all_to_all.1 = bf16[32,16]{1,0} ragged-all-to-all(%p0, %p1, %o, %o, %o, /*index=5*/%o), channel_id=1, replica_groups={{0,1,2,3}}
  %x = bf16[64,32]{1,0} parameter(3)
  %pallas_call.1 = bf16[64,128]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "e30=", "cost_estimate": {"bytes_accessed":1,"flops":524288,"transcendentals":0}}}
  ROOT %t = (bf16[32,16]{1,0}, bf16[64,128]{1,0}) tuple(%ragged_all_to_all.1, %pallas_call.1)
}
"""


def test_the_hlo_reader_counts_ragged_all_to_alls_and_pallas_cost_estimates():
    """`aot/hlo.py` on the dropless dispatch's ops (as libtpu writes them): a ragged-all-to-all
    is an all-to-all of the rows sent (its 8-row operand, not its 32-row receive buffer), and a
    Pallas kernel's cost estimate (megablox's) counts in the FLOPs and the grouped FLOPs."""
    from jaxscale.aot import hlo, hlo_flops

    module = hlo.parse(_RAGGED_HLO)
    (a2a,) = hlo.collectives(module)
    assert (a2a.kind, a2a.bytes, a2a.group) == ("all-to-all", 8 * 16 * 2, 4)
    assert hlo_flops.flops(module) == hlo_flops.grouped_flops(module) == 524288


def test_the_ragged_dispatch_traffic_is_every_assignment_out_and_back():
    """`aot/traffic.moe_ragged_bytes`: the Mixtral preset dropless on v5p-128 (expert=8 x
    fsdp=8, tokens over both): each chip's 4 x 4096 tokens x 2 choices x embed 4096 in bf16,
    6 ragged all-to-alls a layer under full remat, 32 layers; none with dispatch=allgather."""
    from jaxscale.aot.traffic import moe_all_to_all_bytes
    from jaxscale.configs import mixtral
    from jaxscale.mesh import MESH_AXES

    c = mixtral.get_config("8x7b,v5p-128")
    c.model.moe.capacity_factor = 0.0
    assert (c.mesh.fsdp, c.mesh.expert) == (8, 8)
    mesh = jax.sharding.AbstractMesh(tuple(c.mesh[a] for a in MESH_AXES), MESH_AXES)
    assert moe_all_to_all_bytes(c, mesh) == 32 * 6 * (4 * 4096) * 2 * 4096 * 2
    c.model.moe.dispatch = "allgather"
    assert moe_all_to_all_bytes(c, mesh) == 0.0


def test_the_kernel_and_dispatch_choices_are_checked_in_one_paragraph():
    """`model.moe.grouped_matmul` / `dispatch` outside their choices, and megablox on an
    operand type it does not take, are ConfigErrors naming the field; auto is the dense form
    and the all-gather on CPU."""
    from jaxscale.models.moe.dispatch import resolve_dispatch
    from jaxscale.models.moe.gmm import resolve_kernel

    for field in ("grouped_matmul", "dispatch"):
        with pytest.raises(ConfigError, match=f"model.moe.{field}='bogus' is not one of"):
            check_moe({"moe": {"num_experts": 4, field: "bogus"}})
    with pytest.raises(ConfigError, match="grouped_matmul='megablox' cannot run here"):
        resolve_kernel("megablox", 128, 128, jnp.float16)
    assert resolve_kernel("auto", 128, 128, jnp.bfloat16) == "dense"
    assert resolve_dispatch("auto", "cpu", ("expert",), ("expert",)) == "allgather"
    assert resolve_dispatch("auto", "tpu", ("expert",), ("expert",)) == "ragged_all_to_all"
    assert resolve_dispatch("auto", "tpu", (), ("expert",)) == "allgather"
