"""LoRA adapters as a Hugging Face PEFT adapter: `adapter_config.json` + `adapter_model.safetensors`.

    write_adapter(model_cfg, lora_cfg, adapters, leaf_shapes, out_dir, base_model=..., dtype=None)

Why: `--to_hf` folds the adapters into the weights, which is a full model per fine-tune; a PEFT
adapter is megabytes that `peft.PeftModel.from_pretrained(base, DIR)` puts on the Hugging Face
base model the run started from. The round trip is where users meet shape and name mismatches,
so nothing here names a Hugging Face tensor by hand: the family's own leaf table (`interop/hf.py`
and the family modules, through the model table's saver) is the one place that knows how a
jaxscale weight becomes Hugging Face tensors.

How: jaxscale's adapter pair of a weight W (in dims.., out dims..) is A (in.., r), B (r, out..)
with W + (alpha / r) A.B; PEFT's is lora_A (r, in) and lora_B (out, r) on a `nn.Linear` weight
(out, in) with W + (lora_alpha / r) lora_B @ lora_A, the same scale. Every leaf conversion is a
reshape / transpose / split (a permutation of entries), so converting W's *flat indices* through
the leaf table says which jaxscale input and output each Hugging Face column and row is. The
adapters are then gathered by those indices, exactly (no factorisation, no rounding), and a leaf
whose permutation mixes inputs with outputs, or whose tensor is not a 2-D linear weight (a
mixture's experts, held as one fused 3-D parameter by transformers >= 5), is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxscale.errors import ConversionError, paragraph

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel wraps the HF model: its state-dict keys start here


@dataclass(frozen=True)
class Placement:
    """Where one jaxscale adapted weight lands in Hugging Face: which of the leaf's tensors
    (`index` into `Leaf.layer_names`), and for each HF column / row the flat jaxscale input /
    output it holds."""

    leaf: Any      # interop.hf.Leaf
    index: int
    in_of: np.ndarray   # (in_hf,) flat jaxscale input index of each HF column
    out_of: np.ndarray  # (out_hf,) flat jaxscale output index of each HF row


def _leaf_of(path: str, leaves: Mapping[str, Any]) -> tuple[str, Any, str | None]:
    """(leaf path, Leaf, fused part name or None) of the adapted weight `path` (`layers/attn/wq`
    is the part `wq` of `layers/attn/wqkv`, `nn/fused.py`)."""
    from jaxscale.models.nn.fused import LLAMA_FUSED

    if path in leaves:
        return path, leaves[path], None
    parent, name = path.rsplit("/", 1) if "/" in path else ("", path)
    for fused_name, fused in LLAMA_FUSED.items():
        module, fused_leaf = fused_name.split("/")
        candidate = f"{parent}/{fused_leaf}"
        if parent.rsplit("/", 1)[-1] == module and name in fused.parts and candidate in leaves:
            return candidate, leaves[candidate], name
    raise ConversionError(paragraph(
        f"--to_peft: the adapted weight {path} has no Hugging Face tensor in its family's",
        "converter, so PEFT cannot name it. Export the merged model with --to_hf instead."))


def placement(path: str, leaves: Mapping[str, Any], leaf_shape: tuple[int, ...],
              in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Placement:
    """Where the adapted weight `path` (one layer: `in_shape` + `out_shape`) lands, found by
    converting its flat indices through the leaf table (`leaf_shape`: the leaf's one-layer
    shape, the fused one for a part)."""
    from jaxscale.models.nn.fused import LLAMA_FUSED

    leaf_path, leaf, part = _leaf_of(path, leaves)
    n_in, n_out = int(np.prod(in_shape)), int(np.prod(out_shape))
    idx = np.arange(n_in * n_out, dtype=np.int64).reshape(in_shape + out_shape)
    if part is not None:
        fused = LLAMA_FUSED["/".join(leaf_path.split("/")[-2:])]
        parts = fused.split(np.full(leaf_shape, -1, np.int64))
        idx = fused.join(*[idx if p == part else x for p, x in zip(fused.parts, parts)])
    tensors = leaf.hf_arrays(idx)
    held = [i for i, t in enumerate(tensors) if (np.asarray(t) >= 0).all()]
    t = np.asarray(tensors[held[0]]) if len(held) == 1 else None
    if t is None or t.ndim != 2 or t.size != n_in * n_out:
        raise ConversionError(paragraph(
            f"--to_peft: the adapted weight {path} is not one 2-D linear weight in Hugging Face",
            f"({leaf.layer_names(0)}), so PEFT's LoRA (lora_A, lora_B on an nn.Linear) cannot",
            "hold it. Export the merged model with --to_hf instead."))
    in_of, out_of = t // n_out, t % n_out  # HF (out, in): rows are outputs, columns inputs
    if not ((in_of == in_of[:1]).all() and (out_of == out_of[:, :1]).all()):
        raise ConversionError(paragraph(
            f"--to_peft: the Hugging Face layout of {path} mixes its input and output",
            "dimensions, so a rank-r adapter pair has no PEFT form there. Export the merged",
            "model with --to_hf instead."))
    return Placement(leaf, held[0], in_of[0], out_of[:, 0])


def peft_tensors(model_cfg: Mapping[str, Any], adapters: Mapping[str, np.ndarray],
                 leaf_shapes: Mapping[str, tuple[int, ...]]
                 ) -> tuple[dict[str, np.ndarray], list[str]]:
    """({PEFT state-dict key: array}, adapted HF module names) of the flat jaxscale adapters
    (`..._lora_a` / `..._lora_b` with a leading `layers` dimension where the leaf is stacked);
    `leaf_shapes`: the full shape of every base leaf (the fused ones included)."""
    from jaxscale.models import hf_saver

    saver = hf_saver(model_cfg)
    leaves_of = getattr(saver, "leaves_of", None)
    if leaves_of is None:
        raise ConversionError(paragraph(
            f"--to_peft writes adapters for the decoder families; model.name="
            f"{model_cfg.get('name')!r} has no decoder leaf table. Export the merged model",
            "with --to_hf instead."))
    leaves = leaves_of(model_cfg)
    out, modules = {}, []
    for key in sorted(k for k in adapters if k.endswith("_lora_a")):
        path = key[: -len("_lora_a")]
        a, b = np.asarray(adapters[key]), np.asarray(adapters[path + "_lora_b"])
        if path.endswith(("mlp/w_gate", "mlp/w_up", "mlp/w_down")) and (
                path.rsplit("/", 1)[0] + "/router") in leaf_shapes:
            raise ConversionError(paragraph(
                f"--to_peft: {path} holds one adapter pair per expert (a mixture of experts).",
                "transformers holds a mixture's experts as one fused 3-D parameter, which PEFT's",
                "LoRA does not wrap as separate linear layers, so these adapters have no PEFT",
                "form. Export the merged model with --to_hf, or train with lora.targets that",
                "leave the experts out (e.g. 'attn/w[qkvo]$')."))
        leaf_path, leaf, _ = _leaf_of(path, leaves)
        lead = 1 if leaf.stacked else 0
        rank = a.shape[-1]
        in_shape, out_shape = a.shape[lead:-1], b.shape[lead + 1:]
        where = placement(path, leaves, tuple(leaf_shapes[leaf_path][lead:]), in_shape,
                          out_shape)
        a2 = a.reshape(a.shape[:lead] + (-1, rank))
        b2 = b.reshape(b.shape[:lead] + (rank, -1))
        layers = range(a.shape[0]) if lead else [None]
        for i in layers:
            name = where.leaf.layer_names(i)[where.index]
            module = name.removesuffix(".weight")
            ai, bi = (a2[i], b2[i]) if lead else (a2, b2)
            out[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(ai[where.in_of].T)
            out[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(bi[:, where.out_of].T)
            modules.append(module)
    if not out:
        raise ConversionError("--to_peft: the weights hold no LoRA adapters; export the model "
                              "with --to_hf instead.")
    return out, modules


def target_modules(modules: list[str], all_names: list[str]) -> list[str]:
    """PEFT's `target_modules`: the short names (`q_proj`) when each names exactly the adapted
    modules among every linear weight of the model (PEFT matches them as name suffixes), else
    the full module names."""
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    matched = {n.removesuffix(".weight") for n in all_names
               if n.endswith(".weight") and n.removesuffix(".weight").rsplit(".", 1)[-1] in short}
    return short if matched == set(modules) else sorted(set(modules))


def adapter_config(model_cfg: Mapping[str, Any], lora_cfg: Mapping[str, Any],
                   targets: list[str], base_model: str | None) -> dict:
    """The `adapter_config.json` PEFT's `LoraConfig` reads (the fields it writes itself)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(lora_cfg["rank"]), "lora_alpha": float(lora_cfg["alpha"]),
        "lora_dropout": float(lora_cfg.get("dropout", 0.0)),
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
        "use_rslora": False, "use_dora": False, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
        "auto_mapping": None,
    }


