"""Hugging Face Gemma 3 (text) checkpoints <-> jaxscale parameters: the Llama converter plus
Gemma's norms and local/global pattern.

    source = open_gemma3(hf_dir)          # model table opener (model_type "gemma3_text")
    save_gemma3(model, out_dir, dtype=None, max_shard_size=None)

`Gemma3ForCausalLM` has the Llama's q/k/v/o and gate/up/down tensors (joined into the fused
`wqkv` / `w_gate_up` exactly, `models/fused.py`), Qwen3's `q_norm` / `k_norm`, and four norms a
block: `input_layernorm` (jaxscale `attn_norm`), `post_attention_layernorm` (after attention,
`attn_post_norm`, unlike the Llama's name), `pre_feedforward_layernorm` (`mlp_norm`) and
`post_feedforward_layernorm` (`mlp_post_norm`). Norm weights are stored as HF stores them (the
offset from 1, `RMSNorm(offset=True)`), so round trips stay bit for bit. The config's
`layer_types`, `sliding_window`, the per-layer-type `rope_parameters` (or the older
`rope_theta` / `rope_local_base_freq`) and `query_pre_attn_scalar` become `config.model` fields;
the switches themselves are the defaults of `models/gemma.Gemma3Config`.
What the decoder cannot reproduce is refused in one paragraph naming the field: logit
soft-capping (Gemma 2's, `attn_logit_softcapping` / `final_logit_softcapping`), bidirectional
attention, attention biases, another activation, a scaled rotary on the local layers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jaxscale.errors import paragraph
from jaxscale.interop.hf import (
    ConversionError,
    Leaf,
    Pretrained,
    SafetensorsReader,
    Source,
    decoder_fields,
    llama_leaves,
    read_hf_config,
    save_tensors,
    unpack,
)
from jaxscale.interop.hf_rope import rope_from_hf, rope_scaling_to_hf
from jaxscale.models import lookup

MODEL_TYPE = "gemma3_text"
# The decoder switches a Gemma 3 has (`models/gemma.Gemma3Config`'s defaults): exactly these.
SWITCHES = {"norm_offset": True, "post_norms": True, "embed_scale": True,
            "mlp_activation": "gelu_tanh", "qk_norm": True, "qkv_bias": False}
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma 3 defaults
# HF fields that would make another model than the decoder computes: field -> what it means.
_REFUSED = {
    "attn_logit_softcapping": "soft-capping of the attention logits (Gemma 2's)",
    "final_logit_softcapping": "soft-capping of the final logits (Gemma 2's)",
    "use_bidirectional_attention": "bidirectional attention (an encoder, not a decoder)",
    "attention_bias": "attention projections with biases",
}


def gemma3_config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> dict:
    """HF `Gemma3TextConfig` fields -> `config.model` fields of `model.name=gemma3`."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ConversionError(paragraph(
            f"{where}: model_type={hf.get('model_type')!r} is read by the Gemma 3 converter;",
            f"only model_type={MODEL_TYPE!r} (the text decoder, Gemma3ForCausalLM) is. A",
            "multimodal 'gemma3' checkpoint must be split into its text model first."))
    for key, what in _REFUSED.items():
        if hf.get(key):
            raise ConversionError(paragraph(
                f"{where}: {key}={hf[key]!r} ({what}) is not supported: jaxscale's gemma3 does",
                "not compute it, so the converted model would compute different logits.",
                f"Convert a checkpoint with {key} null / false."))
    act = hf.get("hidden_activation") or hf.get("hidden_act") or ACTIVATIONS[0]
    if act not in ACTIVATIONS:
        raise ConversionError(paragraph(
            f"{where}: hidden_activation={act!r} is not supported: jaxscale's Gemma MLP is",
            "GeGLU with the tanh-approximated GELU. Convert a checkpoint with",
            "hidden_activation='gelu_pytorch_tanh'."))
    full, local = _rope_parameters(hf)
    local_fields = rope_from_hf({"rope_parameters": local}, where)
    if local_fields["rope_scaling"] != "none":
        raise ConversionError(paragraph(
            f"{where}: rope_parameters.sliding_attention={local!r} scales the local layers'",
            "rotary, which jaxscale's gemma3 does not (only the global layers may be scaled).",
            "Convert a checkpoint with rope_type 'default' on sliding_attention."))
    layer_types = _layer_types(hf, where)
    plain = {**hf, "hidden_act": "silu", "rope_scaling": None, "rope_parameters": full,
             "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    fields = decoder_fields(plain, where, "gemma3")
    window = hf.get("sliding_window") or 0
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        raise ConversionError(paragraph(
            f"{where}: sliding_window={window!r} is not a positive integer, but layer_types has",
            "sliding_attention layers. Fix the value from the original checkpoint's config."))
    return {**fields, "sliding_window": window, "layer_types": layer_types,
            "rope_local_theta": local_fields["rope_theta"],
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or 256)}


