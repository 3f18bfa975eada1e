"""Which Hugging Face converter serves which model, asked of the model table.

Each entry of `jaxscale.models.MODELS` names its Hugging Face opener and saver as
"module:function" (`models.HuggingFace`): `interop/` imports the models, so the models cannot
import their converters, and these two functions import them when a conversion needs one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from jaxscale.errors import paragraph
from jaxscale.interop.hf import ConversionError, read_hf_config
from jaxscale.models import DEFAULT_MODEL, MODELS, entry_of


def _resolve(dotted: str) -> Callable:
    module, name = dotted.split(":")
    return getattr(importlib.import_module(module), name)


def opener(hf_dir: str) -> Callable[[str], Any]:
    """The opener of a HF directory's family, by its config.json `model_type` (the default
    model's when the config has none)."""
    families = {e.hf.model_type: e.hf for e in MODELS.values() if e.hf is not None}
    model_type = read_hf_config(hf_dir).get("model_type", MODELS[DEFAULT_MODEL].hf.model_type)
    if model_type not in families:
        raise ConversionError(paragraph(
            f"{hf_dir}/config.json has model_type={model_type!r}; jaxscale converts",
            f"{sorted(families)}.",
        ))
    return _resolve(families[model_type].opener)


def saver(model_cfg: Mapping[str, Any]) -> Callable[..., str]:
    """The saver writing the Hugging Face layout of a `config.model` section's family."""
    hf = entry_of(model_cfg).hf
    if hf is None:
        name = model_cfg.get("name", DEFAULT_MODEL)
        exporters = sorted(n for n, e in MODELS.items() if e.hf is not None)
        raise ConversionError(f"model.name={name!r} has no Hugging Face exporter; "
                              f"supported: {exporters}.")
    return _resolve(hf.saver)
