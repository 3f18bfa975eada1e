"""Hugging Face checkpoints <-> jaxscale parameters (safetensors, no torch needed).

    model = load(hf_dir, mesh=None, rules=None, dtype=None)   # Pretrained(config, params)
    save(model, out_dir, dtype=None, max_shard_size=None)

`load` reads `config.json` and `model.safetensors` (or a sharded `model.safetensors.index.json`)
of any supported architecture, by its `model_type` through the model table (`models.hf_opener`:
llama, mistral, qwen2, qwen3, gemma2, gemma3_text, the MoE families, vit), and returns
`Pretrained(config, params)` (a named tuple, so `model_cfg, params = load(...)` also works): the
fields to put in `config.model` and the nested parameter dict that `ModelDef.module` binds.
Tensors are read with `safetensors`, one parameter at a time; with a mesh, each parameter is
assembled only for the shards this process holds and placed straight into the NamedSharding its
logical axes resolve to, so at most one parameter's host copy exists at any time and a model
larger than one device loads onto a mesh. `save` streams the layout of the model's family
(by `config.model.name`, `models.hf_saver`) back (sharded files past `max_shard_size`); a round
trip reproduces the original tensors bit for bit. `launch.convert` goes the same two ways.

The machinery here (`Leaf`, `Source`, `load_pretrained`, `save_tensors`) is every family's; a
decoder family (`hf_mistral.py`, `hf_qwen.py`, `hf_gemma.py`, `hf_moe.py`) is only its config
mapping (`hf_config.py` holds the Llama decoder's) and its leaf table, opened and saved by
`open_decoder` / `save_decoder`. Placement on a mesh is `jaxscale.weights.place`, and
`jaxscale.weights.sources.open_weights` reads a HF directory like any other saved weights.

jaxscale's Llama uses the Hugging Face "rotate half" rotary layout, so q/k need no permutation:
every weight is only transposed and reshaped (q/k/v and gate/up are also joined into the fused
`wqkv` / `w_gate_up` on import and split on export, `models/nn/fused.py`: exact, so round trips
stay bit for bit). Configurations the model cannot reproduce are rejected in one paragraph
naming the field, never approximated.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from jaxscale.errors import paragraph
from jaxscale.interop.hf_checks import check_finite, check_tensors, expected_tensors
from jaxscale.interop.hf_config import llama_config_from_hf, llama_config_to_hf
from jaxscale.interop.safetensors_io import (
    ConversionError,
    SafetensorsReader,
    parse_dtype,
    write_checkpoint_files,
)
from jaxscale.models.nn.fused import GATE_UP, QKV
from jaxscale.rules import AxisRules, normalize_rules
from jaxscale.weights.leaf import Leaf as LazyLeaf
from jaxscale.weights.place import named_shardings, param_specs, place
from jaxscale.weights.sources import open_huggingface, read_hf_config
from jaxscale.weights.tree import flatten, unflatten

__all__ = ["ConversionError", "Pretrained", "SafetensorsReader", "load", "load_llama", "save",
           "save_llama", "open_llama", "parse_dtype"]


class Pretrained(NamedTuple):
    """A converted model: its `config.model` fields and its nested parameters."""

    config: dict
    params: dict


# ----------------------------------------------------------------------------- weight layout
@dataclass(frozen=True)
class Leaf:
    """One jaxscale parameter: its HF tensor name (with `{i}` for stacked layers) and the
    transforms between the HF tensor of one layer and jaxscale's layout of that layer. A fused
    parameter (`models/nn/fused.py`) names several HF tensors: `to_jax` then takes them all (in
    `hf_name` order) and `to_hf` returns them as a tuple."""

    hf_name: str | tuple[str, ...]
    to_jax: Callable[..., np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray | tuple[np.ndarray, ...]]
    stacked: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return (self.hf_name,) if isinstance(self.hf_name, str) else self.hf_name

    def layer_names(self, i: int | None) -> tuple[str, ...]:
        return tuple(n.format(i=i) for n in self.names) if self.stacked else self.names

    def from_hf(self, get: Callable[[str], np.ndarray], i: int | None = None) -> np.ndarray:
        """jaxscale's layout of layer `i` (or of an unstacked leaf), reading through `get`."""
        return self.to_jax(*[get(n) for n in self.layer_names(i)])

    def hf_arrays(self, w: np.ndarray) -> tuple[np.ndarray, ...]:
        out = self.to_hf(w)
        return out if isinstance(self.hf_name, tuple) else (out,)


