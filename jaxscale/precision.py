"""Precision policies: one declarative object says which dtype is used where.

Built from one config string, Fabric-style names (`32-true`, `bf16-mixed`, `bf16-true`,
`16-mixed`) or the explicit form `params=float32,compute=bfloat16,output=float32`. The model
consults the policy at well-named points (`param`, `compute`, `output`, and per-module overrides
such as `norm`, `softmax`, `logits`), never through scattered `astype` calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale.errors import ConfigError, paragraph

_DTYPES = {
    "float32": jnp.float32, "fp32": jnp.float32, "f32": jnp.float32, "32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16, "f16": jnp.float16, "16": jnp.float16,
}
# Modules kept in float32 under every mixed policy: numerically sensitive reductions.
_F32_OVERRIDES = {"norm": jnp.float32, "softmax": jnp.float32, "logits": jnp.float32}


@dataclass(frozen=True)
class Policy:
    """Dtypes for parameters (storage), compute (matmuls), output (loss), plus overrides."""

    name: str
    param: Any = jnp.float32
    compute: Any = jnp.float32
    output: Any = jnp.float32
    overrides: Mapping[str, Any] = field(default_factory=dict)
    loss_scaling: bool = False

    def dtype_for(self, module: str) -> Any:
        """Compute dtype for a named module kind (`norm`, `softmax`, `logits`, ...)."""
        return self.overrides.get(module, self.compute)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts floating leaves of `tree` to the compute dtype (done once per step)."""
        def cast(x):
            return x.astype(self.compute) if jnp.issubdtype(x.dtype, jnp.floating) else x
        return jax.tree.map(cast, tree)


def _named() -> dict[str, Policy]:
    return {
        "32-true": Policy("32-true"),
        "bf16-mixed": Policy("bf16-mixed", jnp.float32, jnp.bfloat16, jnp.float32, _F32_OVERRIDES),
        "bf16-true": Policy("bf16-true", jnp.bfloat16, jnp.bfloat16, jnp.float32,
                            {"softmax": jnp.float32, "logits": jnp.float32}),
        "16-mixed": Policy("16-mixed", jnp.float32, jnp.float16, jnp.float32, _F32_OVERRIDES,
                           loss_scaling=True),
    }


POLICIES = tuple(_named())


def _parse_explicit(text: str) -> Policy:
    parts = dict(p.split("=", 1) for p in text.split(",") if p)
    bad = set(parts) - {"params", "compute", "output"}
    if bad or any(v not in _DTYPES for v in parts.values()):
        raise ConfigError(paragraph(
            f"Cannot parse precision {text!r}. The explicit form is",
            "'params=float32,compute=bfloat16,output=float32' with keys params/compute/output",
            f"and dtypes from {sorted(set(_DTYPES))}.",
        ))
    param = _DTYPES[parts.get("params", "float32")]
    compute = _DTYPES[parts.get("compute", parts.get("params", "float32"))]
    output = _DTYPES[parts.get("output", "float32")]
    overrides = _F32_OVERRIDES if compute != jnp.float32 else {}
    return Policy(text, param, compute, output, overrides, loss_scaling=compute == jnp.float16)


def get_policy(name: str) -> Policy:
    """Returns the policy for a config string, or raises listing the valid names."""
    named = _named()
    if name in named:
        return named[name]
    if "=" in name:
        return _parse_explicit(name)
    raise ConfigError(paragraph(
        f"Unknown precision policy {name!r}. Valid names: {', '.join(POLICIES)}, or the",
        "explicit form 'params=float32,compute=bfloat16,output=float32'.",
    ))


@dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling for float16 compute, as small pure functions of `TrainState.extra`.

    float16 has a narrow exponent range: small gradients flush to zero in the backward pass. The
    loss is multiplied by a large scale before differentiation and the gradients divided by it
    afterwards (in float32). A non-finite gradient means the scale overflowed: the update is
    skipped and the scale halved; after `growth_interval` finite steps in a row it doubles. The
    state lives in `extra` ('loss_scale', 'good_steps', 'skipped_steps') so it is checkpointed,
    sharded (replicated scalars) and donated like the rest of the TrainState.
    """

    init_scale: float = 2.0 ** 15
    growth_interval: int = 2000
    factor: float = 2.0
    min_scale: float = 1.0

    def init(self) -> dict:
        return {"loss_scale": jnp.asarray(self.init_scale, jnp.float32),
                "good_steps": jnp.zeros((), jnp.int32),
                "skipped_steps": jnp.zeros((), jnp.int32)}

    @staticmethod
    def scale(extra: Mapping, loss: jax.Array) -> jax.Array:
        return loss * extra["loss_scale"].astype(loss.dtype)

    @staticmethod
    def unscale(extra: Mapping, tree: Any) -> Any:
        """Divides every leaf by the scale, in float32 (so no precision is lost on the way)."""
        inv = 1.0 / extra["loss_scale"]
        return jax.tree.map(lambda g: (g.astype(jnp.float32) * inv).astype(g.dtype), tree)

    def update(self, extra: Mapping, finite: jax.Array) -> dict:
        """The next scale state: x2 after `growth_interval` good steps, /2 on a bad one."""
        good = jnp.where(finite, extra["good_steps"] + 1, 0)
        grow = good >= self.growth_interval
        scale = jnp.where(finite, jnp.where(grow, extra["loss_scale"] * self.factor,
                                            extra["loss_scale"]),
                          jnp.maximum(extra["loss_scale"] / self.factor, self.min_scale))
        return {"loss_scale": scale.astype(jnp.float32),
                "good_steps": jnp.where(grow, 0, good).astype(jnp.int32),
                "skipped_steps": extra["skipped_steps"] + (~finite).astype(jnp.int32)}

    @classmethod
    def from_config(cls, loss_scale_cfg: Any) -> "DynamicLossScale":
        return cls(float(loss_scale_cfg.init), int(loss_scale_cfg.growth_interval))


def all_finite(tree: Any) -> jax.Array:
    """True when every floating leaf of `tree` is finite (one fused reduction)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)
