"""GPT-OSS's experts (`model.moe`: router_bias, expert_bias, swiglu_limit, router
`topk_softmax`) equal transformers' `GptOssMLP` on the same weights: the router's biased logits,
top-k then softmax over those k, each expert's biased gate / up (interleaved in transformers'
`gate_up_proj`), the clamped SwiGLU with up + 1, the biased down projection; dropless and with
fixed expert buffers large enough to drop nothing, and expert-parallel on a mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from jaxscale.mesh import make_mesh
from jaxscale.models.moe.config import MoEConfig, num_params
from jaxscale.models.moe.gmm import SwiGLU
from jaxscale.models.moe.layer import MoE
from jaxscale.precision import get_policy
from jaxscale.rules import PRESETS, AxisRules, normalize_rules, use_rules

E, F, X, K = 16, 8, 4, 2
GPT_OSS_MOE = dict(num_experts=X, experts_per_token=K, router="topk_softmax", router_bias=True,
                   expert_bias=True, swiglu_limit=7.0, mlp=F)


def _hf_mlp():
    torch.manual_seed(0)
    config = transformers.GptOssConfig(hidden_size=E, intermediate_size=F, num_local_experts=X,
                                       num_experts_per_tok=K, swiglu_limit=7.0)
    mlp = GptOssMLP(config).eval()
    with torch.no_grad():  # weights large enough that the clamp bites on some entries
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) * 1.5)
    return mlp


def _ours(mlp, **moe_fields):
    moe = MoEConfig.from_config({**GPT_OSS_MOE, **moe_fields})
    block = MoE(E, F, moe, get_policy("32-true"), nnx.Rngs(0))
    sd = {k: v.detach().numpy() for k, v in mlp.state_dict().items()}
    gate_up, gate_up_bias = sd["experts.gate_up_proj"], sd["experts.gate_up_proj_bias"]
    values = {"router": sd["router.weight"].T, "router_bias": sd["router.bias"],
              "w_gate": gate_up[..., ::2], "w_up": gate_up[..., 1::2],
              "b_gate": gate_up_bias[:, ::2], "b_up": gate_up_bias[:, 1::2],
              "w_down": sd["experts.down_proj"], "b_down": sd["experts.down_proj_bias"]}
    for name, value in values.items():
        getattr(block, name).set_value(jnp.asarray(value))
    return block


def _x():
    return np.random.default_rng(0).standard_normal((2, 6, E)).astype(np.float32)


@pytest.mark.parametrize("fields", [dict(), dict(capacity_factor=float(X))],
                         ids=["dropless", "capacity"])
def test_gpt_oss_experts_equal_transformers(fields):
    mlp = _hf_mlp()
    with torch.no_grad():
        ref = mlp(torch.from_numpy(_x()))[0].numpy()
    block = _ours(mlp, **fields)
    got = np.asarray(block(jnp.asarray(_x())))
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
    gate = np.asarray(block.w_gate[...])
    hidden = np.einsum("nte,xef->ntxf", _x(), gate) + np.asarray(block.b_gate[...])[None, None]
    assert (hidden > 7.0).any()  # the clamp is exercised
    plain = _ours(mlp, swiglu_limit=0.0, **fields)
    assert np.abs(np.asarray(plain(jnp.asarray(_x()))) - ref).max() > 1e-2


def test_gpt_oss_experts_expert_parallel_equal_one_device():
    """Experts over `expert`, their hidden width (and the gate / up biases) over `tensor`: the
    down bias is added once, not once per hidden shard."""
    block = _ours(_hf_mlp())
    ref = np.asarray(block(jnp.asarray(_x())))
    rules = AxisRules(normalize_rules(PRESETS["fsdp_tp"]))
    mesh = make_mesh({"fsdp": 2, "tensor": 2, "expert": 2}, jax.devices())

    @nnx.jit
    def apply(block, x):
        with use_rules(rules, mesh):
            return block(x)
    np.testing.assert_allclose(np.asarray(apply(block, jnp.asarray(_x()))), ref, atol=1e-5,
                               rtol=1e-5)


def test_clamped_swiglu_and_the_parameter_count():
    act = SwiGLU(limit=1.0, alpha=2.0)
    gate, up = jnp.asarray([3.0, -0.5]), jnp.asarray([-4.0, 0.5])
    # gate 3 -> 1 (clamped): 1 * sigmoid(2) * (-1 + 1) = 0; gate -0.5: -0.5 sigmoid(-1) * 1.5
    np.testing.assert_allclose(act(gate, up), [0.0, -0.5 / (1 + np.e) * 1.5], rtol=1e-6)
    moe = MoEConfig.from_config(GPT_OSS_MOE)
    block = _ours(_hf_mlp())
    counted = sum(v.size for v in jax.tree.leaves(nnx.state(block, nnx.Param)))
    assert num_params(moe, E, F) == counted == sum(p.numel() for p in _hf_mlp().parameters())


@pytest.fixture(scope="module")
def gpt_oss_one_device():
    """configs/gpt_oss.py:tiny (sinks, biases, alternating window, YaRN, biased experts with
    the clamped SwiGLU) trained on one device: losses and each step's gradients."""
    from tests.test_parallel_equivalence import run_steps
    return run_steps(_gpt_oss_config({}), jax.devices()[:1])


def _gpt_oss_config(mesh):
    from jaxscale.configs import sibling
    from tests.test_parallel_equivalence import STEPS
    c = sibling("gpt_oss").get_config("tiny")
    c.train.steps = STEPS
    c.mesh.update({**dict(data=1, fsdp=1, tensor=1), **mesh})
    c.rules_preset = "fsdp_tp" if mesh.get("tensor", 1) > 1 else c.rules_preset
    return c


@pytest.mark.parametrize("mesh", [
    dict(expert=2, data=2, fsdp=2),
    pytest.param(dict(fsdp=2, tensor=2, data=2), marks=pytest.mark.exhaustive)])
def test_gpt_oss_trains_sharded_as_on_one_device(gpt_oss_one_device, mesh):
    """The experts over `expert` (their biases with them) or their hidden width over `tensor`,
    the heads and their sinks over `tensor`: losses and gradients equal one device's."""
    from tests.test_parallel_equivalence import assert_equal_runs, run_steps
    got = run_steps(_gpt_oss_config(mesh), jax.devices())
    assert_equal_runs(got, gpt_oss_one_device)
    assert {"layers/attn/sinks", "layers/mlp/b_down"} <= set(gpt_oss_one_device[1][0])
