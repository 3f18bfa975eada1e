"""Gemma 3 (text) and Gemma 2: the Llama decoder with Gemma's switches on, not a copy.

Gemma 3's text decoder (`Gemma3ForCausalLM`, HF model_type `gemma3_text`) differs from the Llama
only where `LlamaConfig` has a switch: RMSNorms that scale by 1 + weight (`norm_offset`), a
second norm after attention and after the MLP (`post_norms`: four a block), embeddings scaled
by sqrt(embed) (`embed_scale`), GeGLU (`mlp_activation="gelu_tanh"`), Qwen3's per-head q/k
RMSNorm (`qk_norm`), scores scaled by 1/sqrt(`query_pre_attn_scalar`), tied embeddings, and a
local/global pattern (`layer_types`: sliding-window layers with their own rotary base
`rope_local_theta`, global layers with the full context and `rope_theta`). The pattern is
scanned with the layers as a per-layer flag (`llama.Block.per_layer`), so the stack stays one
scanned block. So the family is a model table line (`models/__init__.py`) whose config class
changes the switches' defaults; the module, task, FLOP counts (norms and the scale are no
matmuls) and sharding rules are the Llama's. Gemma 2 (`Gemma2ForCausalLM`) is the same without
the q/k norms, with one rotary base, and with tanh soft-capping of the attention scores and the
final logits (`attn_softcap`, `final_softcap`, read from its config.json; einsum or splash
attention).
Hugging Face import/export: `interop/hf_gemma.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxscale.models.decoder.config import LlamaConfig


@dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    """`model.name=gemma3` (Gemma 3 text): Gemma's norms, scale, GeGLU and qk-norm."""

    norm_offset: bool = True
    post_norms: bool = True
    embed_scale: bool = True
    mlp_activation: str = "gelu_tanh"
    qk_norm: bool = True


@dataclass(frozen=True)
class Gemma2Config(LlamaConfig):
    """`model.name=gemma2` (Gemma 2): Gemma's norms, scale and GeGLU, no qk-norm (its
    soft-caps and pattern come from config.json, as `config.model` fields)."""

    norm_offset: bool = True
    post_norms: bool = True
    embed_scale: bool = True
    mlp_activation: str = "gelu_tanh"
