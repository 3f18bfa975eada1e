"""Hugging Face Llama checkpoints <-> jaxscale Llama parameters (safetensors, no torch needed).

`load_llama(hf_dir, mesh, rules)` reads `config.json` and `model.safetensors` (or a sharded
`model.safetensors.index.json`) and returns `(model_cfg, params)`: the dict to put in
`config.model` and the nested parameter dict that `ModelDef.module` binds. The safetensors files
are memory-mapped and read one tensor (one layer) at a time; with a mesh, each parameter is
assembled only for the shards this process holds and placed straight into the NamedSharding its
logical axes resolve to, so at most one parameter's host copy exists at any time and a model
larger than one device loads onto a mesh. `save_llama` writes the same layout back; a round
trip reproduces the original tensors bit for bit.

jaxscale's Llama uses the Hugging Face "rotate half" rotary layout, so q/k need no permutation:
every weight is only transposed and reshaped. Configurations the model cannot reproduce
(rope scaling, attention or MLP biases, another activation) are rejected, never approximated.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.rules import AxisRules, normalize_rules
from jaxscale.train.state import flatten, unflatten


class ConversionError(JaxscaleError):
    """A Hugging Face checkpoint cannot be converted faithfully."""


# ----------------------------------------------------------------------------- safetensors I/O
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32, "I16": np.int16,
           "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
           "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
# `--dtype` spellings -> numpy dtype names (the export / storage dtypes that make sense).
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                 "f16": "float16", "half": "float16", "float16": "float16", "fp32": "float32",
                 "f32": "float32", "float": "float32", "float32": "float32"}


def parse_dtype(name: Any) -> np.dtype | None:
    """A dtype from a user's spelling ('bf16', 'fp16', 'float32', a numpy dtype); None -> None.

    Raises a ConversionError listing the accepted names, rather than numpy's bare TypeError.
    """
    if name is None or name == "":
        return None
    if not isinstance(name, str):
        return np.dtype(name)
    key = name.strip().lower()
    if key not in DTYPE_ALIASES:
        raise ConversionError(paragraph(
            f"dtype {name!r} is not supported for checkpoints. Use one of",
            f"{', '.join(sorted(DTYPE_ALIASES))} (e.g. --dtype=bf16), or leave it unset to keep",
            "the stored dtype.",
        ))
    return np.dtype(ml_dtypes.bfloat16) if DTYPE_ALIASES[key] == "bfloat16" else np.dtype(
        DTYPE_ALIASES[key])


class SafetensorsReader:
    """Lazy reader over one checkpoint directory: tensors are memory-mapped, read on demand.

    Implements the safetensors layout directly (8-byte little-endian header size, JSON header,
    raw little-endian data) so bfloat16 checkpoints load as `ml_dtypes.bfloat16` without torch.
    """

    def __init__(self, directory: str):
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(directory, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise ConversionError(paragraph(
                f"{directory} holds neither model.safetensors nor model.safetensors.index.json.",
                "Point at a Hugging Face model directory saved with `save_pretrained`",
                "(safetensors; PyTorch .bin files are not read because they are pickles).",
            ))
        self.entries: dict[str, tuple[str, int, dict]] = {}
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            for key, info in header.items():
                self.entries[key] = (path, 8 + size, info)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> np.ndarray:
        if key not in self.entries:
            raise ConversionError(paragraph(
                f"Tensor {key!r} is missing from the checkpoint (it has {len(self.entries)}",
                f"tensors, e.g. {sorted(self.entries)[:3]}). The checkpoint does not match its",
                "config.json, or it is not a Llama checkpoint.",
            ))
        path, base, info = self.entries[key]
        if info.get("dtype") not in _DTYPES:
            raise ConversionError(paragraph(
                f"Tensor {key!r} in {path} has safetensors dtype {info.get('dtype')!r}, which",
                f"this reader does not know (it reads {', '.join(_DTYPES)}). Re-save the",
                "checkpoint in float32, float16 or bfloat16 (e.g. `model.to(torch.bfloat16)",
                ".save_pretrained(DIR)`).",
            ))
        dtype = np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == start:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=shape)


def write_safetensors(path: str, specs: list[tuple[str, tuple[int, ...], np.dtype]],
                      arrays: Iterator[np.ndarray]) -> None:
    """Writes the safetensors layout from (name, shape, dtype) specs and a stream of arrays in
    the same order, so only one array is on the host at a time."""
    header, offset = {}, 0
    for key, shape, dtype in specs:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[key] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for (key, shape, dtype), arr in zip(specs, arrays, strict=True):
            if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
                raise ConversionError(f"{key}: expected {shape} {dtype}, got {arr.shape} "
                                      f"{arr.dtype} while writing {path}.")
            f.write(np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())


# ----------------------------------------------------------------------------- configs
LLAMA_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")


def require_keys(hf: Mapping[str, Any], keys: tuple[str, ...], where: str, family: str) -> None:
    """Names every field the conversion cannot do without (a KeyError would name only one)."""
    missing = [k for k in keys if hf.get(k) is None]
    if missing:
        raise ConversionError(paragraph(
            f"{where} lacks the field(s) {', '.join(missing)}, which a {family} conversion needs",
            f"(it reads {', '.join(keys)}). The file is truncated or not a {family} config:",
            "re-save the model with `save_pretrained`, or add the missing values.",
        ))


_REJECTED = {
    "attention_bias": "attention projections with biases",
    "mlp_bias": "MLP projections with biases",
}


def llama_config_from_hf(hf: Mapping[str, Any], where: str = "config.json") -> dict:
    """HF `LlamaConfig` fields -> jaxscale `config.model` fields (raises on what we lack)."""
    if hf.get("model_type", "llama") != "llama":
        raise ConversionError(paragraph(
            f"{where}: model_type={hf.get('model_type')!r}; only 'llama' checkpoints are",
            "supported by load_llama (use load_vit for ViT image classifiers).",
        ))
    for key, what in _REJECTED.items():
        if hf.get(key):
            raise ConversionError(paragraph(
                f"{where}: {key}=True ({what}) is not supported: jaxscale's Llama has no bias",
                "parameters, and dropping them would silently change the model. Convert a",
                f"checkpoint with {key}=false.",
            ))
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConversionError(f"{where}: hidden_act={act!r} is not supported; jaxscale's Llama "
                              "MLP is SwiGLU (silu). Convert a checkpoint with hidden_act='silu'.")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConversionError(paragraph(
            f"{where}: rope scaling of type {rope_type!r} ({rope}) is not implemented; jaxscale",
            "applies plain rotary embeddings, so the converted model would compute different",
            "logits. Use a checkpoint without rope_scaling (or rope_type='default').",
        ))
    if hf.get("sliding_window") not in (None, 0):
        raise ConversionError(paragraph(
            f"{where}: sliding_window={hf['sliding_window']} (local attention) is not supported:",
            "jaxscale's Llama attends to the full context, so the converted model would compute",
            "different logits. Convert a checkpoint with sliding_window=null.",
        ))
    heads = int(hf["num_attention_heads"])
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    return dict(
        name="llama",
        vocab_size=int(hf["vocab_size"]),
        embed=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        mlp=int(hf["intermediate_size"]),
        max_len=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def llama_config_to_hf(model_cfg: Mapping[str, Any], dtype: str = "float32") -> dict:
    """jaxscale `config.model` -> a `config.json` that `LlamaForCausalLM` loads."""
    m = dict(model_cfg)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m["vocab_size"], "hidden_size": m["embed"],
        "intermediate_size": m["mlp"], "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"],
        "head_dim": m["head_dim"], "max_position_embeddings": m["max_len"],
        "rope_theta": m["rope_theta"], "rms_norm_eps": m["norm_eps"],
        "rope_parameters": {"rope_type": "default", "rope_theta": m["rope_theta"]},
        "tie_word_embeddings": bool(m["tie_embeddings"]), "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "rope_scaling": None,
        "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": None,
    }


# ----------------------------------------------------------------------------- weight layout
@dataclass(frozen=True)
class Leaf:
    """One jaxscale parameter: its HF tensor name (with `{i}` for stacked layers) and the
    transforms between the HF tensor of one layer and jaxscale's layout of that layer."""

    hf_name: str
    to_jax: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    stacked: bool = True


