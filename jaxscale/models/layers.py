"""Llama building blocks in Flax NNX: every parameter and key activation has logical axis names.

Parameters are created by `param`, which records `logical_axes` as NNX variable metadata; the
rules module resolves them to PartitionSpecs. Layers can be created *stacked* (`stack=L`): every
parameter gets a leading `layers` dimension so the decoder can `scan` over depth (compile time
independent of depth) and the pipeline can split that axis into stages.
Shape suffixes: B batch, T length, E embed, H heads, K kv heads, G heads per kv head,
D head dim, F mlp hidden, V vocab, S source length. Attention (and its KV cache): attention.py;
rotary embeddings: rope.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.precision import Policy
from jaxscale.rules import constrain


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


def lora_delta(a: jax.Array, b: jax.Array, scale: float, ndim: int) -> jax.Array:
    """scale * A.B for adapters A (lead.., in.., r) and B (lead.., r, out..) of an ndim weight."""
    lead = a.ndim + b.ndim - 2 - ndim
    n_in = a.ndim - 1 - lead
    letters = "abcdefghijklmnopq"
    l, i, o = letters[:lead], letters[lead:lead + n_in], letters[lead + n_in:ndim]
    return scale * jnp.einsum(f"{l}{i}z,{l}z{o}->{l}{i}{o}", a, b)


def weight(module: nnx.Module, name: str) -> jax.Array:
    """`module.<name>`, plus its low-rank delta when `models/lora.py` attached adapters to it."""
    w = getattr(module, name)[...]
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return w
    b, scale = getattr(module, f"{name}_lora_b")[...], getattr(module, f"{name}_lora_scale")
    return w + lora_delta(a[...], b, scale, w.ndim).astype(w.dtype)


# The key for LoRA dropout, set by the train step only (`adapter_dropout`): evaluation, export
# and generation never set it, so dropout can only ever act while training.
_DROPOUT_KEY: contextvars.ContextVar = contextvars.ContextVar("lora_dropout_key", default=None)


@contextlib.contextmanager
def adapter_dropout(key: jax.Array) -> Iterator[None]:
    """Enables LoRA dropout (modules with `<name>_lora_dropout` > 0) while a step is traced."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


def project(module: nnx.Module, name: str, eq: str, x: jax.Array, dtype) -> jax.Array:
    """`einsum(eq, x, module.<name>)` in `dtype`, LoRA adapters included.

    Normally the adapters are folded into the weight (`weight`: one matmul, sharded like W).
    While training with lora.dropout > 0 they act on a dropped-out copy of the input instead,
    x.W + scale * (drop(x).A).B as in the LoRA paper, so each example gets its own mask.
    """
    rate = getattr(module, f"{name}_lora_dropout", 0.0)
    key = _DROPOUT_KEY.get()
    if not rate or key is None or not hasattr(module, f"{name}_lora_a"):
        return jnp.einsum(eq, x, weight(module, name).astype(dtype))
    w = getattr(module, name)[...]
    a, b = getattr(module, f"{name}_lora_a")[...], getattr(module, f"{name}_lora_b")[...]
    if a.ndim + b.ndim - 2 != w.ndim:  # a stacked (unscanned) weight: no per-layer path here
        return jnp.einsum(eq, x, weight(module, name).astype(dtype))
    (xs, ws), out = eq.split("->")[0].split(","), eq.split("->")[1]
    ins, outs = ws[:a.ndim - 1], ws[a.ndim - 1:]
    batch = "".join(ch for ch in xs if ch not in ins)
    z = next(ch for ch in "zyxwvu" if ch not in eq)
    # Distinct masks per projection (its name), per layer of a scanned stack (the layer's own
    # adapter values differ) and per microbatch / data replica / pipeline stage (their inputs
    # differ; a recomputation sees the same input, so the same mask), without threading keys
    # through the scans that run them.
    bits = lambda v: jax.lax.bitcast_convert_type(
        jax.lax.stop_gradient(v).astype(jnp.float32), jnp.uint32)
    key = jax.random.fold_in(jax.random.fold_in(key, zlib.crc32(name.encode())),
                             bits(a.reshape(-1)[0]))
    key = jax.random.fold_in(key, bits(jnp.sum(x, dtype=jnp.float32)))
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    dropped = jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))
    h = jnp.einsum(f"{xs},{ins}{z}->{batch}{z}", dropped, a.astype(dtype))
    delta = jnp.einsum(f"{batch}{z},{z}{outs}->{out}", h, b.astype(dtype))
    y = jnp.einsum(eq, x, w.astype(dtype))
    return y + (getattr(module, f"{name}_lora_scale") * delta).astype(y.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, policy: Policy, *, stack: int | None = None):
        self.scale = param(None, (dim,), ("norm",), init="ones", stack=stack, dtype=policy.param)
        self.eps, self.policy = eps, policy

    def __call__(self, x_BTE: jax.Array) -> jax.Array:
        dtype = self.policy.dtype_for("norm")
        x = x_BTE.astype(dtype)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        scale_11E = self.scale[...].astype(dtype)[None, None, :]
        return (x * scale_11E).astype(self.policy.compute)


class MLP(nnx.Module):
    """SwiGLU: column-parallel gate/up over `mlp`, row-parallel down back to `embed`."""

    LORA_WEIGHTS = ("w_gate", "w_up", "w_down")

    def __init__(self, embed: int, hidden: int, policy: Policy, rngs: nnx.Rngs, *,
                 stack: int | None = None):
        kw = dict(stack=stack, dtype=policy.param)
        self.w_gate = param(rngs, (embed, hidden), ("embed", "mlp"), fan_in=embed, **kw)
        self.w_up = param(rngs, (embed, hidden), ("embed", "mlp"), fan_in=embed, **kw)
        self.w_down = param(rngs, (hidden, embed), ("mlp", "embed"), fan_in=hidden, **kw)
        self.policy = policy

    def __call__(self, x_BTE: jax.Array) -> jax.Array:
        c = self.policy.compute
        gate_BTF = project(self, "w_gate", "bte,ef->btf", x_BTE, c)
        up_BTF = project(self, "w_up", "bte,ef->btf", x_BTE, c)
        h_BTF = constrain(jax.nn.silu(gate_BTF) * up_BTF, "batch", "length", "mlp")
        out_BTE = project(self, "w_down", "btf,fe->bte", h_BTF, c)
        return constrain(out_BTE, "batch", "length", "embed")
