"""Hugging Face directory <-> jaxscale workdir, behind `python -m launch.convert`.

`hf_to_workdir` writes the converted parameters as a params export (`WORKDIR/params/`, the
checksummed format `config.init_from` reads first) plus `WORKDIR/model_config.json`, the
`config.model` fields the weights need. `workdir_to_hf` reads the newest weights of a workdir
(a conversion output, or a training workdir's latest checkpoint), folds LoRA adapters in, and
writes the Hugging Face layout back. Model families are dispatched on HF `model_type` /
jaxscale `model.name` through `FAMILIES`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from jaxscale.errors import paragraph
from jaxscale.interop import hf
from jaxscale.train.state import flatten, unflatten

MODEL_CONFIG = "model_config.json"


def _families() -> dict[str, tuple[str, Callable, Callable]]:
    """HF model_type -> (jaxscale model name, loader, saver)."""
    out = {"llama": ("llama", hf.load_llama, hf.save_llama)}
    try:
        from jaxscale.interop import hf_vit
        out["vit"] = ("vit", hf_vit.load_vit, hf_vit.save_vit)
    except ImportError:
        pass
    return out


def hf_to_workdir(hf_dir: str, workdir: str) -> dict:
    """Converts a HF checkpoint directory; returns the model config written beside it."""
    from jaxscale.init_from import export_params

    model_type = hf.read_hf_config(hf_dir).get("model_type", "llama")
    families = _families()
    if model_type not in families:
        raise hf.ConversionError(paragraph(
            f"{hf_dir}/config.json has model_type={model_type!r}; launch.convert supports",
            f"{sorted(families)}.",
        ))
    model_cfg, params = families[model_type][1](hf_dir)
    os.makedirs(workdir, exist_ok=True)
    export_params(workdir, flatten(params), {"source": os.path.abspath(hf_dir)})
    with open(os.path.join(workdir, MODEL_CONFIG), "w") as f:
        json.dump(model_cfg, f, indent=2)
    return model_cfg


def read_model_config(workdir: str) -> tuple[dict, Any]:
    """(config.model fields, config.lora or None) of a conversion output or training workdir."""
    path = os.path.join(workdir, MODEL_CONFIG)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f), None
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise hf.ConversionError(paragraph(
            f"{workdir} has neither {MODEL_CONFIG} (written by launch.convert) nor config.json",
            "(written by launch.train), so the model's shape is unknown. Point --from_workdir at",
            "one of those.",
        ))
    with open(path) as f:
        config = json.load(f)
    return config["model"], config.get("lora")


def workdir_params(workdir: str, lora_cfg: Mapping | None = None) -> dict:
    """Newest parameters of a workdir as a nested dict, LoRA adapters folded in."""
    from jaxscale.init_from import load_flat_params
    from jaxscale.models import lora

    if os.path.isdir(os.path.join(workdir, "checkpoints")):
        flat = latest_checkpoint_params(workdir)
    else:
        flat = load_flat_params(workdir)
    if any(lora.is_adapter(k) for k in flat):
        if not lora_cfg or not lora_cfg.get("rank"):
            raise hf.ConversionError(f"{workdir} holds LoRA adapters but no lora config; "
                                     "export from the training workdir (its config.json).")

        class _Cfg(dict):
            __getattr__ = dict.__getitem__
        return lora.merge(unflatten(flat), _Cfg(lora_cfg))
    return unflatten(flat)


def latest_checkpoint_params(workdir: str) -> dict:
    """Trainable + frozen parameters of a training workdir's newest checkpoint, on one device.

    Restores against a target built from the checkpoint's own metadata, so it works whatever
    mesh or device count the run used (orbax refuses a target-less restore across topologies).
    """
    import jax
    import orbax.checkpoint as ocp

    root = os.path.abspath(os.path.join(workdir, "checkpoints"))
    steps = [int(d) for d in os.listdir(root) if d.isdigit()]
    if not steps:
        raise hf.ConversionError(f"No complete checkpoint under {root}; train with "
                                 "--config.checkpoint.every=N to write one.")
    path = os.path.join(root, str(max(steps)), "state")
    checkpointer = ocp.StandardCheckpointer()
    meta = checkpointer.metadata(path).item_metadata
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                          dict(meta.tree if hasattr(meta, "tree") else meta))
    restored = checkpointer.restore(path, target)
    return {**flatten(restored.get("frozen") or {}), **flatten(restored["params"])}


def workdir_to_hf(workdir: str, out_dir: str, dtype: Any = None) -> str:
    model_cfg, lora_cfg = read_model_config(workdir)
    name = model_cfg.get("name", "llama")
    savers = {jax_name: saver for jax_name, _, saver in _families().values()}
    if name not in savers:
        raise hf.ConversionError(f"model.name={name!r} has no Hugging Face exporter; "
                                 f"supported: {sorted(savers)}.")
    return savers[name](workdir_params(workdir, lora_cfg), model_cfg, out_dir, dtype=dtype)


def override_flags(model_cfg: Mapping[str, Any]) -> list[str]:
    """`--config.model.X=V` flags that make launch.train build the converted model."""
    return [f"--config.model.{k}={v}" for k, v in model_cfg.items()]
