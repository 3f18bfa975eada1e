"""Hugging Face `ViTForImageClassification` checkpoints <-> jaxscale ViT parameters.

Same machinery as the Llama converter (`hf.py`): lazy safetensors reads, one tensor at a time,
placed straight into each parameter's sharding when a mesh is given. Reads both the current
transformers layout (`vit.layers.{i}.attention.q_proj`) and the older one
(`vit.encoder.layer.{i}.attention.attention.query`); writes the current one. Images are
(B, H, W, C) in jaxscale and (B, C, H, W) in transformers: transpose `pixel_values` to compare.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jax.sharding import Mesh

from jaxscale.errors import paragraph
from jaxscale.interop.hf import (
    ConversionError,
    Leaf,
    Pretrained,
    SafetensorsReader,
    Source,
    load_pretrained,
    read_hf_config,
    save_tensors,
    unpack,
)
from jaxscale.interop.hf_config import require_keys
from jaxscale.rules import AxisRules

_LEGACY = {  # current name fragment -> older transformers name fragment
    "vit.layers.{i}.attention.q_proj": "vit.encoder.layer.{i}.attention.attention.query",
    "vit.layers.{i}.attention.k_proj": "vit.encoder.layer.{i}.attention.attention.key",
    "vit.layers.{i}.attention.v_proj": "vit.encoder.layer.{i}.attention.attention.value",
    "vit.layers.{i}.attention.o_proj": "vit.encoder.layer.{i}.attention.output.dense",
    "vit.layers.{i}.mlp.fc1": "vit.encoder.layer.{i}.intermediate.dense",
    "vit.layers.{i}.mlp.fc2": "vit.encoder.layer.{i}.output.dense",
    "vit.layers.{i}.layernorm_before": "vit.encoder.layer.{i}.layernorm_before",
    "vit.layers.{i}.layernorm_after": "vit.encoder.layer.{i}.layernorm_after",
}


VIT_REQUIRED = ("image_size", "patch_size", "hidden_size", "num_hidden_layers",
                "num_attention_heads", "intermediate_size")


def vit_config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> dict:
    if hf.get("model_type") != "vit":
        raise ConversionError(f"{where}: model_type={hf.get('model_type')!r}; load_vit reads "
                              "'vit' image classifiers (ViTForImageClassification).")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ConversionError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported; "
                              "jaxscale's ViT uses exact (erf) GELU, hidden_act='gelu'.")
    if not hf.get("qkv_bias", True):
        raise ConversionError(paragraph(
            f"{where}: qkv_bias=False is not supported: jaxscale's ViT always has q/k/v biases",
            "and a round trip would add them. Convert a checkpoint with qkv_bias=true.",
        ))
    require_keys(hf, VIT_REQUIRED, where, "ViT")
    heads = int(hf["num_attention_heads"])
    labels = hf.get("id2label") or {}
    return dict(
        name="vit", task="classify", image_size=int(hf["image_size"]),
        patch_size=int(hf["patch_size"]), channels=int(hf.get("num_channels", 3)),
        num_classes=int(hf.get("num_labels") or len(labels) or 2),
        embed=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, head_dim=int(hf["hidden_size"]) // heads,
        mlp=int(hf["intermediate_size"]), norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
    )


def vit_config_to_hf(model_cfg: Mapping[str, Any], dtype: str = "float32") -> dict:
    m = dict(model_cfg)
    if m["head_dim"] * m["num_heads"] != m["embed"]:
        raise ConversionError(f"HF ViT needs head_dim * num_heads == embed; got {m['head_dim']}"
                              f" * {m['num_heads']} != {m['embed']}.")
    k = m["num_classes"]
    return {
        "architectures": ["ViTForImageClassification"], "model_type": "vit",
        "image_size": m["image_size"], "patch_size": m["patch_size"],
        "num_channels": m["channels"], "hidden_size": m["embed"],
        "num_hidden_layers": m["num_layers"], "num_attention_heads": m["num_heads"],
        "intermediate_size": m["mlp"], "layer_norm_eps": m["norm_eps"], "hidden_act": "gelu",
        "qkv_bias": True, "id2label": {str(i): f"LABEL_{i}" for i in range(k)},
        "label2id": {f"LABEL_{i}": i for i in range(k)}, "torch_dtype": dtype,
    }


def vit_leaves(model_cfg: Mapping[str, Any], legacy: bool = False) -> dict[str, Leaf]:
    a, d, e = model_cfg["num_heads"], model_cfg["head_dim"], model_cfg["embed"]
    ident, t = (lambda x: x), (lambda x: x.T)
    name = lambda s: _LEGACY.get(s, s) if legacy else s
    layer = lambda part, suffix: name("vit.layers.{i}." + part) + suffix
    leaves = {
        "cls_token": Leaf("vit.embeddings.cls_token", lambda x: x.reshape(e),
                          lambda x: x.reshape(1, 1, e), stacked=False),
        "pos_embedding": Leaf("vit.embeddings.position_embeddings", lambda x: x[0],
                              lambda x: x[None], stacked=False),
        # Conv (E, C, P, P) <-> (P, P, C, E)
        "patch_kernel": Leaf("vit.embeddings.patch_embeddings.projection.weight",
                             lambda x: x.transpose(2, 3, 1, 0), lambda x: x.transpose(3, 2, 0, 1),
                             stacked=False),
        "patch_bias": Leaf("vit.embeddings.patch_embeddings.projection.bias", ident, ident,
                           stacked=False),
        "final_norm/scale": Leaf("vit.layernorm.weight", ident, ident, stacked=False),
        "final_norm/bias": Leaf("vit.layernorm.bias", ident, ident, stacked=False),
        "head_kernel": Leaf("classifier.weight", t, t, stacked=False),
        "head_bias": Leaf("classifier.bias", ident, ident, stacked=False),
        "layers/attn/wo": Leaf(layer("attention.o_proj", ".weight"),  # (E, A*D) <-> (A, D, E)
                               lambda x: x.T.reshape(a, d, e), lambda x: x.reshape(a * d, e).T),
        "layers/attn/bo": Leaf(layer("attention.o_proj", ".bias"), ident, ident),
        "layers/mlp/w_in": Leaf(layer("mlp.fc1", ".weight"), t, t),
        "layers/mlp/b_in": Leaf(layer("mlp.fc1", ".bias"), ident, ident),
        "layers/mlp/w_out": Leaf(layer("mlp.fc2", ".weight"), t, t),
        "layers/mlp/b_out": Leaf(layer("mlp.fc2", ".bias"), ident, ident),
    }
    for n in "qkv":
        leaves[f"layers/attn/w{n}"] = Leaf(layer(f"attention.{n}_proj", ".weight"),
                                           lambda x: x.T.reshape(e, a, d),
                                           lambda x: x.reshape(e, a * d).T)
        leaves[f"layers/attn/b{n}"] = Leaf(layer(f"attention.{n}_proj", ".bias"),
                                           lambda x: x.reshape(a, d), lambda x: x.reshape(a * d))
    for ours, theirs in (("attn_norm", "layernorm_before"), ("mlp_norm", "layernorm_after")):
        leaves[f"layers/{ours}/scale"] = Leaf(layer(theirs, ".weight"), ident, ident)
        leaves[f"layers/{ours}/bias"] = Leaf(layer(theirs, ".bias"), ident, ident)
    return leaves


def open_vit(hf_dir: str) -> Source:
    """The config and lazy reader of a HF ViTForImageClassification directory."""
    model_cfg = vit_config_from_hf(read_hf_config(hf_dir), os.path.join(hf_dir, "config.json"))
    reader = SafetensorsReader(hf_dir)
    legacy = "vit.layers.0.attention.q_proj.weight" not in reader
    return Source(model_cfg, reader, vit_leaves(model_cfg, legacy))


def load_vit(hf_dir: str, mesh: Mesh | None = None, rules: AxisRules | None = None,
             dtype: Any = None) -> Pretrained:
    """`Pretrained(config, params)` from a HF ViTForImageClassification directory."""
    return load_pretrained(open_vit(hf_dir), mesh, rules, dtype)


def save_vit(model: Pretrained | tuple[Mapping, Mapping], out_dir: str, dtype: Any = None,
             max_shard_size: int | str | None = None) -> str:
    """Writes config.json + safetensors that `ViTForImageClassification` loads."""
    model_cfg, flat = unpack(model, "save_vit")
    return save_tensors(flat, vit_leaves(model_cfg), vit_config_to_hf(model_cfg), out_dir,
                        dtype, max_shard_size)
