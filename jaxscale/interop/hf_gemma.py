"""Hugging Face Gemma 3 (text) and Gemma 2 checkpoints <-> jaxscale parameters: the Llama
converter plus Gemma's norms, soft-caps and local/global pattern.

    source = open_gemma3(hf_dir)   # model table openers (model_type "gemma3_text", "gemma2")
    source = open_gemma2(hf_dir)
    save_gemma(model, out_dir, dtype=None, max_shard_size=None)

`Gemma3ForCausalLM` has the Llama's q/k/v/o and gate/up/down tensors (joined into the fused
`wqkv` / `w_gate_up` exactly, `models/nn/fused.py`), Qwen3's `q_norm` / `k_norm`, and four norms a
block: `input_layernorm` (jaxscale `attn_norm`), `post_attention_layernorm` (after attention,
`attn_post_norm`, unlike the Llama's name), `pre_feedforward_layernorm` (`mlp_norm`) and
`post_feedforward_layernorm` (`mlp_post_norm`). Norm weights are stored as HF stores them (the
offset from 1, `RMSNorm(offset=True)`), so round trips stay bit for bit. The config's
`layer_types`, `sliding_window`, the per-layer-type `rope_parameters` (or the older
`rope_theta` / `rope_local_base_freq`), `query_pre_attn_scalar` and the soft-caps
(`attn_logit_softcapping`, `final_logit_softcapping`: Gemma 2's, null in Gemma 3) become
`config.model` fields; the switches themselves are the defaults of `models/decoder/gemma.py`'s
config classes. `Gemma2ForCausalLM` is the same without the q/k norms and with one rotary base.
What the decoder cannot reproduce is refused in one paragraph naming the field: bidirectional
attention, attention biases, another activation, a scaled rotary on the local layers.
Opening and saving are `hf.open_decoder` / `hf.save_decoder`: this module is the family's
config mapping and leaf table only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxscale.errors import paragraph
from jaxscale.interop.hf import ConversionError, Leaf, decoder_opener, decoder_saver, llama_leaves
from jaxscale.interop.hf_config import decoder_fields
from jaxscale.interop.hf_rope import rope_from_hf, rope_scaling_to_hf
from jaxscale.models import lookup

# By model.name: the HF model_type and class, the decoder switches the family has (exactly these,
# the defaults of its `models/decoder/gemma.py` config class), its default global rotary base, the
# pattern when config.json has no `layer_types` (every n-th layer global), and whether its local
# layers have their own rotary base.
FAMILIES = {
    "gemma3": dict(model_type="gemma3_text", arch="Gemma3ForCausalLM", theta=1_000_000.0,
                   every=6, local_rope=True,
                   switches={"norm_offset": True, "post_norms": True, "embed_scale": True,
                             "mlp_activation": "gelu_tanh", "qk_norm": True, "qkv_bias": False}),
    "gemma2": dict(model_type="gemma2", arch="Gemma2ForCausalLM", theta=10_000.0,
                   every=2, local_rope=False,
                   switches={"norm_offset": True, "post_norms": True, "embed_scale": True,
                             "mlp_activation": "gelu_tanh", "qk_norm": False, "qkv_bias": False}),
}
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
LOCAL_THETA = 10_000.0  # transformers' Gemma 3 `rope_local_base_freq` default
# HF fields that would make another model than the decoder computes: field -> what it means.
_REFUSED = {
    "use_bidirectional_attention": "bidirectional attention (an encoder, not a decoder)",
    "attention_bias": "attention projections with biases",
}


def gemma_config_from_hf(hf: Mapping[str, Any], name: str, where: str = "config.json") -> dict:
    """HF `Gemma3TextConfig` / `Gemma2Config` fields -> `config.model` of `model.name=name`."""
    family = FAMILIES[name]
    if hf.get("model_type") != family["model_type"]:
        raise ConversionError(paragraph(
            f"{where}: model_type={hf.get('model_type')!r} is read by the {name} converter;",
            f"only model_type={family['model_type']!r} ({family['arch']}) is. A multimodal",
            "'gemma3' checkpoint must be split into its text model first."))
    for key, what in _REFUSED.items():
        if hf.get(key):
            raise ConversionError(paragraph(
                f"{where}: {key}={hf[key]!r} ({what}) is not supported: jaxscale's {name} does",
                "not compute it, so the converted model would compute different logits.",
                f"Convert a checkpoint with {key} null / false."))
    act = hf.get("hidden_activation") or hf.get("hidden_act") or ACTIVATIONS[0]
    if act not in ACTIVATIONS:
        raise ConversionError(paragraph(
            f"{where}: hidden_activation={act!r} is not supported: jaxscale's Gemma MLP is",
            "GeGLU with the tanh-approximated GELU. Convert a checkpoint with",
            "hidden_activation='gelu_pytorch_tanh'."))
    full, local = _rope_parameters(hf, family)
    local_theta = 0.0
    if local is not None:
        local_fields = rope_from_hf({"rope_parameters": local}, where)
        if local_fields["rope_scaling"] != "none":
            raise ConversionError(paragraph(
                f"{where}: rope_parameters.sliding_attention={local!r} scales the local layers'",
                f"rotary, which jaxscale's {name} does not (only the global layers may be",
                "scaled). Convert a checkpoint with rope_type 'default' on sliding_attention."))
        local_theta = local_fields["rope_theta"]
    layer_types = _layer_types(hf, family["every"], where)
    plain = {**hf, "hidden_act": "silu", "rope_scaling": None, "rope_parameters": full,
             "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    fields = decoder_fields(plain, where, name)
    window = hf.get("sliding_window") or 0
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        raise ConversionError(paragraph(
            f"{where}: sliding_window={window!r} is not a positive integer, but layer_types has",
            "sliding_attention layers. Fix the value from the original checkpoint's config."))
    return {**fields, "sliding_window": window, "layer_types": layer_types,
            "rope_local_theta": local_theta,
            "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or 256),
            "attn_softcap": float(hf.get("attn_logit_softcapping") or 0.0),
            "final_softcap": float(hf.get("final_logit_softcapping") or 0.0)}


def _rope_parameters(hf: Mapping[str, Any], family: Mapping[str, Any]
                     ) -> tuple[dict, dict | None]:
    """(global, local) rope parameters of either config.json spelling, thetas filled in; the
    local ones None for a family whose local layers share the global rotary (Gemma 2)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = dict(params.get("full_attention") or {}), dict(
            params.get("sliding_attention") or {})
    else:  # one rotary, or (transformers < 5) rope_theta, rope_local_base_freq, rope_scaling
        full = dict(hf.get("rope_scaling") or params or {})
        full.setdefault("rope_theta", params.get("rope_theta") or hf.get("rope_theta"))
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq")}
    full["rope_theta"] = full.get("rope_theta") or family["theta"]
    full.setdefault("rope_type", full.pop("type", "default"))
    if not family["local_rope"]:
        return full, None
    local["rope_theta"] = local.get("rope_theta") or LOCAL_THETA
    local.setdefault("rope_type", local.pop("type", "default"))
    return full, local


