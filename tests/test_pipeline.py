"""The pipeline runner computes the plain layer scan; schedules' bubble math; clear errors."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.tiny_lm import get_config
from jaxscale.errors import ConfigError, JaxscaleError
from jaxscale.mesh import make_mesh
from jaxscale.models import ModelDef
from jaxscale.models.nn.scan import scan_layers
from jaxscale.parallel.schedules import SCHEDULES, get_schedule, make_layer_runner
from jaxscale.precision import get_policy
from jaxscale.rules import PRESETS, AxisRules, use_rules

B, T, E = 16, 8, 64


def _model_def(num_layers=4):
    c = get_config("test")
    c.model.update(num_layers=num_layers, num_kv_heads=4)
    return ModelDef.build(c.model, get_policy("32-true"))


def _layers_fn(model_def, mesh, runner):
    """(params, h) -> output of the layer stack, under the `pp` preset's rules."""
    rules = AxisRules(tuple(PRESETS["pp"]))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def f(params, h_BTE):
        with use_rules(rules, mesh):
            block = model_def.module(params).layers
            if runner is None:
                return scan_layers(block, h_BTE, positions)
            return runner(block, h_BTE, positions)
    return f


@pytest.mark.parametrize("mesh_cfg, pipeline, remat", [
    pytest.param({"pipeline": 4, "data": 2}, dict(microbatches=4), "dots", marks=pytest.mark.exhaustive),
    ({"pipeline": 2, "fsdp": 2, "tensor": 2},
     dict(microbatches=4, repeats=2, schedule="circular"), "full"),
])
def test_runner_equals_plain_scan(mesh_cfg, pipeline, remat):
    mesh = make_mesh(mesh_cfg)
    model_def = _model_def()
    params = model_def.init_params(jax.random.key(0))
    h_BTE = jax.random.normal(jax.random.key(1), (B, T, E))
    runner = make_layer_runner(pipeline, mesh, remat, num_layers=4)
    want = _layers_fn(model_def, mesh, None)
    got = _layers_fn(model_def, mesh, runner)
    # Forward and gradients (w.r.t. the layer weights and the input) both match the scan.
    loss = lambda f: jax.jit(jax.value_and_grad(lambda p, h: jnp.sum(f(p, h) ** 2),
                                                argnums=(0, 1)))
    (v_want, g_want), (v_got, g_got) = loss(want)(params, h_BTE), loss(got)(params, h_BTE)
    np.testing.assert_allclose(v_got, v_want, rtol=1e-5)
    chex.assert_trees_all_equal_shapes_and_dtypes(g_got, g_want)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b) + 1e-12
    # The remat policy is honoured inside the stages.
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(got(p, h_BTE))))(params))
    assert "checkpoint" in jaxpr or "remat" in jaxpr


def test_no_runner_without_pipeline_axis():
    assert make_layer_runner({"microbatches": 4}, make_mesh({"data": 8}), "none") is None


def test_bubble_fractions():
    gpipe, circular = SCHEDULES["gpipe"], SCHEDULES["circular"]
    assert gpipe.bubble_fraction(4, 4, 1) == pytest.approx(3 / 7)
    assert gpipe.iterations(4, 4, 1) == 7
    # Two repeats: twice the iterations of half the size each, the same S-1 idle ones.
    assert circular.bubble_fraction(2, 2, 2) == pytest.approx(1 / 5)
    assert circular.bubble_fraction(4, 8, 2) < gpipe.bubble_fraction(4, 8, 1)
    assert circular.bubble_fraction(1, 4, 1) == 0