def llama_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """{jaxscale path: Leaf} for every parameter of a Llama with `model_cfg`."""
    h, k, d, e = (model_cfg[n] for n in ("num_heads", "num_kv_heads", "head_dim", "embed"))
    ident = lambda x: x
    p = "model.layers.{i}."
    leaves = {
        "embedding": Leaf("model.embed_tokens.weight", ident, ident, stacked=False),
        "final_norm/scale": Leaf("model.norm.weight", ident, ident, stacked=False),
        "layers/attn_norm/scale": Leaf(p + "input_layernorm.weight", ident, ident),
        "layers/mlp_norm/scale": Leaf(p + "post_attention_layernorm.weight", ident, ident),
        "layers/attn/wq": Leaf(p + "self_attn.q_proj.weight", *_heads_in(h, e, d)),
        "layers/attn/wk": Leaf(p + "self_attn.k_proj.weight", *_heads_in(k, e, d)),
        "layers/attn/wv": Leaf(p + "self_attn.v_proj.weight", *_heads_in(k, e, d)),
        "layers/attn/wo": Leaf(p + "self_attn.o_proj.weight",  # (E, H*D) <-> (H, D, E)
                               lambda w: w.T.reshape(h, d, e), lambda w: w.reshape(h * d, e).T),
        "layers/mlp/w_gate": Leaf(p + "mlp.gate_proj.weight", _t, _t),
        "layers/mlp/w_up": Leaf(p + "mlp.up_proj.weight", _t, _t),
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
def _layer_tensors(reader: SafetensorsReader, leaf: Leaf, layers: range) -> Iterator[np.ndarray]:
    for i in layers:
        yield leaf.to_jax(reader.get(leaf.hf_name.format(i=i)))


def _host_shard(reader: SafetensorsReader, leaf: Leaf, index: tuple[slice, ...],
                shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """The part `index` of one parameter, reading only the layers it covers."""
    if not leaf.stacked:
        return np.asarray(leaf.to_jax(reader.get(leaf.hf_name))[index], dtype=dtype)
    layers = range(*index[0].indices(shape[0]))
    return np.stack([np.asarray(w[index[1:]], dtype=dtype)
                     for w in _layer_tensors(reader, leaf, layers)])


def _check_shape(path: str, leaf: Leaf, reader: SafetensorsReader, expected: tuple) -> None:
    name = leaf.hf_name.format(i=0)
    got = tuple(leaf.to_jax(reader.get(name)).shape)
    if got != tuple(expected[1:] if leaf.stacked else expected):
        raise ConversionError(paragraph(
            f"Tensor {name} converts to shape {got} for jaxscale leaf {path}, but config.json",
            f"implies {tuple(expected)}. The checkpoint and its config.json disagree.",
        ))


def _model_def(model_cfg: Mapping[str, Any]):
    from jaxscale.precision import get_policy
    from jaxscale.train.state import ModelDef
    return ModelDef.build(model_cfg, get_policy("32-true"))


def load_params(reader: SafetensorsReader, leaves: Mapping[str, Leaf],
                model_cfg: Mapping[str, Any], mesh: Mesh | None = None,
                rules: AxisRules | None = None, dtype: Any = None) -> dict:
    """Reads every leaf; places it on `mesh` by `rules` (host numpy arrays when no mesh)."""
    from jaxscale.train.state import param_specs

    model_def = _model_def(model_cfg)
    shapes = model_def.shapes()
    if set(shapes) != set(leaves):
        raise ConversionError(f"Internal mapping mismatch: model leaves {sorted(shapes)} vs "
                              f"converted leaves {sorted(leaves)}.")
    dtype = np.dtype(dtype or np.float32)
    specs = None
    if mesh is not None:
        rules = rules or default_rules()
        specs = param_specs(model_def, rules, mesh)
    out = {}
    for path, leaf in leaves.items():
        shape = tuple(shapes[path].shape)
        _check_shape(path, leaf, reader, shape)
        if mesh is None:
            out[path] = _host_shard(reader, leaf, (slice(None),) * len(shape), shape, dtype)
            continue
        sharding = NamedSharding(mesh, specs[path])
        out[path] = _place(reader, leaf, shape, sharding, dtype)
    return unflatten(out)


def _place(reader: SafetensorsReader, leaf: Leaf, shape: tuple[int, ...],
           sharding: NamedSharding, dtype: np.dtype) -> jax.Array:
    """Builds each distinct local shard once (replicas share it), then one global array."""
    shards: dict[tuple, np.ndarray] = {}
    key = lambda idx: tuple(s.indices(n) for s, n in zip(idx, shape))
    for idx in sharding.addressable_devices_indices_map(shape).values():
        idx = tuple(idx) + (slice(None),) * (len(shape) - len(tuple(idx)))
        if key(idx) not in shards:
            shards[key(idx)] = _host_shard(reader, leaf, idx, shape, dtype)
    return jax.make_array_from_callback(
        shape, sharding,
        lambda idx: shards[key(tuple(idx) + (slice(None),) * (len(shape) - len(tuple(idx))))])


def default_rules() -> AxisRules:
    from jaxscale.config import DEFAULT_RULES
    return AxisRules(normalize_rules(DEFAULT_RULES))


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise ConversionError(f"{hf_dir} has no config.json; point at a Hugging Face model "
                              "directory written by `save_pretrained`.")
    with open(path) as f:
        return json.load(f)


def load_llama(hf_dir: str, mesh: Mesh | None = None, rules: AxisRules | None = None,
               dtype: Any = None) -> tuple[dict, dict]:
    """(model_cfg for `config.model`, nested params) from a Hugging Face Llama directory.

    With `mesh`, every parameter is a jax.Array sharded by `rules` (default: DEFAULT_RULES);
    without, host numpy arrays. `dtype` defaults to float32 (the 32-true parameter dtype).
    """
    model_cfg = llama_config_from_hf(read_hf_config(hf_dir), os.path.join(hf_dir, "config.json"))
    params = load_params(SafetensorsReader(hf_dir), llama_leaves(model_cfg), model_cfg,
                         mesh, rules, dtype)
    return model_cfg, params


# ----------------------------------------------------------------------------- saving
def hf_tensors(flat_params: Mapping[str, Any], leaves: Mapping[str, Leaf], dtype: Any = None
               ) -> tuple[list[tuple[str, tuple, np.dtype]], Iterator[np.ndarray]]:
    """(specs, arrays): HF names/shapes/dtypes, and the host arrays gathered one at a time."""
    specs = []
    for path, leaf in leaves.items():
        v = flat_params[path]
        dt = np.dtype(dtype or v.dtype)
        empty = np.empty(v.shape[1:] if leaf.stacked else v.shape, dtype=np.uint8)
        shape = tuple(leaf.to_hf(empty).shape)  # untouched pages: no real allocation
        names = ([leaf.hf_name.format(i=i) for i in range(v.shape[0])] if leaf.stacked
                 else [leaf.hf_name])
        specs += [(n, shape, dt) for n in names]

    def arrays() -> Iterator[np.ndarray]:
        for path, leaf in leaves.items():
            arr = np.asarray(jax.device_get(flat_params[path]))
            arr = arr.astype(dtype) if dtype is not None else arr
            for layer in (arr if leaf.stacked else [arr]):
                yield np.ascontiguousarray(leaf.to_hf(layer))

    return specs, arrays()


def save_llama(params: Mapping, model_cfg: Mapping[str, Any], out_dir: str,
               dtype: Any = None) -> str:
    """Writes `config.json` + `model.safetensors` that `LlamaForCausalLM.from_pretrained` loads.

    Parameters keep their dtype unless `dtype` is given (e.g. 'bfloat16' to halve the files).
    Gathers one parameter to the host at a time, so call it from a single process.
    """
    model_cfg = dict(model_cfg)
    flat = flatten(params)
    leaves = llama_leaves(model_cfg)
    missing = sorted(set(leaves) - set(flat))
    if missing:
        raise ConversionError(paragraph(
            f"save_llama: parameters {missing[:4]} are missing (got {sorted(flat)[:4]}...).",
            "Pass the full parameter tree of a Llama (merge LoRA adapters and frozen parts",
            "first) together with the model config it was built from.",
        ))
    os.makedirs(out_dir, exist_ok=True)
    specs, arrays = hf_tensors(flat, leaves, None if dtype is None else np.dtype(dtype))
    dtype_name = {"bfloat16": "bfloat16", "float16": "float16"}.get(specs[0][2].name, "float32")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(llama_config_to_hf(model_cfg, dtype_name), f, indent=2)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), specs, arrays)
    return out_dir


def num_bytes(params: Mapping) -> int:
    return sum(math.prod(np.shape(v)) * np.dtype(v.dtype).itemsize
               for v in flatten(params).values())
