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
from jax.ad_checkpoint import checkpoint_name

from jaxscale.models.fused import FUSED_AXIS, GATE_UP
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


def _adapter_delta(module: nnx.Module, name: str, ndim: int) -> jax.Array | None:
    """scale * A.B of the adapters `models/lora.py` attached for weight `name`, if any."""
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return None
    b, scale = getattr(module, f"{name}_lora_b")[...], getattr(module, f"{name}_lora_scale")
    return lora_delta(a[...], b, scale, ndim)


def weight(module: nnx.Module, name: str) -> jax.Array:
    """`module.<name>`, plus its low-rank delta when `models/lora.py` attached adapters to it.

    A fused weight (`module.FUSED[name]`, see `models/fused.py`) takes adapters per part
    (`wq_lora_a`, ...): their deltas are joined into its layout, zeros for parts without."""
    w = getattr(module, name)[...]
    fused = getattr(type(module), "FUSED", {}).get(name)
    if fused is not None:
        deltas = {p: _adapter_delta(module, p, w.ndim - 1) for p in fused.parts}
        if all(d is None for d in deltas.values()):
            return w
        return w + fused.zero_filled(w, {p: None if d is None else d.astype(w.dtype)
                                         for p, d in deltas.items()})
    delta = _adapter_delta(module, name, w.ndim)
    return w if delta is None else w + delta.astype(w.dtype)


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
    x.W + scale * (drop(x).A).B as in the LoRA paper, so each example gets its own mask. A fused
    weight adds each adapted part's term in its slot of the fused output.
    """
    key = _DROPOUT_KEY.get()
    fused = getattr(type(module), "FUSED", {}).get(name)
    parts = fused.parts if fused is not None else (name,)
    adapted = [p for p in parts if hasattr(module, f"{p}_lora_a")]
    w = getattr(module, name)[...]
    part_ndim = w.ndim - (fused is not None)
    a0 = getattr(module, f"{adapted[0]}_lora_a")[...] if adapted else None
    if (key is None or not any(getattr(module, f"{p}_lora_dropout", 0.0) for p in adapted)
            # a stacked (unscanned) weight: no per-layer path here
            or a0.ndim + getattr(module, f"{adapted[0]}_lora_b").ndim - 2 != part_ndim):
        return jnp.einsum(eq, x, weight(module, name).astype(dtype))
    (xs, ws), out = eq.split("->")[0].split(","), eq.split("->")[1]
    n_in = a0.ndim - 1
    y = jnp.einsum(eq, x, w.astype(dtype))
    deltas = {p: _dropout_term(module, p, xs, ws[:n_in], x, dtype, key).astype(y.dtype)
              for p in adapted}
    if fused is not None:
        return y + fused.zero_filled(y, deltas)
    batch = "".join(ch for ch in xs if ch not in ws[:n_in])
    return y + jnp.einsum(f"{batch}{ws[n_in:]}->{out}", deltas[name])


def _dropout_term(module: nnx.Module, name: str, xs: str, ins: str, x: jax.Array, dtype,
                  key: jax.Array) -> jax.Array:
    """scale * (drop(x).A).B for the adapters of weight `name`: (batch dims.., out dims..)."""
    rate = getattr(module, f"{name}_lora_dropout", 0.0)
    a, b = getattr(module, f"{name}_lora_a")[...], getattr(module, f"{name}_lora_b")[...]
    batch = "".join(ch for ch in xs if ch not in ins)
    z = next(ch for ch in "zyxwvu" if ch not in xs + ins)
    outs = "".join(ch for ch in "mnopqrs" if ch not in xs + ins)[:b.ndim - 1]
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
    delta = jnp.einsum(f"{batch}{z},{z}{outs}->{batch}{outs}", h, b.astype(dtype))
    return getattr(module, f"{name}_lora_scale") * delta


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

    Gate and up are one fused weight (E, 2, F) (`models/fused.py`: one matmul, so one input
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
        # Named for the remat policies (`models/scan.py` ACTIVATION_NAMES).
        gate_up_BT2F = checkpoint_name(project(self, "w_gate_up", "bte,ecf->btcf", x_BTE, c),
                                       "mlp_gate_up")
        gate_BTF, up_BTF = GATE_UP.split(gate_up_BT2F)
        h_BTF = constrain(ACTIVATIONS[self.activation](gate_BTF) * up_BTF, "batch", "length", "mlp")
        out_BTE = project(self, "w_down", "btf,fe->bte", h_BTF, c)
        return constrain(out_BTE, "batch", "length", "embed")
