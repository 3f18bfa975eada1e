"""The analytic FLOPs a compiled train step should contain, to check the compiled count against.

`model_flops` is the PaLM-convention training count (`metrics.llama_flops_per_token`: 6 per
matmul parameter per token plus 12·L·H·Q·T for attention), the number MFU is quoted in.
A rematerialised step does more: `recompute_flops` adds the forward pass the backward pass
redoes. Measured on libtpu's partitioned HLO (1B dims, v5p:2x2x2, fsdp=8), `remat=full`
(`nothing_saveable`) recomputes every matmul of a layer's forward except the last one, the
MLP's down projection, whose output is the layer's output and is not needed to differentiate
the layer (XLA drops it as dead code): q/k/v/o, gate/up, and both attention einsums. `dots`
saves every matmul output (no matmul recomputed); `dots_no_batch` saves those without batch
dimensions, i.e. all but the two attention einsums (QK^T and AV), which are recomputed.
`model.loss_chunks > 1` recomputes each chunk's logits (the head's forward matmul, 2·E·V per
token) in the backward pass. So compiled FLOPs = model + recompute, to within the matmuls
outside the model (none on these steps); a pipeline adds its bubble iterations on top (they
compute on padding).

With `model.attention=splash` the attention matmuls run inside Pallas kernels, custom calls
with no dot in the HLO to count: `kernel_flops` is what the compiled count then misses, the
attention part of model + recompute (counted as the einsum computes it; the kernel itself skips
the tiles a causal mask hides and recomputes QK^T in its backward pass, so its true count
differs), which the report adds and labels as analytic.
"""

from __future__ import annotations

import ml_collections as mlc


def model_flops(config: mlc.ConfigDict, num_chips: int) -> float | None:
    """Analytic model FLOPs per chip per step (PaLM convention), or None for non-Llama models."""
    from jaxscale.observe.metrics import llama_flops_per_token

    m, d = config.model, config.data
    if m.get("name", "llama") != "llama":
        return None
    per_token = llama_flops_per_token(m.num_layers, m.embed, m.num_heads, m.num_kv_heads,
                                      m.head_dim, m.mlp, m.vocab_size, d.seq_len)
    return per_token * d.batch_size * d.seq_len / num_chips


def recompute_flops_per_token(config: mlc.ConfigDict) -> float:
    """Matmul FLOPs per token that the backward pass recomputes under `model.remat` (and the
    head's, under `model.loss_chunks`)."""
    m, t = config.model, config.data.seq_len
    attention = 4.0 * m.num_heads * m.head_dim * t          # QK^T and AV, forward, per layer
    if m.remat == "full":
        projections = m.embed * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
        per_layer = 2.0 * (projections + 2 * m.embed * m.mlp) + attention  # all but w_down
    elif m.remat == "dots_no_batch":
        per_layer = attention
    else:  # 'none', 'dots': every matmul output is kept
        per_layer = 0.0
    head = 2.0 * m.embed * m.vocab_size if m.get("loss_chunks", 1) > 1 else 0.0
    return m.num_layers * per_layer + head


def _attention_flops_per_token(config: mlc.ConfigDict) -> float:
    """Attention matmul FLOPs per token of the step: the model count's 12·L·H·Q·T (forward and
    backward) plus the forward QK^T and AV again where remat recomputes them."""
    m, t = config.model, config.data.seq_len
    recomputed = m.remat in ("full", "dots_no_batch")
    return (12.0 + 4.0 * recomputed) * m.num_layers * m.num_heads * m.head_dim * t


def kernel_flops(config: mlc.ConfigDict, num_chips: int) -> float:
    """Attention FLOPs per chip per step done inside Pallas kernels (`model.attention=splash`
    where the kernel applies), invisible to the HLO dot count; 0 otherwise."""
    from jaxscale.models.splash import block_size

    m, d = config.model, config.data
    if (m.get("name", "llama") != "llama" or m.get("attention", "einsum") != "splash"
            or block_size(d.seq_len) is None):
        return 0.0
    return _attention_flops_per_token(config) * d.batch_size * d.seq_len / num_chips


def expected_flops(config: mlc.ConfigDict, num_chips: int) -> float | None:
    """Model FLOPs plus the remat recompute, per chip per step: what the compiled step holds."""
    base = model_flops(config, num_chips)
    if base is None:
        return None
    d = config.data
    return base + recompute_flops_per_token(config) * d.batch_size * d.seq_len / num_chips
