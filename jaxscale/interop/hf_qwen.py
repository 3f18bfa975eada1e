"""Hugging Face Qwen2 / Qwen2.5 and Qwen3 (dense) checkpoints <-> the Llama decoder's parameters.

    source = open_qwen3(hf_dir)            # Source(config, lazy reader, leaves), as open_llama
    save_qwen(model, out_dir, dtype=None, max_shard_size=None)

Both families are the Llama with a switch on (`models/decoder/qwen.py`), so the Llama's mapping
(`hf.llama_leaves`) covers every shared tensor and only the switches' tensors are added here:
Qwen2's q/k/v biases join into the fused `bqkv` (K, G + 2, D) exactly as their weights join
into `wqkv` (`models/nn/fused.py`: reshapes and concatenation only, so round trips stay bit for
bit), and Qwen3's `q_norm` / `k_norm` scales are per-head RMSNorm scales of `head_dim`.
What the decoder cannot reproduce is refused in one paragraph naming the field: sliding-window
layers (`use_sliding_window`, `layer_types`), mixture-of-experts fields, a Qwen3 with
`attention_bias` (its output projection would need a bias too), other activations and rope
scalings (`hf_config.decoder_fields`). Opening and saving are `hf.open_decoder` /
`hf.save_decoder`: this module is the family's config mapping and leaf table only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxscale.errors import paragraph
from jaxscale.interop.hf import ConversionError, Leaf, decoder_opener, decoder_saver, llama_leaves
from jaxscale.interop.hf_config import decoder_fields, llama_config_to_hf
from jaxscale.models import DEFAULT_MODEL, lookup
from jaxscale.models.nn.fused import QKV

# The switches each family has, by its model.name (= HF model_type): exactly these, on. They
# are the defaults of the family's config class (`models/decoder/qwen.py`), so a converted config
# leaves them out and `model.name` alone builds the model (no flag launch.train lacks).
SWITCHES = {"qwen2": {"qkv_bias": True, "qk_norm": False},
            "qwen3": {"qkv_bias": False, "qk_norm": True}}
ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# HF fields that would make another model than the decoder computes: field -> what it means.
_REFUSED = {
    "use_sliding_window": "sliding-window attention on some layers",
    "num_experts": "a mixture-of-experts MLP",
    "num_local_experts": "a mixture-of-experts MLP",
}


def qwen_config_from_hf(hf: Mapping[str, Any], name: str, where: str = "config.json") -> dict:
    """HF Qwen2 / Qwen3 config fields -> `config.model` fields of `model.name=name`."""
    if hf.get("model_type", name) != name:
        raise ConversionError(paragraph(
            f"{where}: model_type={hf.get('model_type')!r} is read by the {name} converter;",
            f"only model_type={name!r} configs are (the model table dispatches: models.hf_opener)."))
    for key, what in _REFUSED.items():
        if hf.get(key):
            raise ConversionError(paragraph(
                f"{where}: {key}={hf[key]!r} ({what}) is not supported: jaxscale's {name} is",
                "the dense decoder with full attention on every layer, so the converted model",
                f"would compute different logits. Convert a checkpoint with {key} off."))
    sliding = [i for i, t in enumerate(hf.get("layer_types") or []) if t != "full_attention"]
    if sliding:
        raise ConversionError(paragraph(
            f"{where}: layer_types marks layers {sliding[:4]} as"
            f" {hf['layer_types'][sliding[0]]!r}, not 'full_attention': jaxscale's {name} attends",
            "to the full context on every layer. Convert a checkpoint with use_sliding_window",
            "false and full_attention layers."))
    if name == "qwen3" and hf.get("attention_bias"):
        raise ConversionError(paragraph(
            f"{where}: attention_bias=True is not supported for qwen3: it adds biases to the",
            "q/k/v and output projections, and jaxscale's decoder has q/k/v biases only",
            "(Qwen2's). Convert a checkpoint with attention_bias=false."))
    return decoder_fields(hf, where, name)


def switches(model_cfg: Mapping[str, Any]) -> dict[str, bool]:
    """The decoder switches a `config.model` section builds (its family's defaults unless it
    sets them), asked of its config class."""
    cfg = lookup(model_cfg.get("name", DEFAULT_MODEL))[0].from_config(model_cfg)
    return {k: bool(getattr(cfg, k)) for k in ("qkv_bias", "qk_norm")}


def qwen_config_to_hf(model_cfg: Mapping[str, Any], dtype: str = "float32") -> dict:
    """`config.model` of a Qwen family -> a `config.json` its `*ForCausalLM` loads."""
    m = dict(model_cfg)
    name, has = m["name"], switches(model_cfg)
    wrong = {k: has[k] for k, v in SWITCHES[name].items() if has[k] != v}
    if wrong:
        key = next(iter(wrong))
        raise ConversionError(paragraph(
            f"model.{key}={wrong[key]} does not fit a Hugging Face {name}, which has",
            f"{', '.join(f'{k}={v}' for k, v in SWITCHES[name].items())}: the export would drop",
            "or invent tensors. Export with the family whose switches the model has",
            "(qwen2: qkv_bias, qwen3: qk_norm, llama: neither)."))
    hf = llama_config_to_hf({**m, "qkv_bias": False, "qk_norm": False}, dtype)
    hf.pop("mlp_bias")
    if name == "qwen2":
        hf.pop("attention_bias")  # Qwen2 always has q/k/v biases and no output bias
    return {**hf, "architectures": [ARCHITECTURES[name]], "model_type": name,
            "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": m["num_layers"]}


def qwen_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """{jaxscale path: Leaf} of a Qwen family: the Llama's, plus the switches' tensors."""
    h, k, d = (model_cfg[n] for n in ("num_heads", "num_kv_heads", "head_dim"))
    p = "model.layers.{i}.self_attn."
    ident = lambda x: x
    leaves, has = llama_leaves(model_cfg), switches(model_cfg)
    if has["qkv_bias"]:  # HF q (H*D,), k, v (K*D,) <-> (K, G + 2, D)
        leaves["layers/attn/bqkv"] = Leaf(
            tuple(p + f"{n}_proj.bias" for n in "qkv"),
            lambda q, k_, v: QKV.join(q.reshape(h, d), k_.reshape(k, d), v.reshape(k, d)),
            lambda b: tuple(x.reshape(-1) for x in QKV.split(b)))
    if has["qk_norm"]:
        leaves["layers/attn/q_norm/scale"] = Leaf(p + "q_norm.weight", ident, ident)
        leaves["layers/attn/k_norm/scale"] = Leaf(p + "k_norm.weight", ident, ident)
    return leaves


open_qwen2 = decoder_opener("qwen2", qwen_config_from_hf, qwen_leaves)
open_qwen3 = decoder_opener("qwen3", qwen_config_from_hf, qwen_leaves)
save_qwen = decoder_saver("save_qwen", qwen_config_to_hf, qwen_leaves, tuple(SWITCHES))
