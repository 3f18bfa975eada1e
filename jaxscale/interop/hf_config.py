"""Hugging Face `config.json` <-> jaxscale `config.model` for the Llama decoder, which every
decoder family (Mistral, Qwen, Gemma, the MoE families) converts through: the sizes, the
activation and the rotary read by `decoder_fields`, and Llama's own checks and export.

A family module (`hf_qwen.py`, `hf_gemma.py`, ...) adds its switches' fields to these and its
tensors to `hf.llama_leaves`; what the decoder cannot reproduce is refused in one paragraph
naming the field, never approximated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxscale.errors import paragraph
from jaxscale.interop.hf_rope import rope_from_hf, rope_scaling_to_hf
from jaxscale.interop.safetensors_io import ConversionError

LLAMA_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")


def require_keys(hf: Mapping[str, Any], keys: tuple[str, ...], where: str, family: str) -> None:
    """Names every field the conversion cannot do without (a KeyError would name only one)."""
    missing = [k for k in keys if hf.get(k) is None]
    if missing:
        raise ConversionError(paragraph(
            f"{where} lacks the field(s) {', '.join(missing)}, which a {family} conversion needs",
            f"(it reads {', '.join(keys)}). The file is truncated or not a {family} config:",
            "re-save the model with `save_pretrained`, or add the missing values.",
        ))


_REJECTED = {
    "attention_bias": "attention projections with biases",
    "mlp_bias": "MLP projections with biases",
}


def llama_config_from_hf(hf: Mapping[str, Any], where: str = "config.json",
                         name: str = "llama") -> dict:
    """HF `LlamaConfig` fields -> jaxscale `config.model` fields (raises on what we lack);
    `name` is the opener's signature (`hf.decoder_opener`): only 'llama' reads this."""
    if hf.get("model_type", "llama") != "llama":
        raise ConversionError(paragraph(
            f"{where}: model_type={hf.get('model_type')!r}; only 'llama' checkpoints are",
            "supported by load_llama (use load_vit for ViT image classifiers).",
        ))
    for key, what in _REJECTED.items():
        if hf.get(key):
            raise ConversionError(paragraph(
                f"{where}: {key}=True ({what}) is not supported: jaxscale's Llama has no bias",
                "parameters, and dropping them would silently change the model. Convert a",
                f"checkpoint with {key}=false.",
            ))
    if hf.get("sliding_window") not in (None, 0):
        raise ConversionError(paragraph(
            f"{where}: sliding_window={hf['sliding_window']} (local attention) is not supported:",
            "jaxscale's Llama attends to the full context, so the converted model would compute",
            "different logits. Convert a checkpoint with sliding_window=null.",
        ))
    return decoder_fields(hf, where, "llama")


def decoder_fields(hf: Mapping[str, Any], where: str, name: str) -> dict:
    """The `config.model` fields of a Llama-decoder family's HF config (`name`: its
    `model.name`; `hf_qwen.py` reuses it): the activation and rope checked, the sizes read."""
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConversionError(f"{where}: hidden_act={act!r} is not supported; jaxscale's Llama "
                              "MLP is SwiGLU (silu). Convert a checkpoint with hidden_act='silu'.")
    rope_fields = rope_from_hf(hf, where)
    require_keys(hf, LLAMA_REQUIRED, where, name.capitalize())
    heads = int(hf["num_attention_heads"])
    return dict(
        name=name,
        vocab_size=int(hf["vocab_size"]),
        embed=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        mlp=int(hf["intermediate_size"]),
        max_len=int(hf.get("max_position_embeddings", 2048)),
        **rope_fields,  # rope_theta, rope_scaling and the scaling's parameters
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def llama_config_to_hf(model_cfg: Mapping[str, Any], dtype: str = "float32") -> dict:
    """jaxscale `config.model` -> a `config.json` that `LlamaForCausalLM` loads.

    The rope scaling goes into both `rope_parameters` (transformers >= 5) and `rope_scaling`
    (older releases), so either reads back the frequencies the model was converted with."""
    m = dict(model_cfg)
    if m.get("sliding_window"):
        raise ConversionError(paragraph(
            f"model.sliding_window={m['sliding_window']}: a Hugging Face Llama attends to the",
            "full context, so the exported model would compute different logits. Export it as",
            "a Mistral (model.name=mistral writes MistralForCausalLM with its sliding_window).",
        ))
    switched = [k for k in ("qkv_bias", "qk_norm", "out_bias", "attn_sinks") if m.get(k)]
    if switched:
        raise ConversionError(paragraph(
            f"model.{switched[0]}=True has no place in a Hugging Face Llama (its tensors would be",
            "dropped): export the model as the family that has it, model.name=qwen2 (qkv_bias),",
            "qwen3 (qk_norm) or gpt_oss (out_bias, attn_sinks)."))
    experts = dict(m.get("moe") or {}).get("num_experts", 0)
    if experts:
        raise ConversionError(paragraph(
            f"model.moe.num_experts={experts}: a mixture-of-experts model has no Llama layout",
            "(its experts would be dropped). Export it as a Hugging Face MoE family:",
            "model.name=mixtral (Mistral's attention) or qwen3_moe (Qwen3's, with q/k norms)."))
    scaling = rope_scaling_to_hf(m)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m["vocab_size"], "hidden_size": m["embed"],
        "intermediate_size": m["mlp"], "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"],
        "head_dim": m["head_dim"], "max_position_embeddings": m["max_len"],
        "rope_theta": m["rope_theta"], "rms_norm_eps": m["norm_eps"],
        "rope_parameters": {**(scaling or {"rope_type": "default"}),
                            "rope_theta": m["rope_theta"]},
        "tie_word_embeddings": bool(m["tie_embeddings"]), "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "rope_scaling": scaling,
        "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": None,
    }
