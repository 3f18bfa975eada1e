"""Hugging Face rope settings <-> jaxscale's `config.model.rope_*` fields.

HF configs declare rotary scaling in `rope_scaling` (transformers < 5) or `rope_parameters`
(transformers >= 5, which also holds `rope_theta`), with `rope_type` (or the older `type`).
jaxscale computes `linear`, `llama3` (Llama 3.1 / 3.2) and `yarn` (GPT-OSS, DeepSeek) exactly
(jaxscale/models/nn/rope.py); any other type is refused, since approximating it would change the
model's logits. YaRN's optional keys (`beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim`,
`truncate`, `attention_factor`) take transformers' defaults when absent, and are written back
only where they differ from them (transformers reads an `attention_factor` of 0 as a factor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxscale.errors import paragraph
from jaxscale.interop.safetensors_io import ConversionError

ROPE_HF_KEYS = {  # jaxscale field -> HF rope_scaling key, per supported scaling type (required)
    "linear": {"rope_factor": "factor"},
    "llama3": {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
               "rope_high_freq_factor": "high_freq_factor",
               "rope_original_max_len": "original_max_position_embeddings"},
    "yarn": {"rope_factor": "factor", "rope_original_max_len": "original_max_position_embeddings"},
}
# YaRN's optional keys: jaxscale field -> (HF key, transformers' value when absent).
YARN_OPTIONAL = {
    "rope_beta_fast": ("beta_fast", 32.0), "rope_beta_slow": ("beta_slow", 1.0),
    "rope_mscale": ("mscale", 0.0), "rope_mscale_all_dim": ("mscale_all_dim", 0.0),
    "rope_truncate": ("truncate", True), "rope_attention_factor": ("attention_factor", 0.0),
}


def rope_from_hf(hf: Mapping[str, Any], where: str) -> dict:
    """The `rope_*` model fields of an HF config's `rope_scaling` / `rope_parameters`."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = rope.get("rope_type", rope.get("type")) or "default"
    theta = (rope.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta")
             or hf.get("rope_theta") or 10000.0)
    if kind == "default":
        return dict(rope_theta=float(theta), rope_scaling="none")
    if kind not in ROPE_HF_KEYS:
        raise ConversionError(paragraph(
            f"{where}: rope scaling of type {kind!r} ({dict(rope)}) is not implemented; jaxscale",
            f"supports rope_type 'default', {', '.join(map(repr, ROPE_HF_KEYS))} (Llama 3.1 /",
            "3.2, GPT-OSS and DeepSeek), and any other scaling would make the converted model",
            "compute different logits. Convert a checkpoint with one of those rope types.",
        ))
    if kind == "yarn" and rope.get("factor") is None and hf.get("max_position_embeddings"):
        # transformers' rule for DeepSeek-style configs that give only the two lengths
        original = rope.get("original_max_position_embeddings")
        if original:
            rope["factor"] = hf["max_position_embeddings"] / original
    keys = ROPE_HF_KEYS[kind]
    missing = [k for k in keys.values() if rope.get(k) is None]
    if missing:
        raise ConversionError(paragraph(
            f"{where}: rope scaling {kind!r} lacks {', '.join(missing)}, which it needs",
            f"({', '.join(keys.values())}); the file is truncated or hand-edited. Add the",
            "values from the original checkpoint's config.json.",
        ))
    fields = {field: float(rope[key]) for field, key in keys.items()}
    if "rope_original_max_len" in fields:
        fields["rope_original_max_len"] = int(fields["rope_original_max_len"])
    if kind == "yarn":
        for field, (key, default) in YARN_OPTIONAL.items():
            value = rope.get(key)
            fields[field] = (bool(value) if isinstance(default, bool) else float(value or default)
                             ) if value is not None else default
    return dict(rope_theta=float(theta), rope_scaling=kind, **fields)


def rope_scaling_to_hf(model_cfg: Mapping[str, Any]) -> dict | None:
    """The HF `rope_scaling` dict of jaxscale model fields (None without a scaling)."""
    kind = model_cfg.get("rope_scaling", "none")
    if kind == "none":
        return None
    out = {"rope_type": kind,
           **{key: model_cfg[field] for field, key in ROPE_HF_KEYS[kind].items()}}
    if kind == "yarn":
        for field, (key, default) in YARN_OPTIONAL.items():
            value = model_cfg.get(field, default)
            if key in ("beta_fast", "beta_slow", "truncate") or value != default:
                out[key] = value
    return out
