"""LoRA: low-rank adapters on the linear weights whose paths match `config.lora.targets`.

For a matched weight W the model uses W + (alpha / rank) * A.B (`lora_matmul.weight`), where A and B
are ordinary NNX parameters living next to W (`wq` -> `wq_lora_a`, `wq_lora_b`). They carry
logical axes built from W's own (`lora_rank` for the new dimension, replicated by the default
rules), so the same rules shard them: an FSDP-sharded `embed` input dimension stays sharded in A,
a tensor-parallel `heads` output dimension in B. B starts at zero, so a fresh adapter leaves the
model unchanged. Which dimensions of W are inputs: a weight whose last axis is `embed` projects
back into the residual stream, so its last dimension is the output (`wo`, `w_down`); for every
other weight the first (non-`layers`) dimension is the input (`wq`, `wk`, `wv`, `w_gate`, `w_up`).
A mixture of experts' weights (`moe/layer.py`: `expert` after `layers`) get adapters per
expert, which it reads whole with the deltas folded in (`nn.layers.weight`).
The Llama stores q/k/v and gate/up fused (`wqkv`, `w_gate_up`, see `nn/fused.py`);
adapters still target and name the parts (`attn/wq` -> `wq_lora_a`), so LoRA configs,
checkpoints and ranks mean what they did, and `lora_matmul.weight` joins the parts' deltas into
the fused weight. Any module listing a weight in its `LORA_WEIGHTS` (it reads it through
`nn.layers.project`, or whole through `nn.layers.weight`) can take adapters: the Llama's
attention / `MLP`, the MoE's experts and the ViT's `SelfAttention` / `GeluMLP`. `add_adapters`
also sets the module's `ADAPTED_PROJECTION` to `lora_matmul.project` and its `ADAPTED_WEIGHT`
to `lora_matmul.weight`, which `nn.layers` then runs: the layers never import adapters.

`lora.dropout` drops the adapter's *input* (x.W + scale * (drop(x).A).B, per example, as in the
LoRA paper) while training only: the train step enables it with
`lora_matmul.adapter_dropout(key)`;
evaluation, merging and export never do, so they see the deterministic model.

The model knows nothing of training: `with_adapters(model_def, lora_cfg)` returns a ModelDef whose
modules have adapters, `trainable(lora_cfg)` says which parameters the optimizer sees (adapters
only: base weights go to `TrainState.frozen`, which has no optimizer state), `merge` folds the
adapters into the base weights for export, and `adapter_params` picks the adapter leaves to save.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import jax
from flax import nnx, traverse_util

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.adapters import lora_matmul
from jaxscale.models.nn.fused import LLAMA_FUSED, fuse_parts, unfuse
from jaxscale.models.nn.layers import ADAPTED_PROJECTION, ADAPTED_WEIGHT

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")


class Remakeable(Protocol):
    """What `with_adapters` needs of a `models.ModelDef` (the adapters sit below the model
    table, which imports them, so they name the ModelDef by what they use of it)."""

    make: Callable[[jax.Array], nnx.Module]

    def remade(self, make: Callable[[jax.Array], nnx.Module]) -> Any: ...


Def = TypeVar("Def", bound=Remakeable)


def _flatten(tree: Mapping) -> dict[str, Any]:
    """Nested params dict -> {'a/b/c': leaf}."""
    return traverse_util.flatten_dict(tree, sep="/")


def _unflatten(flat: Mapping[str, Any]) -> dict:
    return traverse_util.unflatten_dict(dict(flat), sep="/")


def _everything(path: str) -> bool:
    return True


def is_adapter(path: str) -> bool:
    return path.endswith(ADAPTER_SUFFIXES)


def _check(lora_cfg: Any) -> None:
    if lora_cfg.rank < 0 or lora_cfg.alpha <= 0:
        raise ConfigError(paragraph(
            f"lora.rank={lora_cfg.rank} / lora.alpha={lora_cfg.alpha}: rank must be >= 0",
            "(0 turns LoRA off) and alpha positive; the update is scaled by alpha / rank."))
    if not 0.0 <= lora_cfg.dropout < 1.0:
        raise ConfigError(paragraph(
            f"lora.dropout={lora_cfg.dropout} must be in [0, 1): the probability of zeroing each",
            "input feature of an adapter while training (0 = no dropout)."))


def _split_axes(axes: tuple, shape: tuple) -> tuple[int, int]:
    """(number of leading `layers` / `expert` dims, number of input dims) of a weight: an
    expert's weight gets its own adapters (A: ..., expert, in, rank; B: ..., expert, rank, out)."""
    lead = 0
    while lead < len(axes) and axes[lead] in ("layers", "expert"):
        lead += 1
    n_in = len(shape) - lead - 1 if axes[-1] == "embed" else 1
    return lead, n_in


def _candidates(module: nnx.Module) -> list[tuple[str, tuple, tuple, Any, str | None]]:
    """(name, logical axes, shape, dtype, fused weight or None) of every weight of `module`
    that might take adapters: its parameters, and the parts of its fused weights
    (`nn/fused.py`: adapters of `wq` live beside `wqkv` and are joined into it)."""
    fused = getattr(type(module), "FUSED", {})
    out = []
    for name, var in list(vars(module).items()):
        if not isinstance(var, nnx.Param) or is_adapter(name):
            continue
        axes, shape = tuple(var.get_metadata()["logical_axes"]), tuple(var.shape)
        if name not in fused:
            out.append((name, axes, shape, var.dtype, None))
            continue
        spec, lead = fused[name], axes[:1] if axes[0] == "layers" else ()
        part_shapes = [p.shape for p in jax.eval_shape(spec.split, jax.ShapeDtypeStruct(
            shape, var.dtype))]
        out += [(part, lead + part_axes, tuple(part_shape), var.dtype, name)
                for part, part_axes, part_shape in zip(spec.parts, spec.part_axes, part_shapes)]
    return out


