"""Host offload: the optimizer state in pinned host memory (`optim.offload_state`) trains as on
the device, and its checkpoint restores into host memory; compiled for a TPU, the report shows
it apart from HBM and the estimate charges its PCIe traffic. The same compile checks that the
gradients cross the `data` axis as bfloat16 FSDP shards (`models/nn/shard_sums.py`).

On CPU the host and the device memory are the same RAM, so what is checked here is the
plumbing (shardings with `memory_kind='pinned_host'`, the step's copies, the checkpoint); the
HBM it saves on a TPU is measured by AOT compiles (bench/RESULTS.md).
"""

import itertools
import json

import jax
import numpy as np
import pytest

from aot_common import TINY, libtpu_test, run_module
from configs.tiny_lm import get_config
from jaxscale.aot import hlo
from jaxscale.aot.roofline import estimate
from jaxscale.errors import ConfigError
from jaxscale.hardware import TPUS
from jaxscale.optim import HOST_MEMORY, check_offload
from jaxscale.train.checkpoint import Checkpointer
from jaxscale.train.loop import Trainer


def _config(offload: bool):
    c = get_config("test")
    c.model.num_layers = 1
    c.mesh.update(data=2, fsdp=4)
    c.train.update(steps=4, eval_every=0)
    c.optim.offload_state = offload
    return c


def _kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _steps(trainer: Trainer, state, batches) -> tuple[object, list[float]]:
    losses = []
    for batch in batches:
        state, metrics = trainer.train_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_offloaded_optimizer_state_trains_and_restores_as_on_device(tmp_path):
    """Two steps with the AdamW moments in pinned host memory equal two with them on the
    device; saved and restored, the moments come back into host memory with the same values
    and the third step from the restored state equals the third from the original."""
    host, device = Trainer.build(_config(True), None), Trainer.build(_config(False), None)
    assert _kinds(host.state.opt_state) == {HOST_MEMORY} != _kinds(device.state.opt_state)
    assert {s.memory_kind for s in jax.tree.leaves(host.shardings.opt_state)} == {HOST_MEMORY}
    batches = [host.to_global(b) for b in itertools.islice(host.batches.iterator(), 3)]
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host.state)
    state, losses = _steps(host, host.state, batches[:2])
    _, want = _steps(device, device.state, batches[:2])
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    assert _kinds(state.opt_state) == {HOST_MEMORY} and _kinds(state.params) == {"device"}

    Checkpointer(str(tmp_path), 0, 1).finish(2, state, None)
    restored, _ = Checkpointer(str(tmp_path), 0, 1).restore(template, host.shardings)
    assert _kinds(restored.opt_state) == {HOST_MEMORY}
    for got, saved in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
    _, resumed = _steps(host, restored, batches[2:])
    _, straight = _steps(host, state, batches[2:])
    assert resumed == straight


# One libtpu compile serves both checks below: the tiny Llama in bf16-mixed on v5p:2x2x2 as
# data=2 x fsdp=4, with the optimizer state offloaded.
@pytest.fixture(scope="module")
def tiny_tpu(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot")
    proc = run_module(["launch.compile", "--topology=v5p:2x2x2", *TINY, "--config.mesh.data=2",
                       "--config.mesh.fsdp=4", "--config.optim.offload_state=True",
                       f"--save_hlo={out / 'hlo'}", f"--out={out / 'report.json'}"], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    with open(report["hlo_path"]) as f:
        return proc.stdout, report, hlo.parse(f.read())


@libtpu_test
def test_gradients_cross_data_once_as_bf16_shards(tiny_tpu):
    """Every gradient crosses `data` (the groups of 2) as its FSDP shard in bfloat16, the
    embedding's and the LM head's too (they leave the lookup and the head in float32): the
    data-axis all-reduces carry exactly the weight matrices' elements / 4 shards x 2 bytes."""
    _, _, module = tiny_tpu
    shapes = {i.name: i.shape for instrs in module.comps.values() for i in instrs}
    over_data = [c for c in hlo.collectives(module) if c.kind == "all-reduce" and c.group == 2]
    assert {shapes[c.name].lstrip("(").split("[")[0] for c in over_data} == {"bf16"}
    E, V, L = 64, 256, 2  # llama.py:tiny: 4 heads (2 kv) of 16, mlp 128
    per_layer = E * (4 + 2 + 2) * 16 + E * E + E * 2 * 128 + 128 * E
    assert sum(c.total_bytes for c in over_data) == (2 * V * E + L * per_layer) // 4 * 2


@libtpu_test
def test_compile_report_shows_offloaded_state_apart_from_hbm_and_charges_pcie(tiny_tpu):
    text, report, _ = tiny_tpu
    moments = 2 * 4 * 106_816 // 4  # AdamW's float32 mu and nu of the tiny Llama over fsdp=4
    assert report["host_argument_bytes"] == report["host_output_bytes"] >= moments
    assert report["argument_bytes"] < report["host_argument_bytes"]  # not counted as HBM too
    host = 2 * report["host_argument_bytes"] / (TPUS["v5p"].host_bytes_s / 2)
    assert report["estimate"]["host_s"] == pytest.approx(host)
    assert "pinned host memory (not HBM)" in text and "host (PCIe)" in text


def test_pcie_transfers_are_charged_on_their_own_link():
    """Host bytes each way at half the both-ways PCIe figure, one direction after the other;
    overlapped, the step is the slowest of compute, collectives and PCIe."""
    chip = TPUS["v5p"]
    est = estimate(chip, chip.peak_bf16_flops * 0.1, [], None, host_bytes=(3e9, 1e9))
    assert est.host_s == pytest.approx(4e9 / (chip.host_bytes_s / 2))
    assert est.no_overlap_s == pytest.approx(est.compute_s + est.host_s)
    assert est.full_overlap_s == est.host_s > est.compute_s
    assert estimate(chip, 1.0, [], None).host_s == 0.0


def test_offload_without_pinned_host_memory_is_a_config_error():
    class Memory:
        kind = "device"

    class Device:
        device_kind = "Accelerator X"

        def addressable_memories(self):
            return [Memory()]

    check_offload(jax.devices())  # CPU devices have pinned host memory
    with pytest.raises(ConfigError, match="offload_state=False"):
        check_offload([Device()])
