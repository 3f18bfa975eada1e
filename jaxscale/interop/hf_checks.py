"""What a Hugging Face checkpoint must be before anything is converted from it.

Checked from the safetensors headers and config.json, before a tensor is read (so that nothing
is written from a checkpoint that does not match its config): every tensor the conversion reads
is present with the shape config.json implies, and no layer or expert lies beyond config.json's
counts (converting would drop it silently); and, as each tensor is read, no NaN or inf (a model
converted from it would compute NaN). Each refusal is one paragraph naming the file, the tensor
or field and the fix. `hf.Source` asks these of itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxscale.errors import ConversionError, paragraph
from jaxscale.interop.hf_mxfp4 import stored_shapes


def check_finite(reader: Any, name: str, arr: np.ndarray) -> None:
    """Refuses tensor `name` (read from `reader`) when it holds NaN or inf."""
    if arr.dtype.kind == "f" or arr.dtype.name in ("bfloat16", "float8_e4m3fn",
                                                    "float8_e5m2"):
        finite = np.isfinite(arr.astype(np.float32, copy=False))
        if not finite.all():
            nan = int(np.isnan(arr.astype(np.float32, copy=False)).sum())
            raise ConversionError(paragraph(
                f"{reader.file_of(name)}: tensor {name} holds {nan} NaN and",
                f"{int((~finite).sum()) - nan} infinite value(s) (the first at flat index",
                f"{int(np.argmin(finite.reshape(-1)))}); a model converted from it would",
                "compute NaN (generation would print token 0s). The file is corrupt or was",
                "saved after training diverged: fetch it again, or re-save finite weights.",
            ))


def expected_tensors(source: Any) -> dict[str, tuple[tuple[int, ...] | None, str]]:
    """{HF tensor name: (the shape config.json implies, jaxscale leaf)} of every tensor the
    leaves read, from the model definition (nothing is read)."""
    out: dict[str, tuple[tuple[int, ...] | None, str]] = {}
    halves: dict[str, list[tuple[Any, tuple[int, ...]]]] = {}
    for path, shape in source.shapes().items():
        leaf = source.leaves[path]
        layer = shape[1:] if leaf.stacked else shape
        empty = np.empty(layer, dtype=np.uint8)  # untouched pages: no allocation
        hf = leaf.hf_arrays(empty)
        # An import-only leaf (GPT-OSS's gate / up halves of one HF tensor) does not map
        # back to its tensor's shape: `_split_shapes` finds it from all the leaves reading it.
        exact = tuple(leaf.to_jax(*hf).shape) == tuple(layer)
        hf_shapes = [tuple(a.shape) if exact else None for a in hf]
        if not exact and len(leaf.names) == 1:
            halves.setdefault(leaf.names[0], []).append((leaf, tuple(layer)))
        for i in (range(shape[0]) if leaf.stacked else [None]):
            for n, s in zip(leaf.layer_names(i), hf_shapes):
                if out.get(n, (None,))[0] is None:
                    out[n] = (s, path)
    split = {n: _split_shape(parts) for n, parts in halves.items()}
    for name, (shape, path) in out.items():
        unformatted = re.sub(r"\.\d+\.", ".{i}.", name)
        if shape is None and split.get(unformatted) is not None:
            out[name] = (split[unformatted], path)
    return out


def _split_shape(parts: list[tuple[Any, tuple[int, ...]]]) -> tuple[int, ...] | None:
    """The shape of one HF tensor that several leaves take parts of along its last axis
    (GPT-OSS's interleaved gate / up), if reading each leaf from a tensor of that shape gives
    that leaf's shape; else None (its name is then checked for presence only)."""
    first = parts[0][1]
    if not first or any(layer[:-1] != first[:-1] for _, layer in parts):
        return None
    shape = (*first[:-1], sum(layer[-1] for _, layer in parts))
    empty = np.empty(shape, dtype=np.uint8)
    if all(tuple(leaf.to_jax(empty).shape) == layer for leaf, layer in parts):
        return shape
    return None


def check_tensors(source: Any, finite: bool = False) -> None:
    """Every tensor the conversion reads is present with the shape config.json implies,
    and no layer or expert beyond config.json's counts is present (it would be dropped
    silently): one paragraph naming the file, the tensor and the fix, from the safetensors
    headers, before a tensor is read. `finite`: also read every tensor once and refuse
    NaN / inf (`convert` does, so that nothing is written from a corrupt checkpoint)."""
    where = os.path.join(source.reader.directory, "config.json")
    try:
        expected = expected_tensors(source)
    except ConversionError:
        raise
    except (ValueError, TypeError, MemoryError, OverflowError) as e:  # absurd sizes
        raise ConversionError(paragraph(
            f"{where}: the model these sizes describe cannot be built ({type(e).__name__}:",
            f"{str(e)[:150]}); a size field (hidden_size, num_hidden_layers, vocab_size, ...)",
            "is not the model's. Compare config.json with the model's original, or re-save",
            "the model with `save_pretrained`. Nothing was written.")) from None
    _check_extra(source, expected, where)
    for name, (shape, path) in expected.items():
        if name not in source.reader:
            raise ConversionError(paragraph(
                f"Tensor {name} (jaxscale leaf {path}) is missing from the safetensors files",
                f"of {source.reader.directory}, though {where} implies it (the checkpoint has",
                f"{len(source.reader.keys())} tensors, e.g. {sorted(source.reader.keys())[:2]}).",
                "The checkpoint does not match its config.json, or it is not a checkpoint of",
                "this model family: fetch the matching config.json or the missing files.",
                "Nothing was written."))
        for stored, want in stored_shapes(source.reader, name, shape).items():
            got = tuple(source.reader.get_slice(stored).get_shape())
            if want is not None and got != want:
                raise ConversionError(paragraph(
                    f"{source.reader.file_of(stored)}: tensor {stored} has shape {got}, but",
                    f"{where} implies {want} (jaxscale leaf {path}). The tensor and the config",
                    "disagree: the file is corrupt or from another model size; fetch the",
                    "matching safetensors files (or the matching config.json). Nothing was",
                    "written."))
    if finite:
        for name in expected:
            source.get(name)

def _check_extra(source: Any, expected: Mapping[str, Any], where: str) -> None:
    """Tensors of a layer (or an expert) past config.json's count would be dropped."""
    def skeleton(name: str) -> str:
        return re.sub(r"\.\d+\.", ".#.", name)

    shapes = {skeleton(n) for n in expected}
    layers = source.model_cfg.get("num_layers")
    experts = dict(source.model_cfg.get("moe") or {}).get("num_experts") or 0
    for name in sorted(source.reader.keys()):
        if name in expected or skeleton(name) not in shapes:
            continue
        layer = re.search(r"\.layers?\.(\d+)\.", name)
        expert = re.search(r"\.experts\.(\d+)\.", name)
        if (layer and layers is not None  # past the layers and any the family leaves unread
                and int(layer.group(1)) >= layers + getattr(source, "unread_layers", 0)):
            held = 1 + max(int(m.group(1)) for n in source.reader.keys()
                           if (m := re.search(r"\.layers?\.(\d+)\.", n)))
            field, said = "num_hidden_layers", f"num_hidden_layers={layers}"
            count = f"{held} layers"
        elif expert and experts and int(expert.group(1)) >= experts:
            held = 1 + max(int(m.group(1)) for n in source.reader.keys()
                           if (m := re.search(r"\.experts\.(\d+)\.", n)))
            field = "num_local_experts (num_experts for Qwen3-MoE)"
            said, count = f"the expert count is {experts}", f"{held} experts per layer"
        else:
            continue
        raise ConversionError(paragraph(
            f"{where}: {said}, but {source.reader.file_of(name)} holds tensor {name}",
            f"({count}); converting would silently drop them. Set {field} in config.json",
            "to what the checkpoint holds, or pair the safetensors with their",
            "own config.json. Nothing was written."))
