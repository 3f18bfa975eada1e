"""Hugging Face Mistral checkpoints <-> jaxscale parameters: the Llama converter plus a window.

    model = load_mistral(hf_dir, mesh=None, rules=None, dtype=None)   # Pretrained(config, params)
    save_mistral(model, out_dir, dtype=None, max_shard_size=None)

`MistralForCausalLM` (config.json `model_type` "mistral") has the Llama's weight layout and
names, an explicit `head_dim` that may differ from hidden / heads, and `sliding_window`: every
layer's query at position i attends to the keys at i - sliding_window < j <= i only (null: the
full causal context). jaxscale builds it as the Llama decoder (`models/decoder/`) with
`model.sliding_window` set (model table entry `mistral`), so the conversion is `hf.py`'s Llama
conversion (`hf_config.llama_config_from_hf`, `hf.llama_leaves`, opened and saved by
`hf.open_decoder` / `hf.save_decoder`) with these fields added; what the Llama
converter refuses (biases, another activation, an unsupported rope scaling) this one refuses
too, and a per-layer mix of sliding and full layers (`layer_types`, Ministral's) as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax.sharding import Mesh

from jaxscale.errors import paragraph
from jaxscale.interop.hf import (
    ConversionError,
    Pretrained,
    decoder_opener,
    decoder_saver,
    llama_leaves,
    load_pretrained,
)
from jaxscale.interop.hf_config import llama_config_from_hf, llama_config_to_hf
from jaxscale.rules import AxisRules

__all__ = ["load_mistral", "mistral_config_from_hf", "mistral_config_to_hf", "open_mistral",
           "save_mistral"]


def mistral_config_from_hf(hf: Mapping[str, Any], where: str = "config.json",
                           name: str = "mistral") -> dict:
    """HF `MistralConfig` fields -> jaxscale `config.model` fields (raises on what we lack)."""
    if hf.get("model_type") != "mistral":
        raise ConversionError(paragraph(
            f"{where}: model_type={hf.get('model_type')!r}; load_mistral reads 'mistral'",
            "checkpoints (use load_llama for 'llama').",
        ))
    window = _window_from_hf(hf.get("sliding_window"), where)
    kinds = set(hf.get("layer_types") or ())
    if len(kinds) > 1:
        raise ConversionError(paragraph(
            f"{where}: layer_types mixes {sorted(kinds)} (some layers local, some global, as",
            "Ministral does); jaxscale's Mistral applies one sliding_window to every layer, so",
            "the converted model would compute different logits. Convert a checkpoint without",
            "layer_types, or whose layer_types are all one kind.",
        ))
    as_llama = {**hf, "model_type": "llama", "sliding_window": None}
    return {**llama_config_from_hf(as_llama, where), "name": "mistral", "sliding_window": window}


def _window_from_hf(window: Any, where: str) -> int:
    """The `sliding_window` of a config.json as `model.sliding_window` (null: 0, full)."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConversionError(paragraph(
            f"{where}: sliding_window={window!r} is not a positive integer (the number of",
            "latest positions a query attends to) nor null (the full context). Fix the value",
            "from the original checkpoint's config.json.",
        ))
    return window


def mistral_config_to_hf(model_cfg: Mapping[str, Any]) -> dict:
    """jaxscale `config.model` -> a `config.json` that `MistralForCausalLM` loads."""
    window = model_cfg.get("sliding_window") or 0
    hf = llama_config_to_hf({**model_cfg, "sliding_window": 0})
    for key in ("attention_bias", "mlp_bias"):  # not MistralConfig fields: Mistral has none
        hf.pop(key)
    return {**hf, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "sliding_window": window or None}


open_mistral = decoder_opener("mistral", mistral_config_from_hf, llama_leaves)
save_mistral = decoder_saver("save_mistral", mistral_config_to_hf, llama_leaves)


def load_mistral(hf_dir: str, mesh: Mesh | None = None, rules: AxisRules | None = None,
                 dtype: Any = None) -> Pretrained:
    """`Pretrained(config, params)` from a Hugging Face Mistral directory (see `load_llama`)."""
    return load_pretrained(open_mistral(hf_dir), mesh, rules, dtype)
