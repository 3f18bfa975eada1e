"""Remat policies (`models/nn/scan.py`): each only changes what the backward pass recomputes, so
every one gives the loss and gradients of `remat=none` on the tiny Llama; the named policies
keep what their names say; the host-offloaded ones compile for a TPU topology.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aot_common import libtpu_test, run, run_module
from jaxscale.errors import ConfigError
from jaxscale.models.decoder import lm_task
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.decoder.llama import Llama
from jaxscale.models.nn.scan import (
    ACTIVATION_NAMES,
    NAMED_POLICIES,
    REMAT_POLICIES,
    check_remat,
    offloaded_names,
)

# tiny_lm:test's shapes, float32 throughout: remat may reorder nothing but what is recomputed.
CFG = LlamaConfig(vocab_size=256, embed=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=16, mlp=128)


def _loss_and_grads(remat: str) -> tuple[jax.Array, dict]:
    model = Llama(dataclasses.replace(CFG, remat=remat), nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, CFG.vocab_size)

    @jax.jit
    def step(state):
        return jax.value_and_grad(
            lambda s: lm_task.lm_loss(nnx.merge(graphdef, s), {"tokens": tokens}))(state)

    return step(state)


@pytest.fixture(scope="module")
def reference():
    return _loss_and_grads("none")


@pytest.mark.parametrize("remat", [r for r in REMAT_POLICIES if r != "none"])
def test_every_policy_gives_the_loss_and_gradients_of_none(remat, reference):
    loss, grads = _loss_and_grads(remat)
    ref_loss, ref_grads = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree_util.tree_leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7, err_msg=str(path))


def _saved_residual_names(remat: str, capsys) -> set[str]:
    """The activation names among the residuals `remat` keeps for one block's backward pass
    (`jax.ad_checkpoint.print_saved_residuals` says where each comes from)."""
    model = Llama(dataclasses.replace(CFG, num_layers=1, remat=remat), nnx.Rngs(0))
    graphdef, stacked = nnx.split(model.layers)
    state = jax.tree.map(lambda a: a[0], stacked)  # the one layer of the stack
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    fn = jax.checkpoint(lambda s, h: nnx.merge(graphdef, s)(h, pos).sum(),
                        policy=REMAT_POLICIES[remat])
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(fn, state, jnp.ones((2, 8, CFG.embed)))
    printed = capsys.readouterr().out
    return {name for name in ACTIVATION_NAMES if f"named '{name}'" in printed}


@pytest.mark.parametrize("remat", [r for r in NAMED_POLICIES if not offloaded_names(r)])
def test_named_policies_keep_exactly_their_names(remat, capsys):
    assert _saved_residual_names(remat, capsys) == set(NAMED_POLICIES[remat].saved)
    assert _saved_residual_names("full", capsys) == set()


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"save_qkv_proj.*qkv_proj_offloaded"):
        check_remat("save_everything")


_COMPILE_TINY = """
import json, sys
from jaxscale.aot.topology import parse_topology, topology_devices
from jaxscale.configs import llama
from jaxscale.mesh import make_mesh
from jaxscale.train.build import batch_spec, build_step
out = {}
for remat in sys.argv[1:]:
    c = llama.get_config("tiny")
    c.update(precision="bf16-mixed")
    c.mesh.fsdp, c.model.remat = 4, remat
    mesh = make_mesh(c.mesh, topology_devices(parse_topology("v5p:2x2x1")))
    mem = build_step(c, mesh).lower(batch_spec(c)).compile().memory_analysis()
    out[remat] = {"temp": mem.temp_size_in_bytes, "host_temp": mem.host_temp_size_in_bytes}
from jaxscale.aot.compile import compile_step
from jaxscale.aot.report import format_report
c = llama.get_config("tiny")
c.update(precision="bf16-mixed")
c.mesh.fsdp, c.model.remat = 4, "qkv_proj_offloaded"
report = compile_step(c, parse_topology("v5p:2x2x1"))
out["report"] = {"host_temp": report.host_temp_bytes, "text": format_report(report)}
print(json.dumps(out))
"""


@libtpu_test
def test_offloaded_policies_compile_for_tpu_with_host_memory_apart(tmp_path):
    # Ahead of time for v5p:2x2x1 (libtpu in a subprocess): the offloaded activations live in
    # pinned host memory, which the compiled memory analysis counts apart from HBM.
    proc = run(["-c", _COMPILE_TINY, "none", "save_qkv_proj", "qkv_proj_offloaded",
                "minimal_offloaded"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mem = json.loads(proc.stdout.strip().splitlines()[-1])
    assert mem["none"]["host_temp"] == mem["save_qkv_proj"]["host_temp"] == 0
    assert 0 < mem["qkv_proj_offloaded"]["host_temp"] < mem["minimal_offloaded"]["host_temp"]
    # Keeping only q/k/v needs less HBM than keeping everything (at this tiny size the
    # offload's staging buffers outweigh what it moves, so no HBM order among those two).
    assert mem["save_qkv_proj"]["temp"] < mem["none"]["temp"]
    # launch.compile's report carries the host bytes apart from HBM.
    assert mem["report"]["host_temp"] == mem["qkv_proj_offloaded"]["host_temp"]
    assert "pinned host memory (not HBM): temporaries" in mem["report"]["text"]


@pytest.mark.exhaustive
@libtpu_test
@pytest.mark.slow
def test_named_policies_recompute_what_the_flop_count_expects(tmp_path):
    # save_qkv_proj keeps q/k/v: the backward recomputes the out projection, gate/up and
    # attention's forward, which the model table's recompute count (decoder/flops.py) says, so the
    # compiled FLOPs equal model + recompute as they do for `full` (tests/test_aot.py).
    out = tmp_path / "r.json"
    proc = run_module(["launch.compile", "--topology=v5p:2x2x1", "--config=configs/llama.py:1b",
                       "--config.model.num_layers=2", "--config.data.batch_size=4",
                       "--config.mesh.fsdp=4", "--config.model.remat=save_qkv_proj",
                       f"--out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["flops"] == pytest.approx(r["expected_flops"], rel=0.02)
    assert 1.05 < r["expected_flops"] / r["model_flops"] < 1.2