@pytest.mark.parametrize("pipeline, num_layers, message", [
    (dict(microbatches=2, repeats=2, schedule="circular"), 6, "num_layers=6 is not divisible"),
    (dict(microbatches=2, repeats=2), 8, "schedule=circular"),
    (dict(microbatches=1, repeats=2, schedule="circular"), 8, "microbatches >= the number"),
    (dict(microbatches=2, schedule="1f1b?"), 8, "Valid schedules: gpipe, circular"),
])
def test_clear_config_errors(pipeline, num_layers, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        make_layer_runner(pipeline, make_mesh({"pipeline": 2, "data": 4}), "none", num_layers)


@pytest.mark.parametrize("field", ["pipeline.microbatches", "train.grad_accum"])
@pytest.mark.parametrize("value", [0, -2])
def test_a_count_below_one_is_named_as_such_not_as_indivisible(field, value):
    from jaxscale.config import validate
    c = get_config("test")
    section, name = field.split(".")
    c[section][name] = value
    with pytest.raises(ConfigError, match=rf"{re.escape(field)}={value}: it must be at least 1"):
        validate(c)


def test_batch_not_divisible_by_microbatches():
    mesh = make_mesh({"pipeline": 2, "data": 4})
    model_def = _model_def()
    runner = make_layer_runner(dict(microbatches=3), mesh, "none", 4)
    f = _layers_fn(model_def, mesh, runner)
    with pytest.raises(ConfigError, match="not divisible by pipeline.microbatches=3"):
        jax.eval_shape(f, model_def.init_params(jax.random.key(0)), jnp.zeros((B, T, E)))


def test_schedule_registry_and_unknown_preset():
    assert get_schedule("gpipe") is SCHEDULES["gpipe"]
    c = get_config("test")
    c.rules_preset = "zero3"
    with pytest.raises(JaxscaleError, match="Valid presets: dp, fsdp, tp, fsdp_tp, pp"):
        AxisRules.from_config(c)
    c.rules_preset = "pp"
    assert ("layers", "pipeline") in AxisRules.from_config(c).rules


def test_default_rules_put_layer_stages_on_pipeline():
    """No preset needed: every rule set shards the stacked layers over `pipeline`."""
    from jaxscale.weights.place import param_specs

    c = get_config("test")
    mesh = make_mesh({"pipeline": 2, "data": 4})
    specs = param_specs(_model_def(), AxisRules.from_config(c), mesh)
    stacked = {p: s for p, s in specs.items() if p.startswith("layers/")}
    assert stacked and all(tuple(s)[0] == "pipeline" for s in stacked.values()), stacked
    assert tuple(specs["embedding"])[0] != "pipeline"  # only the layer stack is staged
    for name, rules in PRESETS.items():
        assert ("layers", "pipeline") in rules, name


def test_vit_runs_through_the_pipeline():
    """Models without positions (ViT) pipeline too, and equal their plain scan."""
    from configs.vit_digits import get_config as vit_config
    from jaxscale.models.nn.scan import scan_layers as vit_scan

    c = vit_config("test")
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    mesh = make_mesh({"pipeline": 2, "data": 4})
    runner = make_layer_runner(dict(microbatches=2), mesh, "full", c.model.num_layers)
    params = model_def.init_params(jax.random.key(0))
    h = jax.random.normal(jax.random.key(1), (8, 17, c.model.embed))

    def run(p, h, pipelined):
        with use_rules(AxisRules.from_config(c), mesh):
            block = model_def.module(p).layers
            out = runner(block, h, None) if pipelined else vit_scan(block, h, None)
            return jnp.sum(out ** 2)

    want = jax.jit(jax.value_and_grad(lambda p, h: run(p, h, False)))(params, h)
    got = jax.jit(jax.value_and_grad(lambda p, h: run(p, h, True)))(params, h)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    # Relative to the whole gradient: the key bias's gradient is 0 up to rounding (softmax is
    # shift invariant), so its own relative error is noise over noise.
    scale = optax.global_norm(want[1])
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert np.linalg.norm(a - b) <= 1e-5 * scale


@pytest.mark.parametrize("remat", ["full", pytest.param("dots", marks=pytest.mark.exhaustive), "dots_no_batch"])
def test_remat_on_the_plain_scan_keeps_the_math(remat):
    model_def = _model_def()
    params = model_def.init_params(jax.random.key(0))
    h_BTE = jax.random.normal(jax.random.key(1), (B, T, E))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def loss(p, policy):
        return jnp.sum(scan_layers(model_def.module(p).layers, h_BTE, positions, policy) ** 2)

    want = jax.grad(loss)(params, "none")
    got = jax.grad(loss)(params, remat)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # recomputation reorders sums
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)
    traced = lambda policy: str(jax.make_jaxpr(loss, static_argnums=1)(params, policy))
    assert "remat" in traced(remat) and "remat" not in traced("none")  # the remat2 primitive


def test_accumulation_fallback_warns_why():
    from jaxscale.parallel.accumulate import accumulate_per_replica

    mesh = make_mesh({"data": 2, "fsdp": 4})
    batch = {"tokens": jnp.zeros((6, 9), jnp.int32)}  # 6 rows: not a multiple of 2 x 2
    with use_rules(AxisRules(tuple(PRESETS["dp"])), mesh):
        with pytest.warns(UserWarning, match=r"not a multiple of data\(2\) x grad_accum\(2\)"):
            assert accumulate_per_replica(lambda mb: None, {}, batch, 2) is None
