"""Hugging Face directory <-> jaxscale workdir, behind `python -m launch.convert`.

`hf_to_workdir` writes the converted parameters as a params export (`WORKDIR/params/`, the
checksummed format `config.init_from` reads first) plus `WORKDIR/model_config.json`, the
`config.model` fields the weights need. `workdir_to_hf` reads the newest weights of a workdir
(a conversion output, or a training workdir's latest checkpoint), folds LoRA adapters in, and
writes the Hugging Face layout back. Model families are dispatched on HF `model_type` /
jaxscale `model.name` through `FAMILIES`.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from jaxscale.errors import paragraph
from jaxscale.interop import hf
from jaxscale.train.state import flatten, unflatten

MODEL_CONFIG = "model_config.json"


def _families() -> dict[str, tuple[str, Callable, Callable]]:
    """HF model_type -> (jaxscale model name, opener returning a lazy `hf.Source`, saver)."""
    from jaxscale.interop import hf_vit
    return {"llama": ("llama", hf.open_llama, hf.save_llama),
            "vit": ("vit", hf_vit.open_vit, hf_vit.save_vit)}


class LazyLeaf:
    """One parameter of a HF checkpoint, read from disk only when converted to an array.

    The params export converts leaves one at a time (`np.asarray`), so a conversion never
    holds more than one parameter on the host.
    """

    def __init__(self, source: hf.Source, path: str, shape: tuple[int, ...], dtype: Any):
        self.source, self.path, self.shape, self.dtype = source, path, shape, np.dtype(dtype)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self.source.read(self.path, self.shape, self.dtype)
        return arr if dtype is None else arr.astype(dtype)


def lazy_params(source: hf.Source, dtype: Any = None) -> dict[str, LazyLeaf]:
    """{leaf: LazyLeaf} after checking every leaf's shape against config.json."""
    dtype = hf.parse_dtype(dtype) or np.dtype(np.float32)
    out = {}
    for path, shape in source.shapes().items():
        source.check_shape(path, shape)
        out[path] = LazyLeaf(source, path, shape, dtype)
    return out


def hf_to_workdir(hf_dir: str, workdir: str, dtype: Any = None) -> dict:
    """Converts a HF checkpoint directory leaf by leaf; returns the model config written."""
    from jaxscale.init_from import export_params

    model_type = hf.read_hf_config(hf_dir).get("model_type", "llama")
    families = _families()
    if model_type not in families:
        raise hf.ConversionError(paragraph(
            f"{hf_dir}/config.json has model_type={model_type!r}; launch.convert supports",
            f"{sorted(families)}.",
        ))
    source = families[model_type][1](hf_dir)
    params = lazy_params(source, dtype)
    os.makedirs(workdir, exist_ok=True)
    export_params(workdir, params, {"source": os.path.abspath(hf_dir)})
    with open(os.path.join(workdir, MODEL_CONFIG), "w") as f:
        json.dump(source.model_cfg, f, indent=2)
    from jaxscale.tokenizer import copy_tokenizer_files
    copy_tokenizer_files(hf_dir, workdir)  # the converted model carries its tokenizer
    return source.model_cfg


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


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    from absl import logging
    level = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(level)


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
    with _quiet_absl():  # orbax warns that the per-item metadata file is absent: harmless
        meta = checkpointer.metadata(path).item_metadata
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                          dict(meta.tree if hasattr(meta, "tree") else meta))
    with _quiet_absl():
        restored = checkpointer.restore(path, target)
    frozen = flatten(restored.get("frozen") or {})
    if "base_fingerprint" in restored:  # LoRA adapters only: rebuild the base the run used
        frozen = _rebuilt_base(workdir, np.asarray(restored["base_fingerprint"]))
    return {**frozen, **flatten(restored["params"])}


def _rebuilt_base(workdir: str, fingerprint: np.ndarray) -> dict:
    """The frozen base of an adapters-only checkpoint, rebuilt from the run's config.json (its
    `init_from` or seed) and checked against the fingerprint saved with the adapters."""
    import ml_collections as mlc

    from jaxscale.checkpoint import base_fingerprint, fingerprints_match, rebuild_base

    with open(os.path.join(workdir, "config.json")) as f:
        config = mlc.ConfigDict(json.load(f))
    flat = rebuild_base(config)
    if not fingerprints_match(fingerprint, np.asarray(base_fingerprint(flat))):
        raise hf.ConversionError(paragraph(
            f"{workdir}'s checkpoint holds LoRA adapters only (lora.save_adapters_only), and",
            "the base weights rebuilt from its config.json (init_from",
            f"{config.get('init_from') or '(none)'}, seed {config.get('seed')}) are not the ones",
            "the adapters were trained on: the init_from weights changed or moved. Restore them",
            "at that path, or train with --config.lora.save_adapters_only=False to save the base.",
        ))
    return flat


def workdir_to_hf(workdir: str, out_dir: str, dtype: Any = None,
                  max_shard_size: int | str | None = None) -> str:
    """Writes a workdir's newest weights in the HF layout (sharded past `max_shard_size`)."""
    model_cfg, lora_cfg = read_model_config(workdir)
    name = model_cfg.get("name", "llama")
    savers = {jax_name: saver for jax_name, _, saver in _families().values()}
    if name not in savers:
        raise hf.ConversionError(f"model.name={name!r} has no Hugging Face exporter; "
                                 f"supported: {sorted(savers)}.")
    hf.parse_dtype(dtype)  # an unsupported dtype fails before any weights are read
    return savers[name]((model_cfg, workdir_params(workdir, lora_cfg)), out_dir, dtype=dtype,
                        max_shard_size=max_shard_size)


def override_flags(model_cfg: Mapping[str, Any]) -> list[str]:
    """`--config.model.X=V` flags that make launch.train build the converted model."""
    return [f"--config.model.{k}={v}" for k, v in model_cfg.items()]
