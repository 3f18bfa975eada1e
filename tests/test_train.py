"""Sharded init places every parameter on its rule's spec; 1 device == 8 devices; the CLI."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from child_env import child_env
from configs.tiny_lm import get_config
from jaxscale.mesh import make_mesh
from jaxscale.models import ModelDef
from jaxscale.optim import make_optimizer
from jaxscale.precision import get_policy
from jaxscale.rules import AxisRules
from jaxscale.train.loop import Trainer
from jaxscale.train.state import init_state
from jaxscale.weights.place import param_specs
from jaxscale.weights.tree import flatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sharded_init_matches_rules():
    c = get_config("test")
    c.mesh.update(data=2, fsdp=2, tensor=2)
    mesh = make_mesh(c.mesh)
    rules = AxisRules.from_config(c)
    model_def = ModelDef.build(c.model, get_policy(c.precision))
    optimizer, _ = make_optimizer(c.optim, 10)
    state, _ = init_state(model_def, optimizer, rules, mesh, seed=0)
    specs = param_specs(model_def, rules, mesh)
    params = flatten(state.params)
    assert set(params) == set(specs)
    for path, arr in params.items():
        assert arr.sharding == NamedSharding(mesh, specs[path]), path
    # The FSDP/TP-sharded weight really is split: each device holds 1/4 of the fused q/k/v
    # (L, embed, kv, G + 2, head_dim), kv heads (with their query heads) over `tensor`.
    wq = params["layers/attn/wqkv"]
    # (layers on `pipeline` costs nothing on this pipeline=1 mesh.)
    assert specs["layers/attn/wqkv"] == jax.sharding.PartitionSpec(
        "pipeline", "fsdp", "tensor", None, None)
    assert wq.addressable_shards[0].data.size * 4 == wq.size
    # Adam moments are sharded like their parameters.
    mu = flatten(state.opt_state[1][0].mu)["layers/attn/wqkv"]
    assert mu.sharding == wq.sharding


def _losses(config, devices, steps):
    trainer = Trainer.build(config, workdir=None, devices=devices)
    it = trainer.batches.iterator()
    state, losses = trainer.state, []
    for _ in range(steps):
        state, m = trainer.train_fn(state, trainer.to_global(next(it)))
        losses.append(float(m["loss"]))
    return np.array(losses)


def test_one_device_equals_eight_data_parallel():
    c = get_config("test")
    c.train.steps = 10
    one = _losses(c, jax.devices()[:1], 10)
    c.mesh.data = 8
    eight = _losses(c, jax.devices(), 10)
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    assert one[-1] < one[0]


@pytest.mark.parametrize("mesh_flags, summary", [
    pytest.param(["--config.mesh.data=2", "--config.mesh.fsdp=4"],
                 "data=2 pipeline=1 fsdp=4 tensor=1", marks=pytest.mark.exhaustive),
    (["--config.mesh.data=1", "--config.mesh.pipeline=2", "--config.mesh.fsdp=2",
      "--config.mesh.tensor=2", "--config.pipeline.microbatches=2"],
     "data=1 pipeline=2 fsdp=2 tensor=2"),
])
def test_cli_writes_config_and_metrics(tmp_path, mesh_flags, summary):
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py:test",
           f"--workdir={workdir}", "--cpu_devices=8", *mesh_flags,
           "--config.train.steps=4", "--config.train.eval_every=2"]
    env = child_env(XLA_FLAGS="")  # as users compile: XLA's default optimisation (child_env.py)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((workdir / "config.json").read_text())
    assert config["mesh"]["fsdp"] in (2, 4) and config["train"]["steps"] == 4
    lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3, 4]
    for line in lines:
        assert isinstance(line["step"], int) and isinstance(line["loss"], float)
        assert {"grad_norm", "lr", "tokens_per_s", "step_time_s"} <= set(line)
    assert "eval_loss" in lines[1]
    assert summary in out.stdout


def test_cli_reports_bad_mesh_clearly(tmp_path):
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py:test",
           f"--workdir={tmp_path}", "--cpu_devices=8", "--config.mesh.data=3"]
    env = child_env()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "has 3 devices but 8 are available" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_rejects_an_unsupported_workdir_url():
    """gs:// and s3:// workdirs are supported (tests/test_workdir_object_store.py); another
    scheme is one paragraph naming the supported ones."""
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py:test",
           "--workdir=hdfs://namenode/run", "--cpu_devices=8"]
    env = child_env()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "does not support" in out.stderr and "s3://bucket/prefix" in out.stderr
