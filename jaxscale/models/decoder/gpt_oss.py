"""GPT-OSS (OpenAI's gpt-oss-20b / 120b): the Llama decoder with its switches on, not a copy.

Its attention is grouped-query with biases on q/k/v and on the output (`qkv_bias`, `out_bias`)
and a learned logit per head in each softmax denominator (`attn_sinks`: a head may attend to
nothing, which matters most in its 128-token sliding-window layers), alternating sliding-window
and full layers (`layer_types`, the local/global pattern Gemma brought), and YaRN rotary
(`models/nn/rope.py`). Every layer is a mixture of experts (`model.moe`): a biased router whose
top-k logits are softmaxed (`router=topk_softmax`), experts with biases and the clamped SwiGLU
(`swiglu_limit`). So it is a model table line whose config class changes the attention
switches' defaults; the MoE fields are `model.moe`'s, set by the Hugging Face import
(`interop/hf_gpt_oss.py`) and the presets.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxscale.models.decoder.config import LlamaConfig


@dataclass(frozen=True)
class GptOssConfig(LlamaConfig):
    """`model.name=gpt_oss`: q/k/v and output biases, attention sinks."""

    qkv_bias: bool = True
    out_bias: bool = True
    attn_sinks: bool = True
