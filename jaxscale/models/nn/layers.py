"""Decoder building blocks in Flax NNX: every parameter and key activation has logical axis names.

Parameters are created by `param`, which records `logical_axes` as NNX variable metadata; the
rules module resolves them to PartitionSpecs. Layers can be created *stacked* (`stack=L`): every
parameter gets a leading `layers` dimension so the decoder can `scan` over depth (compile time
independent of depth) and the pipeline can split that axis into stages.

Linear weights are read through `project`, the one einsum of a weight (or whole through
`weight`, where a grouped matmul takes them). A module whose weights took LoRA adapters carries
the adapters' own projection and weight (`ADAPTED_PROJECTION`, `ADAPTED_WEIGHT`, set on it by
`adapters/lora.add_adapters`), which `project` / `weight` hand the read to: this package never
imports the adapters, the adapters reach down into it.
Shape suffixes: B batch, T length, E embed, H heads, K kv heads, G heads per kv head,
D head dim, F mlp hidden, V vocab, S source length. Attention (and its KV cache):
`attention/`; rotary embeddings: `rope.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.models.nn.fused import FUSED_AXIS, GATE_UP
from jaxscale.precision import Policy
from jaxscale.rules import constrain

# The attribute naming a module's adapted projection, (module, name, eq, x, dtype) -> y; absent
# on a module without adapters.
ADAPTED_PROJECTION = "adapted_projection"
# The attribute naming a module's adapted weight, (module, name) -> W + its adapters' delta, for
# weights read whole (a mixture of experts' stacked experts); absent without adapters.
ADAPTED_WEIGHT = "adapted_weight"


def param(rngs: nnx.Rngs | None, shape: Sequence[int], axes: Sequence[str | None], *,
          init: str = "normal", fan_in: int = 1, stack: int | None = None,
          dtype=jnp.float32) -> nnx.Param:
    """A parameter with logical axes; `stack` prepends a `layers` dimension."""
    shape, axes = tuple(shape), tuple(axes)
    if stack is not None:
        shape, axes = (stack,) + shape, ("layers",) + axes
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:  # fan-in scaled normal, computed on the unstacked shape
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in))
        value = value.astype(dtype)
    return nnx.Param(value, logical_axes=axes)


def project(module: nnx.Module, name: str, eq: str, x: jax.Array, dtype) -> jax.Array:
    """`einsum(eq, x, module.<name>)` in `dtype`: the matmul of every weight a module lists in
    its `LORA_WEIGHTS`, so adapters (and int8 training, `adapters/int8.py`) find it.
    A module with adapters runs its `ADAPTED_PROJECTION` instead (the base weight plus the
    adapters' low-rank term, `adapters/lora_matmul.py`)."""
    adapted = getattr(module, ADAPTED_PROJECTION, None)
    if adapted is not None:
        return adapted(module, name, eq, x, dtype)
    return jnp.einsum(eq, x, getattr(module, name)[...].astype(dtype))


def weight(module: nnx.Module, name: str) -> jax.Array:
    """`module.<name>` read whole (the experts' weights, which grouped matmuls take as they
    are): through the module's `ADAPTED_WEIGHT` once it has adapters (the base weight plus the
    adapters' delta, `adapters/lora_matmul.weight`)."""
    adapted = getattr(module, ADAPTED_WEIGHT, None)
    return adapted(module, name) if adapted is not None else getattr(module, name)[...]


class RMSNorm(nnx.Module):
    """RMSNorm over the last dimension of any-rank input; `axis` names the scale's logical axis
    (`norm` for the residual stream, `head_dim` for the per-head q/k norms of Qwen3).

    `offset` (Gemma): the input is multiplied by 1 + scale, the scale starting at zero, as
    Gemma's checkpoints store it; off, by the scale itself (starting at one)."""

    def __init__(self, dim: int, eps: float, policy: Policy, *, stack: int | None = None,
                 axis: str = "norm", offset: bool = False):
        self.scale = param(None, (dim,), (axis,), init="zeros" if offset else "ones",
                           stack=stack, dtype=policy.param)
        self.eps, self.policy, self.offset = eps, policy, offset

    def __call__(self, x_BTE: jax.Array) -> jax.Array:
        dtype = self.policy.dtype_for("norm")
        x = x_BTE.astype(dtype)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        scale_11E = self.scale[...].astype(dtype).reshape((1,) * (x.ndim - 1) + (-1,))
        if self.offset:
            scale_11E = 1.0 + scale_11E
        return (x * scale_11E).astype(self.policy.compute)


# The gated MLP's activation by `model.mlp_activation`: SwiGLU (silu) or GeGLU (Gemma's
# tanh-approximated GELU, HF `gelu_pytorch_tanh`).
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class MLP(nnx.Module):
    """SwiGLU (or GeGLU, `activation`): column-parallel gate/up over `mlp`, row-parallel down
    back to `embed`.

    Gate and up are one fused weight (E, 2, F) (`fused.py`: one matmul, so one input
    all-reduce under tensor parallelism); LoRA still targets them as `w_gate` / `w_up`."""

    LORA_WEIGHTS = ("w_gate", "w_up", "w_down")
    FUSED = {"w_gate_up": GATE_UP}

    def __init__(self, embed: int, hidden: int, policy: Policy, rngs: nnx.Rngs, *,
                 stack: int | None = None, activation: str = "silu"):
        kw = dict(stack=stack, dtype=policy.param)
        # Two fan-in scaled normals: the same initial distribution as separate gate/up.
        self.w_gate_up = param(rngs, (embed, 2, hidden), ("embed", FUSED_AXIS, "mlp"),
                               fan_in=embed, **kw)
        self.w_down = param(rngs, (hidden, embed), ("mlp", "embed"), fan_in=hidden, **kw)
        self.policy, self.activation = policy, activation

    def __call__(self, x_BTE: jax.Array) -> jax.Array:
        c = self.policy.compute
        # Named for the remat policies (`scan.py` ACTIVATION_NAMES).
        gate_up_BT2F = checkpoint_name(project(self, "w_gate_up", "bte,ecf->btcf", x_BTE, c),
                                       "mlp_gate_up")
        gate_BTF, up_BTF = GATE_UP.split(gate_up_BT2F)
        h_BTF = constrain(ACTIVATIONS[self.activation](gate_BTF) * up_BTF, "batch", "length", "mlp")
        out_BTE = project(self, "w_down", "btf,fe->bte", h_BTF, c)
        return constrain(out_BTE, "batch", "length", "embed")