def _layer_types(hf: Mapping[str, Any], every: int, where: str) -> list[str]:
    """`layer_types`, or the older `sliding_window_pattern` (every n-th layer global)."""
    n = int(hf["num_hidden_layers"]) if hf.get("num_hidden_layers") else 0
    kinds = hf.get("layer_types")
    if kinds is None:
        every = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
                    or every)
        kinds = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    bad = sorted({k for k in kinds if k not in ("sliding_attention", "full_attention")})
    if bad or len(kinds) != n:
        raise ConversionError(paragraph(
            f"{where}: layer_types={list(kinds)!r} must give each of the {n} layers one of",
            "'sliding_attention' and 'full_attention'. Fix it from the original checkpoint."))
    return list(kinds)


def gemma_config_to_hf(model_cfg: Mapping[str, Any]) -> dict:
    """`config.model` of a Gemma family -> a `config.json` its `*ForCausalLM` loads."""
    m = dict(model_cfg)
    name = m["name"]
    family = FAMILIES[name]
    cfg = lookup(name)[0].from_config(m)
    wrong = [k for k, v in family["switches"].items() if getattr(cfg, k) != v]
    if not family["local_rope"] and cfg.rope_local_theta:
        wrong.append("rope_local_theta")
    experts = dict(m.get("moe") or {}).get("num_experts", 0)
    if wrong or experts:
        key = wrong[0] if wrong else "moe.num_experts"
        value = getattr(cfg, key) if wrong else experts
        raise ConversionError(paragraph(
            f"model.{key}={value!r} does not fit a Hugging Face {name}, which has",
            f"{', '.join(f'{k}={v!r}' for k, v in family['switches'].items())}, a dense MLP",
            f"{'and a local rotary base' if family['local_rope'] else 'and one rotary base'}:",
            "the export would drop tensors or compute another model. Export it as the family",
            "it is."))
    full = {**(rope_scaling_to_hf(m) or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    rope = (full if not family["local_rope"] else {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}})
    cap = lambda x: x or None
    return {
        "architectures": [family["arch"]], "model_type": family["model_type"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed, "intermediate_size": cfg.mlp,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "hidden_activation": ACTIVATIONS[0], "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope, "attention_bias": False,
        "query_pre_attn_scalar": _integral(cfg.query_pre_attn_scalar or cfg.head_dim),
        "sliding_window": cfg.sliding_window or None,
        "layer_types": ["sliding_attention" if x else "full_attention" for x in cfg.local_layers],
        "final_logit_softcapping": cap(cfg.final_softcap),
        "attn_logit_softcapping": cap(cfg.attn_softcap),
        **({"use_bidirectional_attention": False} if family["local_rope"] else {}),
        "bos_token_id": None, "eos_token_id": None,
    }


def _integral(x: float) -> int | float:
    """An int where the value is one (transformers' Gemma 3 config types this field int)."""
    return int(x) if float(x).is_integer() else x


def gemma_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """{jaxscale path: Leaf} of a Gemma: the Llama's, four block norms and (Gemma 3) the q/k
    norms."""
    ident = lambda x: x
    p = "model.layers.{i}."
    leaves = llama_leaves({**model_cfg, "tie_embeddings": model_cfg.get("tie_embeddings", True)})
    leaves.update({
        "layers/attn_post_norm/scale": Leaf(p + "post_attention_layernorm.weight", ident, ident),
        "layers/mlp_norm/scale": Leaf(p + "pre_feedforward_layernorm.weight", ident, ident),
        "layers/mlp_post_norm/scale": Leaf(p + "post_feedforward_layernorm.weight", ident,
                                           ident),
    })
    if FAMILIES[model_cfg["name"]]["switches"]["qk_norm"]:
        leaves["layers/attn/q_norm/scale"] = Leaf(p + "self_attn.q_norm.weight", ident, ident)
        leaves["layers/attn/k_norm/scale"] = Leaf(p + "self_attn.k_norm.weight", ident, ident)
    return leaves


open_gemma3 = decoder_opener("gemma3", gemma_config_from_hf, gemma_leaves)
open_gemma2 = decoder_opener("gemma2", gemma_config_from_hf, gemma_leaves)
save_gemma = decoder_saver("save_gemma", gemma_config_to_hf, gemma_leaves, tuple(FAMILIES))
