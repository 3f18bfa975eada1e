"""MoE on every n-th layer (`model.moe.every`, `models/decoder/block.LayerGroup`) and MoE under the
1F1B schedule (`parallel/onef1b.py`): the layer pattern is Hugging Face Qwen-MoE's (dense
first), parameters, FLOPs and the KV cache follow it, and a tiny MoE decoder trains under 1F1B
pipeline stages with one device's losses and router metrics, the router's losses in the
gradients."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale.config import validate
from jaxscale.models import ModelDef
from jaxscale.models.adapters import lora
from jaxscale.models.decoder import flops
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.decoder.llama import Llama
from jaxscale.models.moe.routers import METRICS
from tests.test_moe import POLICY, _tiny_moe_config, _train


def test_every_other_layer_has_the_experts_and_decodes_with_the_cache():
    """every=2 on 2 layers: one scanned group, the dense layer first (HF decoder_sparse_step):
    its parameters, counts and FLOPs (the mean of an all-MoE and an all-dense model's, the
    head's counted once), and incremental decoding equal to the full forward."""
    c = _tiny_moe_config(every=2)
    validate(c)
    cfg = LlamaConfig.from_config(c.model)
    model = Llama(cfg, nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    assert params["layers"]["dense_0"]["mlp"]["w_gate_up"].shape[0] == 1
    assert params["layers"]["moe"]["mlp"]["w_gate"].shape == (1, 4, 64, c.model.mlp)
    assert cfg.moe_layers == 1
    assert cfg.num_params() == ModelDef.build(c.model, POLICY).num_params() == sum(
        x.size for x in jax.tree.leaves(params))
    lora_cfg = SimpleNamespace(rank=2, alpha=4.0, targets=("attn/wq$",), dropout=0.0)
    adapters = [k for k in lora.with_adapters(ModelDef.build(c.model, POLICY), lora_cfg).shapes()
                if "lora" in k]  # LoRA targets match in every block of the group
    assert sorted(adapters) == [f"layers/{b}/attn/wq_lora_{ab}" for b in ("dense_0", "moe")
                                for ab in "ab"]
    every_layer, dense = _tiny_moe_config().model, _tiny_moe_config(num_experts=0).model
    for count in (flops.flops_per_token, flops.recompute_flops_per_token):
        assert count(c.model, 32) == pytest.approx(
            (count(every_layer, 32) + count(dense, 32)) / 2, rel=1e-12)

    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 256)

    @nnx.jit
    def both(model):
        cache = model.init_cache(2, 16)
        first, cache = model(tokens[:, :5], cache=cache, cache_index=0)
        rest, _ = model(tokens[:, 5:], cache=cache, cache_index=5)
        return jnp.concatenate([first, rest], 1), model(tokens)

    cached, full = both(model)
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("every, microbatches", [
    (2, 1),  # one microbatch: the Switch loss is the batch's, as on one device
    pytest.param(1, 1, marks=pytest.mark.exhaustive),
])
def test_moe_trains_under_1f1b_stages_as_on_one_device(every, microbatches):
    """Four layers (every=2: two groups, one a stage) on mesh.pipeline=2 under 1F1B: the losses
    and the router's metrics equal one device's. The router's losses weigh enough (aux 1.0)
    that leaving their gradient out of the schedule's backward shows in the later losses."""
    c = _tiny_moe_config(every=every, shared_experts=1, router_aux_loss_coef=1.0,
                         router_z_loss_coef=0.01)
    c.model.num_layers = 4
    one, m_one = _train(c, jax.devices()[:1], steps=3)
    c.mesh.update(pipeline=2)
    c.pipeline.update(schedule="1f1b", microbatches=microbatches)
    validate(c)
    piped, m_piped = _train(c, jax.devices()[:2], steps=3)
    np.testing.assert_allclose(piped, one, rtol=1e-5)
    for metric in METRICS.values():
        assert m_piped[metric] == pytest.approx(m_one[metric], rel=1e-5, abs=1e-6), metric


@pytest.mark.exhaustive
def test_1f1b_carries_per_microbatch_router_losses_as_gpipe():
    """With two microbatches the Switch loss is each microbatch's (as under GPipe): 1F1B's
    losses and metrics equal GPipe's on pipeline=2 x data=2, every=2."""
    c = _tiny_moe_config(every=2, router_aux_loss_coef=1.0)
    c.model.num_layers = 4
    c.mesh.update(pipeline=2, data=2)
    c.pipeline.microbatches = 2
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        c.pipeline.schedule = schedule
        validate(c)
        runs[schedule] = _train(c, jax.devices()[:4], steps=3)
    np.testing.assert_allclose(runs["1f1b"][0], runs["gpipe"][0], rtol=1e-5)
    for metric in METRICS.values():
        assert runs["1f1b"][1][metric] == pytest.approx(runs["gpipe"][1][metric], rel=1e-5)
