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
(their widths: the attention component's, `Dims.attention_widths`, and the MLP's gate/up; those
it offloads live in host memory, `host_bytes`); jax's dot policies and none are counted as
keeping all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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
    # {activation name: elements per token and layer} of what the attention names (its
    # component's `activation_widths`: grouped-query's q/k/v, attention output, out projection).
    attention_widths: Mapping[str, int] = field(default_factory=dict)
    # Parameters of the routed MoE experts (part of num_params): sharded over `expert` as well
    # as fsdp and tensor, and only a chip's own experts are gathered (0 for a dense model).
    expert_params: int = 0

    @classmethod
    def from_model(cls, model: Mapping, num_params: int) -> Dims | None:
        """From a `config.model` section's transformer widths (`embed`, `mlp`, `num_heads`,
        `num_layers`, `vocab_size`) and its attention component's widths (asked of the model
        table); None for a model that lacks one of them."""
        from jaxscale.models import entry_of  # lazy: this module stays free of jax

        keys = ("num_layers", "embed", "mlp", "num_heads", "vocab_size")
        attention = entry_of(model).attention
        if attention is None or not all(k in model for k in keys):
            return None
        return cls(num_params, *(int(model[k]) for k in keys),
                   attention_widths=attention(model).activation_widths(),
                   expert_params=_expert_params(model))

    def local_params(self, expert: int = 1) -> float:
        """Parameters a chip holds a shard of, or gathers, with the experts split over
        `expert` chips: all but the routed experts, and 1/expert of those."""
        return self.num_params - self.expert_params + self.expert_params / expert

    def width(self, name: str) -> int:
        """Elements per token and layer of the activation `name` (`models/nn/scan.py`
        ACTIVATION_NAMES): the MLP's gate/up, or the attention's; 0 for one nothing names."""
        if name == "mlp_gate_up":
            return 2 * self.mlp
        return self.attention_widths.get(name, 0)


def _expert_params(model: Mapping) -> int:
    """The routed experts' parameters (weights and biases) of a `config.model` section, over
    the layers that have them (`sparse_layers`: not DeepSeek's dense first ones)."""
    from jaxscale.models.moe.config import MoEConfig, expert_width, sparse_layers  # lazy: jax

    moe = MoEConfig.from_config(model.get("moe"))
    if not moe.num_experts:
        return 0
    f, e = expert_width(moe, int(model["mlp"])), int(model["embed"])
    per_expert = 3 * e * f + moe.expert_bias * (2 * f + e)
    return sparse_layers(moe, int(model["num_layers"])) * moe.num_experts * per_expert


def _named(remat: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(saved, offloaded) names of a policy named by what it keeps, else None."""
    from jaxscale.models.nn.scan import NAMED_POLICIES  # lazy: this module stays free of jax

    named = NAMED_POLICIES.get(remat)
    return None if named is None else (named.saved, named.offloaded)


def named_bytes_per_token(dims: Dims, names: tuple[str, ...], tensor: int = 1) -> float:
    """Bytes per token of one layer's `names` activations (bf16, split over `tensor`)."""
    return sum(dims.width(n) for n in names) * BF16 / tensor


def host_bytes(dims: Dims, *, tokens: float, remat: str, tensor: int = 1) -> float:
    """Pinned host bytes per device that `remat` offloads: its offloaded activations, every
    layer's, for `tokens` tokens (0 for a policy that offloads nothing)."""
    named = _named(remat)
    if named is None:
        return 0.0
    return tokens * dims.num_layers * named_bytes_per_token(dims, named[1], tensor)


def step_bytes(dims: Dims, *, tokens: float, seq_len: int, state_bytes: float,
               param_shards: int, tensor: int = 1, remat: str = "none",
               einsum_scores: bool = False, loss_chunks: int = 1, expert: int = 1) -> float:
    """Estimated peak bytes per device of a train step over `tokens` tokens at once (a micro-
    batch), `state_bytes` per parameter (`state_bytes_per_param`), parameters sharded over
    `param_shards` x `tensor` devices (the routed experts over `expert` as well), activations
    over `tensor`."""
    d = dims
    local = d.local_params(expert)
    state = local * state_bytes / (param_shards * tensor)
    gathered = 2 * BF16 * local / d.num_layers / tensor if param_shards > 1 else 0.0
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
