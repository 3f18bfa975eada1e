"""Optimizers by name (optax), the learning-rate schedule and gradient clipping.

`OPTIMIZERS` is the registry: a config name maps to one function building the optax
transformation from `config.optim`. Every optimizer is wrapped with global-norm clipping and
uses a linear-warmup + cosine-decay schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxscale.errors import ConfigError, paragraph


def schedule(optim_cfg: Any, total_steps: int) -> optax.Schedule:
    warmup = min(optim_cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim_cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=optim_cfg.lr * optim_cfg.min_lr_ratio)


def _adamw(c: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay)


def _lamb(c: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.lamb(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay)


def _adafactor(c: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.adafactor(lr, weight_decay_rate=c.weight_decay or None)


def _sgd(c: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    """SGD with heavy-ball momentum (`optim.momentum`; 0 = plain SGD) or, with
    `optim.nesterov=True`, Nesterov's look-ahead variant of it."""
    nesterov = bool(c.get("nesterov", False))
    if nesterov and not c.momentum:
        raise ConfigError(paragraph(
            f"optim.nesterov=True needs momentum but optim.momentum={c.momentum}: set",
            "optim.momentum (e.g. 0.9) or optim.nesterov=False."))
    return optax.sgd(lr, momentum=c.momentum or None, nesterov=nesterov)


# ---- 8-bit Adam ------------------------------------------------------------------------------
# Moments are stored as int8 arrays of the parameter's own shape (so state.py shards them exactly
# like the parameter) plus one float32 absmax scale per block of QBLOCK consecutive values along
# the LAST axis: scales have shape param.shape[:-1] + (ceil(last / QBLOCK),), i.e. they keep the
# parameter's leading dimensions and are sharded along them (state.py shards a leaf whose shape
# matches a parameter's except in the last dimension with the parameter's spec minus that
# dimension). Blocks along the last axis (not over the flattened array, as
# jaxscale/weights/push_codec.py does) never straddle the leading dimensions, which is what keeps
# the int8 array parameter-shaped.
# First moment: signed linear absmax, round to nearest (error <= scale/2 per value).
# Second moment: stored as sqrt(v) (halves the dynamic range in log space, so small v survive
# 8 bits), rounded to nearest but never to 0 for v > 0 (at least one step): the denominator
# sqrt(v)+eps cannot collapse to eps while its first moment survives, so updates stay bounded
# (|m| <= sqrt(v) in Adam). Always rounding up would also be safe but biases every step smaller.
QBLOCK = 256


class Adam8bitState(NamedTuple):
    count: jax.Array
    mu_q: Any     # int8, param-shaped
    mu_scale: Any   # float32, param.shape[:-1] + (blocks,)
    nu_q: Any     # int8 of sqrt(v), param-shaped
    nu_scale: Any


def _blocks(x: jax.Array) -> tuple[jax.Array, int]:
    """x as (..., blocks, QBLOCK) zero-padded along the last axis; returns (blocks, pad)."""
    if x.ndim == 0:
        x = x[None]
    last = x.shape[-1]
    size = min(QBLOCK, last)
    pad = (-last) % size
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size), pad


def quantize_lastaxis(x: jax.Array, nonzero: bool = False) -> tuple[jax.Array, jax.Array]:
    """(int8 of x's shape, float32 absmax/127 per block of the last axis)."""
    blocks, pad = _blocks(x.astype(jnp.float32))
    scale = jnp.max(jnp.abs(blocks), axis=-1) / 127.0
    ratio = blocks / jnp.where(scale > 0, scale, 1.0)[..., None]
    q = jnp.round(ratio)
    if nonzero:  # a positive value never becomes 0 (the second moment is a denominator)
        q = jnp.where(ratio > 0, jnp.maximum(q, 1.0), q)
    q = jnp.clip(q, -127, 127).astype(jnp.int8)
    q = q.reshape(*q.shape[:-2], -1)
    q = q[..., :q.shape[-1] - pad] if pad else q
    return q.reshape(x.shape), scale


def dequantize_lastaxis(q: jax.Array, scale: jax.Array) -> jax.Array:
    blocks, pad = _blocks(q.astype(jnp.float32))
    x = (blocks * scale[..., None]).reshape(*blocks.shape[:-2], -1)
    x = x[..., :x.shape[-1] - pad] if pad else x
    return x.reshape(q.shape)


def scale_by_adam8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
                      ) -> optax.GradientTransformation:
    """Adam's direction m_hat / (sqrt(v_hat) + eps) with both moments held in 8 bits."""

    def init(params):
        zeros = jax.tree.map(lambda p: quantize_lastaxis(jnp.zeros(p.shape, jnp.float32)), params)
        q = jax.tree.map(lambda z: z[0], zeros, is_leaf=lambda z: isinstance(z, tuple))
        s = jax.tree.map(lambda z: z[1], zeros, is_leaf=lambda z: isinstance(z, tuple))
        return Adam8bitState(jnp.zeros((), jnp.int32), q, s, q, s)

    def update(grads, state, params=None):
        del params
        count = state.count + 1
        t = count.astype(jnp.float32)

        def one(g, mq, ms, nq, ns):
            g = g.astype(jnp.float32)
            m = b1 * dequantize_lastaxis(mq, ms) + (1 - b1) * g
            v = b2 * jnp.square(dequantize_lastaxis(nq, ns)) + (1 - b2) * jnp.square(g)
            mq, ms = quantize_lastaxis(m)
            nq, ns = quantize_lastaxis(jnp.sqrt(v), nonzero=True)
            u = (m / (1 - b1 ** t)) / (jnp.sqrt(v / (1 - b2 ** t)) + eps)
            return u.astype(g.dtype), mq, ms, nq, ns

        out = jax.tree.map(one, grads, state.mu_q, state.mu_scale, state.nu_q, state.nu_scale)
        pick = lambda i: jax.tree.map(lambda o: o[i], out, is_leaf=lambda o: isinstance(o, tuple))
        updates = jax.tree.map(lambda o, g: o[0].astype(g.dtype), out, grads,
                               is_leaf=lambda o: isinstance(o, tuple))
        return updates, Adam8bitState(count, pick(1), pick(2), pick(3), pick(4))

    return optax.GradientTransformation(init, update)


