"""A rough, analytic guess of a Llama step's bytes per chip, used only to order the planner.

Why: the planner compiles candidates likeliest-winner first under a budget. Without remat a
step does no recompute (a full-remat step does about 1.24x the model's FLOPs), so where it
fits it wins; but for large models it needs several times the HBM (7B at 16 sequences a chip:
about 180 GB of saved activations), and trying it first would spend the budget on refusals.
This guess decides which to try first. It is never reported and never decides a fit: the
compiler does (`aot.compile`). Its counts alone fell short of libtpu 0.0.52's totals by 1.27x
to 1.58x: 1B at 4 sequences of 2,048 a chip on v5p-16, 20.0 / 18.0 / 17.0 against 25.4 / 23.3 /
22.6 GiB (data=4 fsdp=4, data=2 fsdp=8, fsdp=16); 7B at 4 a chip on v5p-32, 47.6 against 68.4;
7B at 1 a chip on v5e-64, 12.7 against at least 20.1 (refused: 18.9 GiB of temporaries and 1.2
of arguments). So they are scaled by `CALIBRATION`, which tells these apart.
"""

from __future__ import annotations

import ml_collections as mlc

STATE_BYTES = 16  # per parameter: f32 weights, two f32 Adam moments, an f32 gradient
ACT_BYTES = 2     # bf16 activations
F32 = 4
CALIBRATION = 1.5  # libtpu's compiled total / the counts below, 1.27-1.58 where measured


def no_remat_bytes(config: mlc.ConfigDict, mesh: dict[str, int], accum: int, attention: str,
                   loss_chunks: int) -> float | None:
    """Guessed bytes per chip of `config`'s step without remat on `mesh` (sizes by axis, data
    including slices) with `accum` micro-batches, `attention` and `loss_chunks`, or None where
    there is no guess (not a Llama, or pipeline stages, whose schedules hold activations
    differently)."""
    from jaxscale.models.llama import LlamaConfig

    if config.model.get("name", "llama") != "llama" or mesh.get("pipeline", 1) > 1:
        return None
    m = LlamaConfig.from_config(config.model)
    tensor, seq = mesh.get("tensor", 1), config.data.seq_len
    tokens = config.data.batch_size / (mesh["data"] * mesh["fsdp"] * accum) * seq
    state = m.num_params() * STATE_BYTES / (mesh["fsdp"] * tensor)
    # Saved per token and layer: about ten embed-wide and four mlp-wide bf16 tensors (norms,
    # projections, residuals; SwiGLU's gate, up and product), split over `tensor`.
    layer = (10 * m.embed + 4 * m.mlp) * ACT_BYTES / tensor
    if attention == "einsum":  # float32 scores and probabilities of every head
        layer += 2 * m.num_heads * seq * F32 / tensor
    logits = 3 * m.vocab_size * F32 / tensor / loss_chunks  # logits, softmax, gradient
    return CALIBRATION * (state + tokens * (m.num_layers * layer + logits))
