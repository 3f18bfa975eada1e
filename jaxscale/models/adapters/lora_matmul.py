"""LoRA adapters at work inside a layer: how a projection reads a weight that took adapters.

`lora.py` attaches A and B beside a weight W (`wq` -> `wq_lora_a`, `wq_lora_b`,
with `wq_lora_scale` and `wq_lora_dropout`) and sets this module's `project` as the module's
`ADAPTED_PROJECTION` (`nn/layers.py`), so the layer's own `layers.project` hands its
matmul here without the layers knowing of adapters. Normally the adapters are folded into the
weight (`weight`: W + scale * A.B, one matmul, sharded like W); while the train step enables
`adapter_dropout`, they act on a dropped-out copy of the input instead (the LoRA paper's
x.W + scale * (drop(x).A).B, a mask per example). A fused weight (`nn/fused.py`: `wqkv`,
`w_gate_up`) takes adapters per part, each part's term joined into its slot.
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx


def lora_delta(a: jax.Array, b: jax.Array, scale: float, ndim: int) -> jax.Array:
    """scale * A.B for adapters A (lead.., in.., r) and B (lead.., r, out..) of an ndim weight."""
    lead = a.ndim + b.ndim - 2 - ndim
    n_in = a.ndim - 1 - lead
    letters = "abcdefghijklmnopq"
    l, i, o = letters[:lead], letters[lead:lead + n_in], letters[lead + n_in:ndim]
    return scale * jnp.einsum(f"{l}{i}z,{l}z{o}->{l}{i}{o}", a, b)


def _adapter_delta(module: nnx.Module, name: str, ndim: int) -> jax.Array | None:
    """scale * A.B of the adapters `lora.add_adapters` attached for weight `name`, if any."""
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return None
    b, scale = getattr(module, f"{name}_lora_b")[...], getattr(module, f"{name}_lora_scale")
    return lora_delta(a[...], b, scale, ndim)


def weight(module: nnx.Module, name: str) -> jax.Array:
    """`module.<name>`, plus its low-rank delta when `lora.add_adapters` attached adapters to it.

    A fused weight (`module.FUSED[name]`, see `nn/fused.py`) takes adapters per part
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
    """`einsum(eq, x, module.<name>)` in `dtype`, LoRA adapters included: a module's
    `ADAPTED_PROJECTION` once it has adapters (`layers.project` calls it).

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