def _rope_parameters(hf: Mapping[str, Any]) -> tuple[dict, dict]:
    """(global, local) rope parameters of either config.json spelling, thetas filled in."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = dict(params.get("full_attention") or {}), dict(
            params.get("sliding_attention") or {})
    else:  # transformers < 5: rope_theta, rope_local_base_freq, rope_scaling (global only)
        full = dict(hf.get("rope_scaling") or params or {})
        full.setdefault("rope_theta", hf.get("rope_theta"))
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq")}
    full["rope_theta"] = full.get("rope_theta") or GLOBAL_THETA
    local["rope_theta"] = local.get("rope_theta") or LOCAL_THETA
    full.setdefault("rope_type", full.pop("type", "default"))
    local.setdefault("rope_type", local.pop("type", "default"))
    return full, local


def _layer_types(hf: Mapping[str, Any], where: str) -> list[str]:
    """`layer_types`, or the older `sliding_window_pattern` (every n-th layer global)."""
    n = int(hf["num_hidden_layers"]) if hf.get("num_hidden_layers") else 0
    kinds = hf.get("layer_types")
    if kinds is None:
        every = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        kinds = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    bad = sorted({k for k in kinds if k not in ("sliding_attention", "full_attention")})
    if bad or len(kinds) != n:
        raise ConversionError(paragraph(
            f"{where}: layer_types={list(kinds)!r} must give each of the {n} layers one of",
            "'sliding_attention' and 'full_attention'. Fix it from the original checkpoint."))
    return list(kinds)


def gemma3_config_to_hf(model_cfg: Mapping[str, Any]) -> dict:
    """`config.model` of a gemma3 -> a `config.json` that `Gemma3ForCausalLM` loads."""
    m = dict(model_cfg)
    cfg = lookup("gemma3")[0].from_config(m)
    wrong = [k for k, v in SWITCHES.items() if getattr(cfg, k) != v]
    experts = dict(m.get("moe") or {}).get("num_experts", 0)
    if wrong or experts:
        key = wrong[0] if wrong else "moe.num_experts"
        value = getattr(cfg, key) if wrong else experts
        raise ConversionError(paragraph(
            f"model.{key}={value!r} does not fit a Hugging Face Gemma 3, which has",
            f"{', '.join(f'{k}={v!r}' for k, v in SWITCHES.items())} and a dense MLP: the export",
            "would drop tensors or compute another model. Export it as the family it is."))
    local = cfg.local_layers
    full = {**(rope_scaling_to_hf(m) or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed, "intermediate_size": cfg.mlp,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_activation": ACTIVATIONS[0], "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}},
        "attention_bias": False,
        "query_pre_attn_scalar": _integral(cfg.query_pre_attn_scalar or cfg.head_dim),
        "sliding_window": cfg.sliding_window or None,
        "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False, "bos_token_id": None, "eos_token_id": None,
    }


def _integral(x: float) -> int | float:
    """An int where the value is one (transformers' Gemma 3 config types this field int)."""
    return int(x) if float(x).is_integer() else x


def gemma3_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """{jaxscale path: Leaf} of a Gemma 3: the Llama's, the q/k norms and four block norms."""
    ident = lambda x: x
    p = "model.layers.{i}."
    leaves = llama_leaves({**model_cfg, "tie_embeddings": model_cfg.get("tie_embeddings", True)})
    leaves.update({
        "layers/attn_post_norm/scale": Leaf(p + "post_attention_layernorm.weight", ident, ident),
        "layers/mlp_norm/scale": Leaf(p + "pre_feedforward_layernorm.weight", ident, ident),
        "layers/mlp_post_norm/scale": Leaf(p + "post_feedforward_layernorm.weight", ident,
                                           ident),
        "layers/attn/q_norm/scale": Leaf(p + "self_attn.q_norm.weight", ident, ident),
        "layers/attn/k_norm/scale": Leaf(p + "self_attn.k_norm.weight", ident, ident),
    })
    return leaves


def open_gemma3(hf_dir: str) -> Source:
    """The config and lazy reader of a HF Gemma 3 text directory (validated)."""
    where = os.path.join(hf_dir, "config.json")
    model_cfg = gemma3_config_from_hf(read_hf_config(hf_dir), where)
    return Source(model_cfg, SafetensorsReader(hf_dir), gemma3_leaves(model_cfg))


def save_gemma3(model: Pretrained | tuple[Mapping, Mapping], out_dir: str, dtype: Any = None,
                max_shard_size: int | str | None = None) -> str:
    """Writes `config.json` + safetensors that `Gemma3ForCausalLM.from_pretrained` loads."""
    model_cfg, flat = unpack(model, "save_gemma3")
    return save_tensors(flat, gemma3_leaves(model_cfg), gemma3_config_to_hf(model_cfg),
                        out_dir, dtype, max_shard_size)
