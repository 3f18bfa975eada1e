"""Quantized training (`config.precision=int8`): the projection matmuls in int8, forward and
backward, through qwix (a maintained JAX quantization library), never kernels of our own.

What is quantized: every matmul with a weight operand inside the modules that read linear
weights through `layers.project` (those listing `LORA_WEIGHTS`: the Llama family's attention
q/k/v/o and MLP, the ViT's attention and MLP). qwix's quantized-training provider (`QtProvider`,
rule `QtRule(weight_qtype=act_qtype=bwd_qtype=int8)`) rewrites each such `einsum` while the
module runs: the activation and the weight are quantized with per-channel absmax scales (one
scale per row of the activation and per output column of the weight), multiplied in int8 with
int32 accumulation and rescaled; in the backward pass the incoming gradient is quantized the
same way (per channel) for both the input and the weight gradient, against the int8 residuals of
the forward pass. Float32 master weights and optimizer state stay as they are (the quantization
is redone from them every step), so checkpoints are those of `bf16-mixed`.

What is not: the matmuls without a weight operand (attention's QK^T and PV), the embedding
lookup, the LM / classifier head and the ViT patch embedding run as `bf16-mixed` runs them
(bfloat16 compute; norms, softmax and logits float32, `precision._F32_OVERRIDES`). Mixture-of-
experts layers, whose grouped matmuls are not projections, and LoRA adapters are refused by
`precision.check_quantized` rather than left silently unquantized.

The model classes know nothing of this: `ModelDef.build` passes each freshly built model through
`quantize`, which swaps the projection modules for qwix's intercepted subclasses (static graph
structure only: the parameters, their names, shapes and shardings are unchanged).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from qwix._src.utils.flax_util import find_param  # qwix's own weight test (pinned <0.2)

from jaxscale.precision import Policy

QTYPES: dict[str, Any] = {"int8": jnp.int8}


class WeightMatmuls(qwix.QtProvider):
    """qwix's quantized-training provider, narrowed to matmuls that have a weight operand.

    A module's attention kernel runs inside the same module as its projections, so a rule by
    module path cannot tell them apart; qwix's own `find_param` (the operand traced back to a
    parameter of the running module) can. QK^T and PV stay in the compute dtype."""

    def dot_general(self, lhs: jax.Array, rhs: jax.Array, *args: Any, **kwargs: Any):
        if _has_weight(lhs, rhs):
            return super().dot_general(lhs, rhs, *args, **kwargs)
        return jax.lax.dot_general(lhs, rhs, *args, **kwargs)

    def einsum(self, eq: str, *operands: jax.Array, **kwargs: Any):
        if len(operands) == 2 and _has_weight(*operands):
            return super().einsum(eq, *operands, **kwargs)
        return jnp.einsum(eq, *operands, **kwargs)


def _has_weight(lhs: jax.Array, rhs: jax.Array) -> bool:
    return find_param(lhs) is not None or find_param(rhs) is not None


def provider(qtype: str) -> WeightMatmuls:
    """Per-channel `qtype` for activations, weights and gradients (forward and backward)."""
    t = QTYPES[qtype]
    return WeightMatmuls([qwix.QtRule(module_path=".*", weight_qtype=t, act_qtype=t,
                                      bwd_qtype=t)])


def is_projection_module(module: nnx.Module) -> bool:
    """Whether `module` reads linear weights through `layers.project` (`LORA_WEIGHTS`, unless
    it says `PROJECTED = False`: a mixture of experts reads its adapted weights whole)."""
    kind = type(module)
    return bool(getattr(kind, "LORA_WEIGHTS", ())) and getattr(kind, "PROJECTED", True)


def _child(parent: Any, key: Any) -> Any:
    return parent[key] if isinstance(key, int) else getattr(parent, key)


def quantize(model: nnx.Module, policy: Policy) -> nnx.Module:
    """`model` with its projection modules' weight matmuls in `policy.quantized` (in place);
    `model` itself when the policy quantizes nothing. Only the graph's static structure changes
    (the projection modules' classes), never a parameter."""
    if policy.quantized is None:
        return model
    qt = provider(policy.quantized)
    for path, module in list(nnx.iter_modules(model)):
        if not path or not is_projection_module(module):
            continue
        parent = model
        for key in path[:-1]:
            parent = _child(parent, key)
        quantized = qwix.quantize_model(module, qt, skip_nnx_init=True)
        if isinstance(path[-1], int):
            parent[path[-1]] = quantized
        else:
            setattr(parent, path[-1], quantized)
    return model