def add_adapters(model: nnx.Module, lora_cfg: Any, rngs: nnx.Rngs) -> nnx.Module:
    """Attaches A (normal / sqrt(fan_in)) and B (zeros) to every matched weight, in place.
    A part of a fused weight matches by its own path (`attn/wq`) or the fused one (`attn/wqkv`)."""
    patterns = [re.compile(t) for t in lora_cfg.targets]
    rank, scale = int(lora_cfg.rank), float(lora_cfg.alpha) / int(lora_cfg.rank)
    matched, unsupported = [], []
    for path, module in list(nnx.iter_modules(model)):
        for name, axes, shape, dtype, fused in _candidates(module):
            full = "/".join(map(str, (*path, name)))
            paths = [full] + ([] if fused is None else ["/".join(map(str, (*path, fused)))])
            if not any(p.search(f) for p in patterns for f in paths):
                continue
            if name not in getattr(type(module), "LORA_WEIGHTS", ()) or len(shape) < 2:
                unsupported.append(full)
                continue
            if lora_cfg.dropout and not getattr(type(module), "PROJECTED", True):
                raise ConfigError(paragraph(
                    f"lora.dropout={lora_cfg.dropout} with adapters on {full}: that weight is",
                    "read whole with its adapters folded in (a mixture of experts' weights), so",
                    "dropout cannot act on its input. Use --config.lora.dropout=0.0, or targets",
                    "that leave it out."))
            lead, n_in = _split_axes(axes, shape)
            a_shape = shape[:lead + n_in] + (rank,)
            b_shape = shape[:lead] + (rank,) + shape[lead + n_in:]
            fan_in = math.prod(shape[lead:lead + n_in])
            a = jax.random.normal(rngs.params(), a_shape, dtype) / math.sqrt(fan_in)
            setattr(module, f"{name}_lora_a", nnx.Param(
                a.astype(dtype), logical_axes=axes[:lead + n_in] + ("lora_rank",)))
            setattr(module, f"{name}_lora_b", nnx.Param(
                jax.numpy.zeros(b_shape, dtype),
                logical_axes=axes[:lead] + ("lora_rank",) + axes[lead + n_in:]))
            setattr(module, f"{name}_lora_scale", scale)
            setattr(module, f"{name}_lora_dropout", float(lora_cfg.dropout))
            setattr(module, ADAPTED_PROJECTION, lora_matmul.project)
            setattr(module, ADAPTED_WEIGHT, lora_matmul.weight)
            matched.append(full)
    if unsupported or not matched:
        raise ConfigError(paragraph(
            f"lora.targets matched {unsupported}, which cannot take adapters" if unsupported
            else f"lora.targets={tuple(lora_cfg.targets)} matched no adaptable weight",
            "(LoRA wraps the attention and MLP projections, e.g. 'attn/w[qkvo]$', 'mlp/w_',",
            "not embeddings, norms, biases or the LM / classifier head). Fix the regular",
            "expressions in --config.lora.targets."))
    return model


def with_adapters(model_def: Def, lora_cfg: Any) -> Def:
    """The ModelDef with adapters attached (unchanged when lora.rank == 0). Base weights are
    initialised exactly as without LoRA (same seed), adapters from a derived key."""
    _check(lora_cfg)
    if not lora_cfg.rank:
        return model_def
    base_make = model_def.make

    def make(rng: jax.Array) -> nnx.Module:
        return add_adapters(base_make(rng), lora_cfg, nnx.Rngs(jax.random.fold_in(rng, 7)))

    return model_def.remade(make)


def trainable(lora_cfg: Any) -> Callable[[str], bool]:
    """`is_trainable` for `init_state`: adapters only under LoRA, everything otherwise."""
    return is_adapter if lora_cfg.rank else _everything


def adapter_params(params: Mapping) -> dict:
    """Only the adapter leaves of a nested params dict (what a LoRA checkpoint needs to save)."""
    return _unflatten({k: v for k, v in _flatten(params).items() if is_adapter(k)})


def merge(params: Mapping, lora_cfg: Any) -> dict:
    """Base weights with the adapters folded in (W + alpha/rank A.B) and the adapters removed:
    a plain parameter dict for the model without LoRA (export, serving, conversion)."""
    flat, fused = unfuse(_flatten(params))  # adapters of `wq` fold into the part `wq`
    scale = float(lora_cfg.alpha) / int(lora_cfg.rank)
    out = {k: v for k, v in flat.items() if not is_adapter(k)}
    for key in flat:
        if key.endswith("_lora_a"):
            base = key[: -len("_lora_a")]
            if base not in flat:
                raise ConfigError(paragraph(
                    f"lora.merge: the adapter {key} has no base weight {base} to fold into. The",
                    "parameters hold adapters only (lora.save_adapters_only checkpoints do):",
                    "rebuild the base from the run's config.init_from or seed first, e.g. with",
                    "merge_trees(adapters, base), then merge."))
            w = flat[base]
            delta = lora_matmul.lora_delta(flat[key], flat[base + "_lora_b"], scale, w.ndim)
            out[base] = (w + delta.astype(w.dtype)).astype(w.dtype)
    # Fuse back only what was split: a mixture of experts' own `mlp/w_gate` / `w_up` are no parts.
    parts = {f"{path.rsplit('/', 1)[0]}/{p}" for path in fused
             for p in LLAMA_FUSED["/".join(path.split("/")[-2:])].parts}
    joined = fuse_parts({k: v for k, v in out.items() if k in parts})
    return _unflatten({**{k: v for k, v in out.items() if k not in parts}, **joined})