def _adam8bit(c: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.chain(scale_by_adam8bit(c.b1, c.b2, c.eps),
                       optax.add_decayed_weights(c.weight_decay), optax.scale_by_learning_rate(lr))


OPTIMIZERS: dict[str, Callable[[Any, optax.Schedule], optax.GradientTransformation]] = {
    "adamw": _adamw, "lamb": _lamb, "adafactor": _adafactor, "sgd": _sgd, "adam8bit": _adam8bit,
}


# The numbers of `config.optim` and their valid ranges: optax takes any float, and a negative
# learning rate or clip norm (which flips the gradient's sign) trains the model backwards
# without an error. (low, high, low included, high included, an example).
_RANGES = {
    "lr": (0.0, math.inf, False, False, "3e-4"),
    "min_lr_ratio": (0.0, 1.0, True, True, "0.1"),
    "weight_decay": (0.0, math.inf, True, False, "0.01"),
    "b1": (0.0, 1.0, True, False, "0.9"),
    "b2": (0.0, 1.0, True, False, "0.95"),
    "eps": (0.0, math.inf, True, False, "1e-8"),
    "clip_norm": (0.0, math.inf, True, False, "1.0 (0: no clipping)"),
    "momentum": (0.0, 1.0, True, False, "0.9"),
}


def check_settings(optim_cfg: Any) -> None:
    """Refuses, in one paragraph naming the field, a `config.optim` number outside its range
    (the name is checked with the other names, `config._validate_choices`)."""
    for name, (low, high, with_low, with_high, example) in _RANGES.items():
        value = optim_cfg.get(name)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and math.isfinite(value)
        if not (number and (value >= low if with_low else value > low)
                and (value <= high if with_high else value < high)):
            where = (f"in {'[' if with_low else '('}{low:g}, {high:g}{']' if with_high else ')'}"
                     if math.isfinite(high) else f"{'>=' if with_low else '>'} {low:g}")
            raise ConfigError(paragraph(
                f"optim.{name}={value!r} is outside its range: it must be a finite number {where}",
                f"(e.g. --config.optim.{name}={example}).",
            ))
    warmup = optim_cfg.get("warmup_steps", 0)
    if not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(paragraph(
            f"optim.warmup_steps={warmup!r}: the steps of linear warm-up must be a whole number",
            ">= 0 (e.g. --config.optim.warmup_steps=20; 0: no warm-up).",
        ))


# ---- Optimizer-state host offload (`optim.offload_state`) ------------------------------------
# The optimizer state (AdamW's two float32 moments: 8 bytes a parameter, twice the float32
# weights) is only read and written once a step, by the update, so it can live in the host's
# pinned memory instead of HBM: the state's shardings carry `memory_kind=HOST_MEMORY`
# (`train/state.py`), the step copies it onto the device for the update (`on_device`) and its
# out_shardings copy the new state back. What it costs: the state crosses PCIe twice a step
# (`aot/roofline.py` charges it at `hardware.Chip.host_bytes_s`). jax supports the memory kinds
# on TPU, GPU and CPU (where host and device memory are the same RAM, so it changes nothing).
HOST_MEMORY = "pinned_host"


def check_offload(devices: Iterable[Any]) -> None:
    """A one-paragraph ConfigError where a device has no pinned host memory to offload to (a
    device listing no memories, such as a TPU topology's for AOT compiles, is not judged)."""
    for device in devices:
        kinds = {m.kind for m in device.addressable_memories()}
        if kinds and HOST_MEMORY not in kinds:
            raise ConfigError(paragraph(
                f"optim.offload_state=True keeps the optimizer state in {HOST_MEMORY!r} memory,",
                f"but {device.device_kind} devices offer only {', '.join(sorted(kinds))} here",
                "(jax's memory kinds). Set optim.offload_state=False, or run on a backend with",
                "pinned host memory (TPU, GPU and CPU in jax 0.10)."))


def on_host(shardings: Any) -> Any:
    """The same shardings in pinned host memory (every leaf a NamedSharding)."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings)


def on_device(tree: Any) -> Any:
    """Inside a jitted step: `tree` (offloaded state) copied into device memory, same sharding."""
    return jax.device_put(tree, jax.memory.Space.Device)


def make_optimizer(optim_cfg: Any, total_steps: int) -> tuple[optax.GradientTransformation,
                                                             optax.Schedule]:
    """Returns (clipped optimizer, its learning-rate schedule) for `config.optim`."""
    if optim_cfg.name not in OPTIMIZERS:
        raise ConfigError(paragraph(
            f"Unknown optimizer optim.name={optim_cfg.name!r}.",
            f"Valid names: {', '.join(OPTIMIZERS)}.",
        ))
    lr = schedule(optim_cfg, total_steps)
    chain = [optax.clip_by_global_norm(optim_cfg.clip_norm)] if optim_cfg.clip_norm else []
    return optax.chain(*chain, OPTIMIZERS[optim_cfg.name](optim_cfg, lr)), lr
