"""Qwen2 / Qwen2.5 and Qwen3 (dense): the Llama decoder with its switches on, not a copy.

Qwen2 and Qwen2.5 add a bias to the q/k/v projections (`qkv_bias`, stored fused like `wqkv`);
Qwen3 drops it and RMS-normalises every query and key head before rotary (`qk_norm`), with a
`head_dim` that need not be embed / heads (the Llama's `head_dim` is already explicit). Both
otherwise are Llamas: SwiGLU, RMSNorm, "rotate half" rotary (a large `rope_theta`), tied or
untied embeddings. So each is a model table line (`models/__init__.py`) whose config class only
changes the defaults of the switches: `model.name=qwen3` builds qk-norm without further flags.
The same module, task, FLOP counts (biases and norms are no matmuls) and sharding rules serve
all three; Hugging Face import/export is `interop/hf_qwen.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxscale.models.decoder.config import LlamaConfig


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """`model.name=qwen2` (Qwen2 and Qwen2.5): q/k/v projections with a bias."""

    qkv_bias: bool = True


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """`model.name=qwen3` (Qwen3 dense): per-head RMSNorm of q and k before rotary."""

    qk_norm: bool = True
