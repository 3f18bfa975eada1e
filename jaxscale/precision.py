"""Precision policies: one declarative object says which dtype is used where.

Built from one config string, Fabric-style names (`32-true`, `bf16-mixed`, `bf16-true`,
`16-mixed`, and `int8`: bf16-mixed with int8 weight matmuls, `models/adapters/int8.py`) or the explicit form `params=float32,compute=bfloat16,output=float32`, optionally
with per-module overrides: `params=float32,compute=bfloat16,norm=float32,softmax=float32,
logits=bfloat16`. The model consults the policy at well-named points (`param`, `compute`, and
`dtype_for(module)` for the modules in `MODULES`), never through scattered `astype` calls.

`output` is the dtype of the loss and of every reduction over it (cross entropy, gradient norms,
loss scaling); it is float32 in every policy and the explicit form rejects anything else, because
a bfloat16 loss loses the small differences between steps that training follows. Lower-precision
*logits* (the vocabulary-sized activation) are what saves memory: ask for them with the `logits`
override, after a named policy too (`bf16-mixed,logits=bfloat16`); the loss still reduces them
in float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale.errors import ConfigError, JaxscaleError, paragraph

_DTYPES = {
    "float32": jnp.float32, "fp32": jnp.float32, "f32": jnp.float32, "32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16, "f16": jnp.float16, "16": jnp.float16,
}
# Module kinds a policy can override, and where the models read them (`Policy.dtype_for`).
MODULES: dict[str, str] = {
    "norm": "RMSNorm / LayerNorm statistics and scaling (their output is cast to compute)",
    "softmax": "attention scores and softmax (model.attention='einsum'; the fused kernel "
               "chooses its own)",
    "logits": "final norm output and LM / classifier head matmul, i.e. the logits dtype",
}
# Modules kept in float32 under every mixed policy: numerically sensitive reductions.
_F32_OVERRIDES = {"norm": jnp.float32, "softmax": jnp.float32, "logits": jnp.float32}
_EXPLICIT_KEYS = ("params", "compute", "output")


@dataclass(frozen=True)
class Policy:
    """Dtypes for parameters (storage), compute (matmuls), output (loss), plus overrides."""

    name: str
    param: Any = jnp.float32
    compute: Any = jnp.float32
    output: Any = jnp.float32
    overrides: Mapping[str, Any] = field(default_factory=dict)
    loss_scaling: bool = False
    # Quantized matmuls: None, or the integer type ("int8") the projection matmuls run in,
    # forward and backward, applied to the model by `models/adapters/int8.py` (the model never
    # asks).
    quantized: str | None = None

    def dtype_for(self, module: str) -> Any:
        """Compute dtype for a named module kind (`norm`, `softmax`, `logits`)."""
        return self.overrides.get(module, self.compute)


def _named() -> dict[str, Policy]:
    return {
        "32-true": Policy("32-true"),
        "bf16-mixed": Policy("bf16-mixed", jnp.float32, jnp.bfloat16, jnp.float32, _F32_OVERRIDES),
        "bf16-true": Policy("bf16-true", jnp.bfloat16, jnp.bfloat16, jnp.float32,
                            {"softmax": jnp.float32, "logits": jnp.float32}),
        "16-mixed": Policy("16-mixed", jnp.float32, jnp.float16, jnp.float32, _F32_OVERRIDES,
                           loss_scaling=True),
        # bf16-mixed, with every projection matmul (attention q/k/v/o, MLP) in int8 both ways.
        "int8": Policy("int8", jnp.float32, jnp.bfloat16, jnp.float32, _F32_OVERRIDES,
                       quantized="int8"),
    }


POLICIES = tuple(_named())
EXPLICIT_HELP = paragraph(
    "The explicit form is comma-separated key=dtype pairs, e.g.",
    "'params=float32,compute=bfloat16,output=float32,norm=float32,softmax=float32,logits=bfloat16',",
    f"with keys {', '.join(_EXPLICIT_KEYS + tuple(MODULES))} and dtypes",
    f"{', '.join(sorted(_DTYPES))}. Omitted: compute = params, output = float32, and norm /",
    "softmax / logits in float32 when compute is not float32.",
)


def _explicit_error(text: str, problem: str) -> ConfigError:
    return ConfigError(paragraph(f"Cannot parse precision {text!r}: {problem}.", EXPLICIT_HELP))


def _explicit_pairs(text: str) -> dict[str, Any]:
    """{'params': jnp.float32, ...} from 'params=float32,...', with one clear error per problem."""
    parts: dict[str, Any] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep:
            raise _explicit_error(text, f"{item!r} is not a key=dtype pair")
        if key not in _EXPLICIT_KEYS and key not in MODULES:
            raise _explicit_error(text, f"unknown key {key!r}")
        if key in parts:
            raise _explicit_error(text, f"{key!r} is given twice")
        if value not in _DTYPES:
            raise _explicit_error(text, f"unknown dtype {value!r} for {key!r}")
        parts[key] = _DTYPES[value]
    return parts


def _parse_explicit(text: str) -> Policy:
    parts = _explicit_pairs(text)
    if parts.get("output", jnp.float32) != jnp.float32:
        raise ConfigError(paragraph(
            f"precision {text!r}: output={jnp.dtype(parts['output']).name} is not supported. The",
            "loss and its reductions are always float32 (a low-precision loss rounds away the",
            "small step-to-step changes training follows). To keep the vocabulary-sized logits",
            "in a low precision instead, use the override logits=bfloat16 (the loss still reduces",
            "them in float32)."))
    param = parts.get("params", jnp.float32)
    compute = parts.get("compute", param)
    overrides = dict(_F32_OVERRIDES) if compute != jnp.float32 else {}
    overrides.update({k: v for k, v in parts.items() if k in MODULES})
    half = jnp.dtype(jnp.float16) in {jnp.dtype(compute), *map(jnp.dtype, overrides.values())}
    return Policy(text, param, compute, jnp.float32, overrides, loss_scaling=half)


def _with_overrides(base: Policy, name: str, text: str) -> Policy:
    """A named policy with per-module overrides, e.g. 'bf16-mixed,logits=bfloat16': the
    logits (the head's matmul output, the largest activation at a big vocabulary) stored in
    bfloat16, while the loss still reduces them in float32 (`lm_task.token_losses`)."""
    parts = _explicit_pairs(text)
    if not parts or set(parts) - set(MODULES):
        raise _explicit_error(name, "after a named policy only the per-module overrides "
                              f"{', '.join(MODULES)} may follow")
    half = jnp.dtype(jnp.float16) in set(map(jnp.dtype, parts.values()))
    return dataclasses.replace(base, name=name, overrides={**base.overrides, **parts},
                               loss_scaling=base.loss_scaling or half)


def get_policy(name: str) -> Policy:
    """Returns the policy for a config string, or raises listing the valid names."""
    named = _named()
    if name in named:
        return named[name]
    base, _, rest = name.partition(",")
    if base in named and rest:
        return _with_overrides(named[base], name, rest)
    if "=" in name:
        return _parse_explicit(name)
    raise ConfigError(paragraph(
        f"Unknown precision policy {name!r}. Valid names: {', '.join(POLICIES)} (each may be",
        "followed by per-module overrides, e.g. 'bf16-mixed,logits=bfloat16'), or the",
        "explicit form 'params=float32,compute=bfloat16,output=float32' (with optional",
        f"per-module overrides {', '.join(f'{m}=DTYPE' for m in MODULES)}).",
    ))


class LossScaleError(JaxscaleError):
    """float16 training is stuck: every update overflows even at the minimum loss scale."""


@dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling for float16 compute, as small pure functions of `TrainState.extra`.

    float16 has a narrow exponent range: small gradients flush to zero in the backward pass. The
    loss is multiplied by a large scale before differentiation and the gradients divided by it
    afterwards (in float32). A non-finite gradient means the scale overflowed: the update is
    skipped and the scale halved; after `growth_interval` finite steps in a row it doubles. The
    state lives in `extra` ('loss_scale', 'good_steps', 'skipped_steps', 'skips_at_min') so it is
    checkpointed, sharded (replicated scalars) and donated like the rest of the TrainState.

    When the gradients overflow even at `min_scale`, halving cannot help and every step would be
    skipped silently forever: `skips_at_min` counts such consecutive steps and `check` (called
    by the loop whenever it syncs with the device) raises after `max_skips_at_min` of them.
    """

    init_scale: float = 2.0 ** 15
    growth_interval: int = 2000
    factor: float = 2.0
    min_scale: float = 1.0
    max_skips_at_min: int = 20  # 0: never raise

    def init(self) -> dict:
        return {"loss_scale": jnp.asarray(self.init_scale, jnp.float32),
                "good_steps": jnp.zeros((), jnp.int32),
                "skipped_steps": jnp.zeros((), jnp.int32),
                "skips_at_min": jnp.zeros((), jnp.int32)}

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
        old = extra["loss_scale"]
        scale = jnp.where(finite, jnp.where(grow, old * self.factor, old),
                          jnp.maximum(old / self.factor, self.min_scale))
        at_min = jnp.where(finite, 0, extra["skips_at_min"] + (old <= self.min_scale))
        return {"loss_scale": scale.astype(jnp.float32),
                "good_steps": jnp.where(grow, 0, good).astype(jnp.int32),
                "skipped_steps": extra["skipped_steps"] + (~finite).astype(jnp.int32),
                "skips_at_min": at_min.astype(jnp.int32)}

    def check(self, extra: Mapping) -> None:
        """Raises LossScaleError when the last `max_skips_at_min` steps all overflowed at the
        minimum scale (host-side: reads one scalar, so call it where the loop syncs anyway)."""
        stuck = int(jax.device_get(extra["skips_at_min"]))
        if self.max_skips_at_min and stuck >= self.max_skips_at_min:
            raise LossScaleError(paragraph(
                f"16-mixed: the last {stuck} updates were all skipped because the gradients",
                f"overflow float16 even at the minimum loss scale {self.min_scale:g}",
                "(config.loss_scale.min_scale), so training makes no progress. Use",
                "--config.precision=bf16-mixed (float32's exponent range), lower optim.lr, or",
                "look for infinities in the data or model; config.loss_scale.max_skips_at_min",
                f"(now {self.max_skips_at_min}; 0 disables this check) sets the patience."))

    @classmethod
    def from_config(cls, loss_scale_cfg: Any) -> "DynamicLossScale":
        c = loss_scale_cfg
        return cls(float(c.init), int(c.growth_interval), min_scale=float(c.get("min_scale", 1.0)),
                   max_skips_at_min=int(c.get("max_skips_at_min", 20)))

def check_quantized(precision: str, model_cfg: Mapping[str, Any], lora_cfg: Mapping[str, Any]
                 ) -> None:
    """One-paragraph ConfigErrors for what a quantized policy cannot train (`config.validate`)."""
    policy = get_policy(precision)
    if policy.quantized is None:
        return
    if lora_cfg.get("rank", 0):
        raise ConfigError(paragraph(
            f"precision={precision!r} with lora.rank={lora_cfg['rank']}: quantized training is",
            "not combined with LoRA adapters (the adapters' small update would be folded into a",
            "weight that is then rounded to int8 per channel, and the dropout path's adapter",
            "matmuls are not projections). Fine-tune the adapters with --config.precision=",
            "bf16-mixed, or train all weights in int8 with --config.lora.rank=0."))
    moe = model_cfg.get("moe") or {}
    if moe.get("num_experts", 0):
        raise ConfigError(paragraph(
            f"precision={precision!r} with model.moe.num_experts={moe['num_experts']}: the",
            "experts' grouped matmuls (models/moe/layer.py) are not projections the int8 policy",
            "quantizes, so most of the model's FLOPs would stay bfloat16 while the run claims",
            "int8. Use --config.precision=bf16-mixed for mixture-of-experts models, or a dense",
            "model (model.moe.num_experts=0) for int8."))
