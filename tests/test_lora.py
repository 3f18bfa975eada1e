"""LoRA: only adapters train (base bit-identical, no optimizer state for it), merge == base +
adapters, adapters sharded by the same rules on an 8-device mesh."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from configs.tiny_lm import get_config
from jaxscale.errors import ConfigError
from jaxscale.models import ModelDef
from jaxscale.models.adapters import lora
from jaxscale.models.nn.fused import LLAMA_FUSED
from jaxscale.precision import get_policy
from jaxscale.train.loop import Trainer
from jaxscale.weights.place import param_specs
from jaxscale.weights.tree import flatten, merge_trees
from tests.helpers import run_steps

TARGETS = ("attn/w[qo]$", "mlp/w_down")


@pytest.fixture(scope="module")
def trained():
    c = get_config("test")
    c.mesh.update(data=1, fsdp=4, tensor=2)
    c.lora.update(rank=4, alpha=8.0, targets=TARGETS)
    c.optim.warmup_steps = 0
    trainer = Trainer.build(c, workdir=None)
    initial = jax.device_get((trainer.state.params, trainer.state.frozen))
    _, state, _ = run_steps(trainer, 3)
    return c, trainer, initial, state


def test_only_adapters_train(trained):
    c, trainer, (params0, frozen0), state = trained
    adapters = flatten(state.params)
    assert set(adapters) == {f"layers/{m}_lora_{ab}" for m in ("attn/wq", "attn/wo", "mlp/w_down")
                             for ab in "ab"}
    for path, base in flatten(frozen0).items():  # base weights bit-identical after training
        np.testing.assert_array_equal(np.asarray(flatten(state.frozen)[path]), base, err_msg=path)
    for path, before in flatten(params0).items():
        assert not np.array_equal(np.asarray(adapters[path]), before), path
    assert not np.any(flatten(params0)["layers/attn/wq_lora_b"])  # B starts at zero
    # The optimizer state holds moments for the adapters only.
    opt_paths = set()
    for keypath, _ in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        names = [str(getattr(k, "key", "")) for k in keypath if hasattr(k, "key")]
        if names:
            opt_paths.add("/".join(names))
    assert opt_paths and opt_paths <= set(adapters)


def _dims(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


def _base_weight(base, logical):
    """(stored weight, logical renames) of an adapted weight: a part of a fused weight
    (`attn/wq` of `attn/wqkv`) follows the fused one, whose `kv` dimension holds the query
    heads grouped by kv head (models/nn/fused.py)."""
    if base in logical:
        return base, {}
    for fused_path, spec in LLAMA_FUSED.items():
        module, leaf = fused_path.split("/")
        for part in spec.parts:
            if base.endswith(f"{module}/{part}"):
                return base[: -len(part)] + leaf, {"heads": "kv"}
    raise KeyError(base)


def assert_adapters_follow_base(specs, logical, adapter_paths):
    """Each adapter dimension is sharded exactly as the base weight's dimension of the same
    logical name (the same rules resolve both); the rank dimension is replicated."""
    checked = 0
    for path in adapter_paths:
        base, rename = _base_weight(path[: -len("_lora_a")], logical)
        base_axes = dict(zip(logical[base], _dims(specs[base], len(logical[base]))))
        for name, mesh_axes in zip(logical[path], _dims(specs[path], len(logical[path]))):
            expected = None if name == "lora_rank" else base_axes[rename.get(name, name)]
            assert mesh_axes == expected, (path, name, mesh_axes, expected)
            checked += mesh_axes is not None
    assert checked, "no adapter dimension is sharded at all"


def test_adapter_shardings_follow_rules(trained):
    c, trainer, _, state = trained
    specs = param_specs(trainer.ctx.model_def, trainer.ctx.rules, trainer.ctx.mesh)
    logical = trainer.ctx.model_def.logical_axes()
    adapters = [p for p in specs if lora.is_adapter(p)]
    assert_adapters_follow_base(specs, logical, adapters)
    assert "fsdp" in _dims(specs["layers/attn/wq_lora_a"], 3)      # (L, embed, r)
    assert "tensor" in _dims(specs["layers/attn/wq_lora_b"], 4)    # (L, r, heads, D)
    mesh = trainer.ctx.mesh
    for path, arr in flatten(state.params).items():
        assert arr.sharding == NamedSharding(mesh, specs[path]), path
    mu = flatten(state.opt_state[1][0].mu)
    assert mu["layers/attn/wq_lora_a"].sharding == NamedSharding(mesh, specs[
        "layers/attn/wq_lora_a"])


def test_merged_model_matches_base_plus_adapters(trained):
    c, trainer, _, state = trained
    full = jax.device_get(merge_trees(state.params, state.frozen))
    merged = lora.merge(full, c.lora)
    assert not any(lora.is_adapter(k) for k in flatten(merged))
    base_def = ModelDef.build(c.model, get_policy(c.precision))
    assert set(flatten(merged)) == set(base_def.shapes())
    tokens = jnp.asarray(np.arange(2 * 16).reshape(2, 16) % 256, jnp.int32)
    with_adapters = trainer.ctx.model_def.module(full)(tokens)
    folded = base_def.module(merged)(tokens)
    chex.assert_trees_all_close(folded, with_adapters, atol=1e-5, rtol=1e-7)
    assert np.abs(np.asarray(folded - base_def.module(dict(jax.device_get(state.frozen)))(
        tokens))).max() > 1e-4  # the trained adapters do change the model
    assert set(flatten(lora.adapter_params(full))) == set(flatten(state.params))


def test_bad_targets_and_dropout_are_config_errors():
    c = get_config("test")
    model_def = ModelDef.build(c.model, get_policy(c.precision))
    c.lora.update(rank=2, targets=("nothing_matches",))
    with pytest.raises(ConfigError, match="matched no adaptable weight"):
        lora.with_adapters(model_def, c.lora)
    c.lora.targets = ("embedding",)
    with pytest.raises(ConfigError, match="cannot take adapters"):
        lora.with_adapters(model_def, c.lora)
    c.lora.update(targets=("attn/wq",), dropout=1.0)
    with pytest.raises(ConfigError, match="dropout"):
        lora.with_adapters(model_def, c.lora)
