"""The one analytic model of a training step's bytes per device, for where nothing is compiled.

Two callers, neither a verdict on a TPU (there the compiler's accounting decides, `aot.compile`):
the GPU presets of `configs/llama.py` size their micro-batch with it, and the planner's guess
(`aot.guess`) orders its candidates with it. One model, so that the two cannot disagree about
what a parameter or a token costs.

Per device: the training state over the parameter shards, one layer's bf16 weights gathered
(and the next prefetched) when they are sharded, and activations per token. Per token and
layer about ten embed-wide and four mlp-wide bf16 tensors are saved (norms, projections,
residuals; SwiGLU's gate, up and product) plus, with einsum attention, the float32 scores and
probabilities of every head; the LM head keeps float32 logits, softmax and gradient (a chunk of
them with `loss_chunks`). Full remat keeps only each layer's bf16 input and recomputes one layer
at a time (two layers' activations live at once); a policy named by what it saves
(`models/nn/scan.py` NAMED_POLICIES) keeps that input plus the named activations it saves in HBM
(`NAME_WIDTHS`; those it offloads live in host memory, `host_bytes`); jax's dot policies and
none are counted as keeping all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

F32, BF16 = 4, 2
ADAM_MOMENTS = 2  # the optimizer state counted: Adam's two float32 moments


def state_bytes_per_param(param_bytes: int = F32, compute_bytes: int = BF16,
                          accumulate: bool = True, moments: int = ADAM_MOMENTS) -> int:
    """Training state per parameter: the weights, `moments` optimizer moments and the gradient
    in the parameter dtype, a gradient accumulator when micro-batches are accumulated, and a
    copy in the compute dtype where it differs (mixed precision). f32 weights, Adam, bf16
    compute, accumulating: 4 x (1 + 2 + 1 + 1) + 2 = 22 bytes."""
    copy = compute_bytes if compute_bytes != param_bytes else 0
    return param_bytes * (2 + moments + int(accumulate)) + copy


@dataclass(frozen=True)
class Dims:
    """What the model contributes: its parameter count and the widths activations are saved at."""

    num_params: int
    num_layers: int
    embed: int
    mlp: int
    num_heads: int
    vocab_size: int
    num_kv_heads: int = 0  # 0: as many as heads (no grouped-query attention)
    head_dim: int = 0      # 0: embed / heads

    @classmethod
    def from_model(cls, model: Mapping, num_params: int) -> Dims | None:
        """From a `config.model` section's transformer widths (`embed`, `mlp`, `num_heads`,
        `num_layers`, `vocab_size`, and `num_kv_heads` / `head_dim` where it has them); None
        for a model that lacks one of the first five."""
        keys = ("num_layers", "embed", "mlp", "num_heads", "vocab_size")
        if not all(k in model for k in keys):
            return None
        return cls(num_params, *(int(model[k]) for k in keys),
                   num_kv_heads=int(model.get("num_kv_heads", 0)),
                   head_dim=int(model.get("head_dim", 0)))


# Elements per token and layer of each named activation (`models/nn/scan.py` ACTIVATION_NAMES).
NAME_WIDTHS = {
    "qkv_proj": lambda d: (d.num_heads + 2 * _kv(d)) * _head_dim(d),
    "attn_out": lambda d: d.num_heads * _head_dim(d),
    "out_proj": lambda d: d.embed,
    "mlp_gate_up": lambda d: 2 * d.mlp,
}


def _kv(d: Dims) -> int:
    return d.num_kv_heads or d.num_heads


def _head_dim(d: Dims) -> int:
    return d.head_dim or d.embed // d.num_heads


def _named(remat: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(saved, offloaded) names of a policy named by what it keeps, else None."""
    from jaxscale.models.nn.scan import NAMED_POLICIES  # lazy: this module stays free of jax

    named = NAMED_POLICIES.get(remat)
    return None if named is None else (named.saved, named.offloaded)


def named_bytes_per_token(dims: Dims, names: tuple[str, ...], tensor: int = 1) -> float:
    """Bytes per token of one layer's `names` activations (bf16, split over `tensor`)."""
    return sum(NAME_WIDTHS[n](dims) for n in names) * BF16 / tensor


def host_bytes(dims: Dims, *, tokens: float, remat: str, tensor: int = 1) -> float:
    """Pinned host bytes per device that `remat` offloads: its offloaded activations, every
    layer's, for `tokens` tokens (0 for a policy that offloads nothing)."""
    named = _named(remat)
    if named is None:
        return 0.0
    return tokens * dims.num_layers * named_bytes_per_token(dims, named[1], tensor)


def step_bytes(dims: Dims, *, tokens: float, seq_len: int, state_bytes: float,
               param_shards: int, tensor: int = 1, remat: str = "none",
               einsum_scores: bool = False, loss_chunks: int = 1) -> float:
    """Estimated peak bytes per device of a train step over `tokens` tokens at once (a micro-
    batch), `state_bytes` per parameter (`state_bytes_per_param`), parameters sharded over
    `param_shards` x `tensor` devices, activations over `tensor`."""
    d = dims
    state = d.num_params * state_bytes / (param_shards * tensor)
    gathered = 2 * BF16 * d.num_params / d.num_layers / tensor if param_shards > 1 else 0.0
    layer = (10 * d.embed + 4 * d.mlp) * BF16 / tensor
    if einsum_scores:
        layer += 2 * d.num_heads * seq_len * F32 / tensor
    logits = 3 * d.vocab_size * F32 / tensor / loss_chunks
    named = _named(remat)
    if remat == "full" or named is not None:
        kept = 0.0 if named is None else named_bytes_per_token(d, named[0], tensor)
        per_token = d.num_layers * (d.embed * BF16 + kept) + 2 * layer + logits
    else:
        per_token = d.num_layers * layer + logits
    return state + gathered + tokens * per_token
