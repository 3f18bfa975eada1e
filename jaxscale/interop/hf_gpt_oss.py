"""Hugging Face GPT-OSS (`GptOssForCausalLM`, model_type "gpt_oss") <-> `model.name=gpt_oss`.

    source = open_gpt_oss(hf_dir)      # model table opener
    save_gpt_oss(model, out_dir, dtype=None, max_shard_size=None)

The decoder (`models/decoder/gpt_oss.py`) with every layer's MLP the MoE block: what
transformers' config says maps field for field: `attention_bias` is `qkv_bias` and `out_bias`,
the `sinks` are `attn_sinks`, `layer_types` / `sliding_window` the local/global pattern, YaRN
through `hf_rope.py`, `num_local_experts` / `num_experts_per_tok` / `swiglu_limit` /
`swiglu_alpha` `model.moe`'s with the `topk_softmax` router and its and the experts' biases.

Tensors: q/k/v weights and biases fused as Qwen2's (`hf_qwen.qwen_leaves`); the output bias,
sinks, router weight (X, E) transposed into (E, X) and its bias as they are. The experts are
stored stacked already: `gate_up_proj` (X, E, 2F) interleaves gate and up along its last axis
(gate at even, up at odd columns; its bias (X, 2F) likewise), split into `w_gate` / `w_up`
(X, E, F) and joined back; `down_proj` (X, F, E) is `w_down` as is. Slicing and interleaving
only, so a round trip is bit for bit. The published checkpoints store the experts' weights in
MXFP4 (`*_blocks` / `*_scales`): `hf_mxfp4.py` dequantises them on import.

The router's load-balancing loss trains only where the config asks (`output_router_logits`),
as for Mixtral (`hf_moe.py`): `router_aux_loss_coef` x experts_per_token. Refused in one
paragraph: a sliding-window layer without a window, a pattern that names other layer kinds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxscale.errors import paragraph
from jaxscale.interop.hf import (
    ConversionError,
    Leaf,
    Pretrained,
    Source,
    open_decoder,
    save_tensors,
    unpack,
)
from jaxscale.interop.hf_config import decoder_fields, require_keys
from jaxscale.interop.hf_mxfp4 import mxfp4_reader
from jaxscale.interop.hf_qwen import qwen_leaves
from jaxscale.interop.hf_rope import rope_scaling_to_hf
from jaxscale.models.moe.config import MoEConfig, expert_width

_REQUIRED = ("num_local_experts", "num_experts_per_tok", "intermediate_size", "hidden_size",
             "num_hidden_layers", "num_attention_heads", "vocab_size")


def gpt_oss_config_from_hf(hf: Mapping[str, Any], where: str = "config.json",
                           name: str = "gpt_oss") -> dict:
    """HF `GptOssConfig` fields -> `config.model` of `model.name=gpt_oss`."""
    if hf.get("model_type") != "gpt_oss":
        raise ConversionError(paragraph(
            f"{where}: model_type={hf.get('model_type')!r} is read by the gpt_oss converter;",
            "only model_type='gpt_oss' is (the model table dispatches: interop.hf.load)."))
    require_keys(hf, _REQUIRED, where, "GPT-OSS")
    fields = decoder_fields(hf, where, name)
    layers, window = fields["num_layers"], hf.get("sliding_window")
    kinds = list(hf.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)])
    if "sliding_attention" in kinds and not (isinstance(window, int) and window > 0):
        raise ConversionError(paragraph(
            f"{where}: sliding_window={window!r} is not a positive integer, but layer_types has",
            "sliding_attention layers: they would have no window. Convert a checkpoint whose",
            "sliding_window is the local layers' window (128 in the published ones)."))
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise ConversionError(paragraph(
            f"{where}: quantization_config.quant_method={quant!r} is not read; jaxscale",
            "dequantises the MXFP4 expert weights of the published GPT-OSS checkpoints",
            "(hf_mxfp4.py) and reads unquantised ones. Convert an MXFP4 or a bf16 checkpoint."))
    bias = bool(hf.get("attention_bias", True))
    k = int(hf["num_experts_per_tok"])
    coef = float(hf.get("router_aux_loss_coef") or 0.0) * k if hf.get(
        "output_router_logits") else 0.0
    moe = dict(num_experts=int(hf["num_local_experts"]), experts_per_token=k,
               router="topk_softmax", norm_topk_prob=True, mlp=0, capacity_factor=0.0,
               router_aux_loss_coef=coef, router_z_loss_coef=0.0, every=1, router_bias=True,
               expert_bias=True, swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
               swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
    return {**fields, "name": name, "qkv_bias": bias, "out_bias": bias, "attn_sinks": True,
            "sliding_window": window or 0, "layer_types": kinds, "moe": moe}


def gpt_oss_config_to_hf(model_cfg: Mapping[str, Any], dtype: str = "float32") -> dict:
    """`config.model` of `model.name=gpt_oss` -> a `config.json` `GptOssForCausalLM` loads."""
    m = dict(model_cfg)
    moe = MoEConfig.from_config(m.get("moe"))
    has = {k: m.get(k, True) for k in ("qkv_bias", "out_bias", "attn_sinks")}
    for key, wrong, why in (
            ("moe.router", moe.router != "topk_softmax", "its router softmaxes the top-k logits"),
            ("moe.router_bias", not moe.router_bias, "its router has a bias"),
            ("moe.expert_bias", not moe.expert_bias, "its experts have biases"),
            ("moe.shared_experts", moe.shared_experts > 0, "it has no shared experts"),
            ("moe.every", moe.every != 1 or not moe.num_experts, "every layer has experts"),
            ("qkv_bias", has["qkv_bias"] != has["out_bias"],
             "one attention_bias switches the q/k/v and output biases together"),
            ("attn_sinks", not has["attn_sinks"], "every attention has sinks"),
            ("mlp", expert_width(moe, m["mlp"]) != m["mlp"] and moe.mlp,
             "intermediate_size is the expert width (model.moe.mlp 0 or model.mlp)")):
        if wrong:
            raise ConversionError(paragraph(
                f"model.{key} does not fit a Hugging Face GPT-OSS: {why}, so the export would",
                "drop tensors or compute another model. Export it as the family it is."))
    scaling = rope_scaling_to_hf(m)
    rope = {**(scaling or {"rope_type": "default"}), "rope_theta": m["rope_theta"]}
    k = moe.experts_per_token
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": m["vocab_size"], "hidden_size": m["embed"],
        "intermediate_size": expert_width(moe, m["mlp"]), "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"],
        "head_dim": m["head_dim"], "max_position_embeddings": m["max_len"],
        "rope_parameters": rope, "rms_norm_eps": m["norm_eps"],
        "tie_word_embeddings": bool(m["tie_embeddings"]), "hidden_act": "silu",
        "attention_bias": bool(has["qkv_bias"]), "sliding_window": m.get("sliding_window") or None,
        "layer_types": list(m.get("layer_types") or ["full_attention"] * m["num_layers"]),
        "num_local_experts": moe.num_experts, "num_experts_per_tok": k,
        "swiglu_limit": moe.swiglu_limit, "swiglu_alpha": moe.swiglu_alpha,
        "output_router_logits": moe.router_aux_loss_coef > 0,
        "router_aux_loss_coef": moe.router_aux_loss_coef / k,
        "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": None,
    }


def gpt_oss_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """{jaxscale path: Leaf}: Qwen2's attention tensors (fused q/k/v with biases), the output
    bias and sinks, and the router and experts in place of the dense MLP."""
    leaves = qwen_leaves({**model_cfg, "name": "qwen2", "qkv_bias": True, "qk_norm": False})
    del leaves["layers/mlp/w_gate_up"], leaves["layers/mlp/w_down"]
    ident = lambda x: x
    a, p = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    e = p + "experts."
    leaves.update({
        "layers/attn/bo": Leaf(a + "o_proj.bias", ident, ident),
        "layers/attn/sinks": Leaf(a + "sinks", ident, ident),
        "layers/mlp/router": Leaf(p + "router.weight", _t, _t),  # (X, E) <-> (E, X)
        "layers/mlp/router_bias": Leaf(p + "router.bias", ident, ident),
        # import only: both halves read one HF tensor (`save_gpt_oss` joins them back)
        "layers/mlp/w_gate": Leaf(e + "gate_up_proj", _even, ident),
        "layers/mlp/w_up": Leaf(e + "gate_up_proj", _odd, ident),
        "layers/mlp/b_gate": Leaf(e + "gate_up_proj_bias", _even, ident),
        "layers/mlp/b_up": Leaf(e + "gate_up_proj_bias", _odd, ident),
        "layers/mlp/w_down": Leaf(e + "down_proj", ident, ident),
        "layers/mlp/b_down": Leaf(e + "down_proj_bias", ident, ident),
    })
    return leaves


# Export: the gate and up halves, interleaved into one HF tensor under a path of its own.
_JOINED = {"layers/mlp/gate_up_proj": ("w_gate", "w_up", "gate_up_proj"),
           "layers/mlp/gate_up_proj_bias": ("b_gate", "b_up", "gate_up_proj_bias")}


def save_gpt_oss(model: Pretrained | tuple[Mapping, Mapping], out_dir: str, dtype: Any = None,
                 max_shard_size: int | str | None = None) -> str:
    """Writes the Hugging Face `config.json` + safetensors of a `model.name=gpt_oss` model. The
    experts' gate and up halves are interleaved back into `gate_up_proj` (and its bias) on the
    host, two leaves at a time; every other parameter is gathered one at a time."""
    model_cfg, flat = unpack(model, "save_gpt_oss")
    if model_cfg.get("name") != "gpt_oss":
        raise ConversionError(f"save_gpt_oss: model.name={model_cfg.get('name')!r} is not "
                              "'gpt_oss'; use the saver of its family.")
    hf_config = gpt_oss_config_to_hf(model_cfg)
    leaves = gpt_oss_leaves(model_cfg)
    for path, (gate, up, hf_name) in _JOINED.items():
        g, u = (np.asarray(jax.device_get(flat.pop(f"layers/mlp/{n}"))) for n in (gate, up))
        flat[path] = np.stack([g, u], axis=-1).reshape(*g.shape[:-1], 2 * g.shape[-1])
        del leaves[f"layers/mlp/{gate}"], leaves[f"layers/mlp/{up}"]
        leaves[path] = Leaf(f"model.layers.{{i}}.mlp.experts.{hf_name}", _ident, _ident)
    return save_tensors(flat, leaves, hf_config, out_dir, dtype, max_shard_size)


def _ident(w: np.ndarray) -> np.ndarray:
    return w


def _t(w: np.ndarray) -> np.ndarray:
    return w.T


def _even(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w[..., ::2])


def _odd(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w[..., 1::2])


def open_gpt_oss(hf_dir: str) -> Source:
    """The config and lazy reader of a HF gpt_oss directory (validated); MXFP4 expert
    tensors (`*_blocks` / `*_scales`, the published checkpoints) read dequantised."""
    source = open_decoder(hf_dir, "gpt_oss", gpt_oss_config_from_hf, gpt_oss_leaves)
    return dataclasses.replace(source, reader=mxfp4_reader(source.reader))