def all_hf_names(model_cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Every Hugging Face tensor name of the model (from the leaf table, nothing read)."""
    from jaxscale.models import hf_saver

    leaves = hf_saver(model_cfg).leaves_of(model_cfg)
    names = []
    for leaf in leaves.values():
        for i in (range(num_layers) if leaf.stacked else [None]):
            names += list(leaf.layer_names(i))
    return names


def check_empty(out_dir: str, overwrite: bool) -> None:
    """A non-empty output directory is refused unless `overwrite`: an adapter beside another
    model's files (or an older adapter's extra shards) would be loaded as one."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConversionError(paragraph(
            f"--to_peft={out_dir} names an existing file, not a directory. Give a new or empty",
            "directory for the adapter (the file is left untouched)."))
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConversionError(paragraph(
            f"--to_peft={out_dir} is not empty ({', '.join(sorted(os.listdir(out_dir))[:4])}",
            "...). The adapter's files would mix with what is there; give a new or empty",
            "directory, or add --overwrite to replace the adapter files in it."))


def write_adapter(model_cfg: Mapping[str, Any], lora_cfg: Mapping[str, Any],
                  adapters: Mapping[str, np.ndarray], leaf_shapes: Mapping[str, tuple[int, ...]],
                  out_dir: str, base_model: str | None = None, dtype: Any = None) -> str:
    """Writes `adapter_config.json` + `adapter_model.safetensors` for PEFT; returns `out_dir`."""
    from jaxscale.interop.safetensors_io import write_safetensors

    tensors, modules = peft_tensors(model_cfg, adapters, leaf_shapes)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    num_layers = int(model_cfg.get("num_layers", 0))
    config = adapter_config(model_cfg, lora_cfg,
                            target_modules(modules, all_hf_names(model_cfg, num_layers)),
                            base_model)
    os.makedirs(out_dir, exist_ok=True)
    specs = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    write_safetensors(os.path.join(out_dir, ADAPTER_WEIGHTS), specs, iter(tensors.values()))
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