def llama_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """{jaxscale path: Leaf} for every parameter of a Llama with `model_cfg`. q/k/v and
    gate/up are stored fused (`models/nn/fused.py`): they join and split their HF tensors."""
    h, k, d, e = (model_cfg[n] for n in ("num_heads", "num_kv_heads", "head_dim", "embed"))
    ident = lambda x: x
    p = "model.layers.{i}."
    q_in, q_out = _heads_in(h, e, d)
    kv_in, kv_out = _heads_in(k, e, d)
    leaves = {
        "embedding": Leaf("model.embed_tokens.weight", ident, ident, stacked=False),
        "final_norm/scale": Leaf("model.norm.weight", ident, ident, stacked=False),
        "layers/attn_norm/scale": Leaf(p + "input_layernorm.weight", ident, ident),
        "layers/mlp_norm/scale": Leaf(p + "post_attention_layernorm.weight", ident, ident),
        "layers/attn/wqkv": Leaf(  # HF q (H*D, E), k, v (K*D, E) <-> (E, K, G + 2, D)
            tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv"),
            lambda q, k_, v: QKV.join(q_in(q), kv_in(k_), kv_in(v)),
            lambda w: tuple(f(x) for f, x in zip((q_out, kv_out, kv_out), QKV.split(w)))),
        "layers/attn/wo": Leaf(p + "self_attn.o_proj.weight",  # (E, H*D) <-> (H, D, E)
                               lambda w: w.T.reshape(h, d, e), lambda w: w.reshape(h * d, e).T),
        "layers/mlp/w_gate_up": Leaf(  # HF gate, up (F, E) <-> (E, 2, F)
            (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            lambda g, u: GATE_UP.join(g.T, u.T), lambda w: tuple(x.T for x in GATE_UP.split(w))),
        "layers/mlp/w_down": Leaf(p + "mlp.down_proj.weight", _t, _t),
    }
    if not model_cfg["tie_embeddings"]:
        leaves["lm_head"] = Leaf("lm_head.weight", _t, _t, stacked=False)
    return leaves


def _t(w: np.ndarray) -> np.ndarray:
    return w.T


def _heads_in(n: int, e: int, d: int) -> tuple[Callable, Callable]:
    """q/k/v projections: HF (n*D, E) <-> jaxscale (E, n, D)."""
    return lambda w: w.T.reshape(e, n, d), lambda w: w.reshape(e, n * d).T


# ----------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class Source:
    """An opened HF checkpoint: model config, lazy tensor reader, and the leaf mapping."""

    model_cfg: dict
    reader: SafetensorsReader
    leaves: dict[str, Leaf]
    # Layers past num_layers that the family's checkpoints hold and the model does not read
    # (DeepSeek-V3's multi-token-prediction layers): not "dropped" by `_check_extra`.
    unread_layers: int = 0

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """jaxscale shape of every leaf, from the model definition (no tensor is read)."""
        shapes = {k: tuple(v.shape) for k, v in _model_def(self.model_cfg).shapes().items()}
        if set(shapes) != set(self.leaves):
            raise ConversionError(f"Internal mapping mismatch: model leaves {sorted(shapes)} vs "
                                  f"converted leaves {sorted(self.leaves)}.")
        return shapes

    def get(self, name: str) -> np.ndarray:
        """HF tensor `name`, refused in one paragraph when it holds NaN or inf (a model
        converted from it would compute NaN: generation would print token 0s)."""
        arr = self.reader.get(name)
        check_finite(self.reader, name, arr)
        return arr

    def read(self, path: str, shape: tuple[int, ...], dtype: Any,
             index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The part `index` (default: all) of leaf `path`, reading only the layers it covers."""
        leaf = self.leaves[path]
        index = index or (slice(None),) * len(shape)
        if not leaf.stacked:
            return np.asarray(leaf.from_hf(self.get)[index], dtype=dtype)
        layers = range(*index[0].indices(shape[0]))
        return np.stack([np.asarray(leaf.from_hf(self.get, i)[index[1:]], dtype=dtype)
                         for i in layers])

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...] | None, str]]:
        """{HF tensor name: (the shape config.json implies, jaxscale leaf)} (`hf_checks.py`)."""
        return expected_tensors(self)

    def check_tensors(self, finite: bool = False) -> None:
        """Names, shapes and counts against config.json before a tensor is read; `finite`:
        every tensor read once and NaN / inf refused (`hf_checks.py`)."""
        check_tensors(self, finite)

    def lazy_leaves(self, dtype: Any) -> dict[str, LazyLeaf]:
        """{path: Leaf} in `dtype` after checking every tensor's name and shape against
        config.json (`check_tensors`); a part of a stacked leaf reads only the layers it
        covers, and a NaN or inf read is refused (`get`)."""
        self.check_tensors()
        out = {}
        for path, shape in self.shapes().items():
            self.check_shape(path, shape)
            read = lambda index, p=path, s=shape: self.read(p, s, dtype, index)
            out[path] = LazyLeaf(shape, dtype, read, reads_slices=True)
        return out

    def check_shape(self, path: str, expected: tuple[int, ...]) -> None:
        leaf = self.leaves[path]
        name = ", ".join(leaf.layer_names(0))
        got = tuple(leaf.from_hf(self.reader.get, 0).shape)  # names and HF shapes checked
        if got != tuple(expected[1:] if leaf.stacked else expected):
            raise ConversionError(paragraph(
                f"Tensor {name} converts to shape {got} for jaxscale leaf {path}, but config.json",
                f"implies {tuple(expected)}. The checkpoint and its config.json disagree.",
            ))


def _model_def(model_cfg: Mapping[str, Any]):
    from jaxscale.models import ModelDef
    from jaxscale.precision import get_policy
    return ModelDef.build(model_cfg, get_policy("32-true"))


def load_pretrained(source: Source, mesh: Mesh | None = None, rules: AxisRules | None = None,
                    dtype: Any = None) -> Pretrained:
    """Every leaf of `source` on the host, or placed on `mesh` by `rules` (`weights.place`
    reads only the blocks this process's devices hold)."""
    leaves = source.lazy_leaves(parse_dtype(dtype) or np.dtype(np.float32))
    if mesh is None:
        return Pretrained(dict(source.model_cfg), unflatten({k: v.read() for k, v in
                                                             leaves.items()}))
    specs = param_specs(_model_def(source.model_cfg), rules or default_rules(), mesh)
    placed = place(leaves, named_shardings(mesh, specs), {k: v.dtype for k, v in leaves.items()})
    return Pretrained(dict(source.model_cfg), unflatten(placed))


def default_rules() -> AxisRules:
    from jaxscale.config import DEFAULT_RULES
    return AxisRules(normalize_rules(DEFAULT_RULES))


def load(path: str, mesh: Mesh | None = None, rules: AxisRules | None = None,
         dtype: Any = None, mtp: bool = False) -> Pretrained:
    """`Pretrained(config, params)` of a Hugging Face directory of any supported architecture,
    read by the converter the model table names for its config.json `model_type` (an unknown
    one is a ConversionError listing those supported). With `mesh`, every parameter is a
    jax.Array sharded by `rules` (default: DEFAULT_RULES); without, host numpy arrays. `dtype`
    ('bf16', 'float32', ...) defaults to float32 (the 32-true parameter dtype). `mtp`: read a
    DeepSeek-V3 checkpoint's multi-token-prediction layer too (`hf_deepseek.py`)."""
    return load_pretrained(open_huggingface(path, **({"mtp": True} if mtp else {})), mesh,
                           rules, dtype)


def save(model: Pretrained | tuple[Mapping, Mapping], out_dir: str, dtype: Any = None,
         max_shard_size: int | str | None = None, mtp: bool = False) -> str:
    """Writes `model` (a `Pretrained`, or a (config.model, params) pair) as the Hugging Face
    directory of its family, by `config.model.name` through the model table: `config.json` +
    safetensors (sharded past `max_shard_size`, e.g. '5GB'), in `dtype` if given. Gathers one
    parameter to the host at a time, so call it from a single process. `mtp`: write a
    DeepSeek-V3 model's multi-token-prediction module too (left out by default)."""
    from jaxscale.models import hf_saver
    model_cfg, _ = unpack(model, "save")
    saver = hf_saver(model_cfg)
    if mtp and "mtp" not in inspect.signature(saver).parameters:
        raise ConversionError(paragraph(
            f"save(mtp=True): model.name={model_cfg.get('name')!r} has no multi-token-prediction",
            "layer in its Hugging Face layout (only deepseek_v3 does). Save without mtp."))
    return saver(model, out_dir, dtype=dtype, max_shard_size=max_shard_size,
                 **({"mtp": True} if mtp else {}))


def load_llama(hf_dir: str, mesh: Mesh | None = None, rules: AxisRules | None = None,
               dtype: Any = None) -> Pretrained:
    """`Pretrained(config, params)` from a Hugging Face Llama directory.

    With `mesh`, every parameter is a jax.Array sharded by `rules` (default: DEFAULT_RULES);
    without, host numpy arrays. `dtype` ('bf16', 'float32', ...) defaults to float32 (the
    32-true parameter dtype).
    """
    return load_pretrained(open_llama(hf_dir), mesh, rules, dtype)


# ----------------------------------------------------------------------------- saving
def hf_tensors(flat_params: Mapping[str, Any], leaves: Mapping[str, Leaf], dtype: Any = None
               ) -> tuple[list[tuple[str, tuple, np.dtype]], Iterator[np.ndarray]]:
    """(specs, arrays): HF names/shapes/dtypes, and the host arrays gathered one at a time."""
    specs = []
    for path, leaf in leaves.items():
        v = flat_params[path]
        dt = np.dtype(dtype or v.dtype)
        empty = np.empty(v.shape[1:] if leaf.stacked else v.shape, dtype=np.uint8)
        shapes = [a.shape for a in leaf.hf_arrays(empty)]  # untouched pages: no allocation
        for i in (range(v.shape[0]) if leaf.stacked else [None]):
            specs += [(n, tuple(s), dt) for n, s in zip(leaf.layer_names(i), shapes)]

    def arrays() -> Iterator[np.ndarray]:
        for path, leaf in leaves.items():
            arr = np.asarray(jax.device_get(flat_params[path]))
            arr = arr.astype(dtype) if dtype is not None else arr
            for layer in (arr if leaf.stacked else [arr]):
                yield from (np.ascontiguousarray(a) for a in leaf.hf_arrays(layer))

    return specs, arrays()


def unpack(model: Any, fn: str) -> tuple[dict, dict]:
    """(config, flat params) of a `Pretrained` or a (config, params) pair."""
    if not (isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], Mapping)
            and isinstance(model[1], Mapping)):
        raise ConversionError(f"{fn}(model, out_dir): model must be the Pretrained(config, "
                              f"params) that load_* returns, or a (config, params) pair; got "
                              f"{type(model).__name__}.")
    return dict(model[0]), flatten(model[1])


def save_tensors(flat: Mapping[str, Any], leaves: Mapping[str, Leaf], hf_config: dict,
                 out_dir: str, dtype: Any = None, max_shard_size: int | str | None = None
                 ) -> str:
    """Writes config.json + safetensors (sharded past `max_shard_size`, e.g. '5GB')."""
    missing = sorted(set(leaves) - set(flat))
    if missing:
        raise ConversionError(paragraph(
            f"Parameters {missing[:4]} are missing (got {sorted(flat)[:4]}...). Pass the full",
            "parameter tree (merge LoRA adapters and frozen parts first) together with the",
            "model config it was built from.",
        ))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ConversionError(paragraph(
            f"{out_dir} cannot be created ({e.strerror or e}): a read-only filesystem, a path",
            "below a regular file, or no permission. Give a writable directory path.",
        )) from None
    specs, arrays = hf_tensors(flat, leaves, parse_dtype(dtype))
    hf_config["torch_dtype"] = {"bfloat16": "bfloat16", "float16": "float16"}.get(
        specs[0][2].name, "float32")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    write_checkpoint_files(out_dir, specs, arrays, max_shard_size)
    return out_dir


# ----------------------------------------------------------------------------- decoder families
ConfigFromHF = Callable[..., dict]  # (hf, where=, name=) -> config.model fields; raises
LeavesOf = Callable[[Mapping[str, Any]], dict[str, Leaf]]  # config.model -> {path: Leaf}


def open_decoder(hf_dir: str, name: str, config_from_hf: ConfigFromHF, leaves_of: LeavesOf
                 ) -> Source:
    """The validated config and lazy reader of a HF directory of the decoder family `name`
    (no tensor read yet): a family is only its config mapping and its leaf table."""
    where = os.path.join(hf_dir, "config.json")
    model_cfg = config_from_hf(read_hf_config(hf_dir), where=where, name=name)
    return Source(model_cfg, SafetensorsReader(hf_dir), leaves_of(model_cfg))


def save_decoder(model: Pretrained | tuple[Mapping, Mapping], out_dir: str,
                 config_to_hf: Callable[[Mapping[str, Any]], dict], leaves_of: LeavesOf,
                 dtype: Any = None, max_shard_size: int | str | None = None,
                 fn: str = "save", names: tuple[str, ...] = ()) -> str:
    """Writes a decoder family's `config.json` + safetensors; `names`: the `model.name`s this
    family writes (a model of another is refused, naming `fn`; empty: any)."""
    model_cfg, flat = unpack(model, fn)
    if names and model_cfg.get("name") not in names:
        raise ConversionError(f"{fn}: model.name={model_cfg.get('name')!r} is not one of "
                              f"{sorted(names)}; use the saver of its family.")
    return save_tensors(flat, leaves_of(model_cfg), config_to_hf(model_cfg), out_dir, dtype,
                        max_shard_size)


def decoder_opener(name: str, config_from_hf: ConfigFromHF, leaves_of: LeavesOf
                   ) -> Callable[[str], Source]:
    """The model table's opener (hf_dir -> Source) of the decoder family `name`."""
    def opener(hf_dir: str) -> Source:
        return open_decoder(hf_dir, name, config_from_hf, leaves_of)
    opener.__name__ = opener.__qualname__ = f"open_{name}"
    opener.__doc__ = f"The config and lazy reader of a HF {name} directory (validated)."
    return opener


def decoder_saver(fn: str, config_to_hf: Callable[[Mapping[str, Any]], dict],
                  leaves_of: LeavesOf, names: tuple[str, ...] = ()) -> Callable[..., str]:
    """The model table's saver (model, out_dir, dtype=, max_shard_size=) of a decoder family
    (`save_decoder`); parameters keep their dtype unless `dtype` is given (e.g. 'bf16'), and
    one parameter at a time is gathered to the host, so call it from a single process."""
    def saver(model: Pretrained | tuple[Mapping, Mapping], out_dir: str, dtype: Any = None,
              max_shard_size: int | str | None = None) -> str:
        return save_decoder(model, out_dir, config_to_hf, leaves_of, dtype, max_shard_size,
                            fn, names)
    saver.__name__ = saver.__qualname__ = fn
    saver.leaves_of = leaves_of  # the leaf table, for writers of other layouts (interop/peft.py)
    saver.__doc__ = (f"Writes the Hugging Face `config.json` + safetensors of a "
                     f"{'/'.join(names) or fn.removeprefix('save_')} model (`hf.save_decoder`).")
    return saver


open_llama = decoder_opener("llama", llama_config_from_hf, llama_leaves)
save_llama = decoder_saver("save_llama", llama_config_to_hf, llama_leaves)


def num_bytes(params: Mapping) -> int:
    return sum(math.prod(np.shape(v)) * np.dtype(v.dtype).itemsize
               for v in flatten(params).values())
