"""Fused projection weights: q/k/v as one `wqkv`, gate/up as one `w_gate_up`, and their parts.

Why fused: under tensor parallelism the input gradient of a column-parallel projection is a
partial sum on every `tensor` shard and needs one all-reduce over `tensor`. Three separate q/k/v
projections (two for gate/up) read the same normed activation, so the backward pass ends with
three (two) such all-reduces of a full (B, T, E) activation, unless the compiler reassociates
them (XLA:CPU never does, and the TPU compiler does not always). One fused weight makes it one
matmul, hence one all-reduce by construction.

Why this layout (not a flat `(E, (H + 2K) * D)` kernel): splitting a flat output dimension over
`tensor` would hand one shard all of q and another k and v. Instead the fused dimension is
grouped by kv head, `wqkv` (E, K, G + 2, D): for each of the K kv heads, its G = H / K query
heads, then its key, then its value (the grouped-query order `einsum_attention` and Hugging Face
use: query head h = k * G + g reads kv head k). Sharding K over `tensor` (the `kv` rule) gives
each shard whole kv groups: its query heads with exactly the keys and values they read, and the
query heads it holds are the same contiguous block the `heads` rule gives the attention output,
so nothing is resharded. The cost: `tensor` must divide the kv heads (as it already had to for
`wk`/`wv`), and the query heads are sharded by the `kv` rule, not the `heads` rule (every preset
shards both the same way). `w_gate_up` is (E, 2, F): `mlp` over `tensor` keeps each shard's
gate and up columns together. The new middle dimension has the logical name `fused`,
replicated by every preset.

The parts keep their own names (`wq`, `wk`, `wv`, `w_gate`, `w_up`): LoRA targets and adapters,
the Hugging Face converter and parameters saved before the fusion all speak of the parts;
`join` / `split` convert exactly (reshapes and concatenation only, so round trips are
bit-for-bit). `fuse_legacy` converts a flat parameter dict of the old layout on load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

FUSED_AXIS = "fused"  # logical name of the dimension that stacks the parts (replicated)


def _xp(x: Any):
    """numpy for host arrays (converters, lazy leaves), jax.numpy for traced / device arrays."""
    if isinstance(x, np.ndarray):
        return np
    import jax.numpy as jnp
    return jnp


def join_qkv(q_HD: Any, k_KD: Any, v_KD: Any) -> Any:
    """(..., H, D), (..., K, D), (..., K, D) -> (..., K, G + 2, D), grouped by kv head."""
    xp = _xp(q_HD)
    *lead, h, d = q_HD.shape
    kv = k_KD.shape[-2]
    q_KGD = xp.reshape(q_HD, (*lead, kv, h // kv, d))
    return xp.concatenate([q_KGD, k_KD[..., None, :], v_KD[..., None, :]], axis=-2)


def split_qkv(w_KCD: Any) -> list[Any]:
    """(..., K, G + 2, D) -> [q (..., K * G, D), k (..., K, D), v (..., K, D)]."""
    xp = _xp(w_KCD)
    *lead, kv, c, d = w_KCD.shape
    q = xp.reshape(w_KCD[..., : c - 2, :], (*lead, kv * (c - 2), d))
    return [q, w_KCD[..., c - 2, :], w_KCD[..., c - 1, :]]


def join_gate_up(gate_F: Any, up_F: Any) -> Any:
    """(..., F), (..., F) -> (..., 2, F)."""
    return _xp(gate_F).stack([gate_F, up_F], axis=-2)


def split_gate_up(w_2F: Any) -> list[Any]:
    """(..., 2, F) -> [gate (..., F), up (..., F)]."""
    return [w_2F[..., 0, :], w_2F[..., 1, :]]


@dataclass(frozen=True)
class Fused:
    """A fused weight: its parts' names and logical axes (without `layers`), and the exact
    conversions between the parts and the fused array (any leading dims pass through)."""

    parts: tuple[str, ...]
    part_axes: tuple[tuple[str, ...], ...]
    join: Callable[..., Any]
    split: Callable[[Any], list[Any]]

    def zero_filled(self, fused_like: Any, parts: Mapping[str, Any]) -> Any:
        """The fused array of `parts`, zeros where a part is missing (e.g. a LoRA delta of the
        parts a target names only); `fused_like` gives the shape and dtype."""
        zeros = self.split(_xp(fused_like).zeros(fused_like.shape, fused_like.dtype))
        given = [parts.get(name) for name in self.parts]
        return self.join(*[z if g is None else g for g, z in zip(given, zeros)])


QKV = Fused(("wq", "wk", "wv"),
            (("embed", "heads", "head_dim"), ("embed", "kv", "head_dim"),
             ("embed", "kv", "head_dim")),
            join_qkv, split_qkv)
GATE_UP = Fused(("w_gate", "w_up"), (("embed", "mlp"), ("embed", "mlp")),
                join_gate_up, split_gate_up)

# Fused leaf name -> its parts, for the Llama's `attn` and `mlp` modules.
LLAMA_FUSED: dict[str, Fused] = {"attn/wqkv": QKV, "mlp/w_gate_up": GATE_UP}


def _leaf(path: str) -> tuple[str, str]:
    """'layers/attn/wqkv' -> ('layers/', 'attn/wqkv')."""
    parts = path.split("/")
    return "/".join(parts[:-2]) + ("/" if len(parts) > 2 else ""), "/".join(parts[-2:])


def is_legacy(flat: Mapping[str, Any]) -> bool:
    """True for Llama parameters saved before the fusion (separate `wq`/`wk`/`wv`/`w_gate`/
    `w_up`); `mlp/w_gate` is Llama-only, so a ViT's own `attn/wq` never counts, and an MoE
    block's stacked experts (`mlp/w_gate` beside `mlp/router`, `moe/layer.py`) are not parts."""
    return any(p.endswith("mlp/w_gate") for p in flat) and not any(
        p.endswith(("mlp/w_gate_up", "mlp/router")) for p in flat)


def fuse_parts(flat: Mapping[str, Any], join: Callable[[Fused, list[Any]], Any] | None = None
               ) -> dict[str, Any]:
    """Old layout -> fused: every complete set of parts becomes its fused leaf (other leaves,
    LoRA adapters included, pass through). `join(fused, part_values)` may replace the array
    join (lazy leaves)."""
    out = dict(flat)
    for path in list(flat):
        prefix, leaf = _leaf(path)
        for name, spec in LLAMA_FUSED.items():
            module = name.split("/")[0]
            if leaf != f"{module}/{spec.parts[0]}":
                continue
            keys = [f"{prefix}{module}/{p}" for p in spec.parts]
            if all(k in flat for k in keys):
                values = [out.pop(k) for k in keys]
                out[f"{prefix}{name}"] = (join(spec, values) if join is not None
                                          else spec.join(*values))
    return out


def unfuse(flat: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Fused -> the parts' layout; also returns the fused paths it split (to `fuse_parts`
    back exactly those)."""
    out, split = dict(flat), []
    for path in list(flat):
        prefix, leaf = _leaf(path)
        spec = LLAMA_FUSED.get(leaf)
        if spec is None:
            continue
        module = leaf.split("/")[0]
        for name, value in zip(spec.parts, spec.split(out.pop(path))):
            out[f"{prefix}{module}/{name}"] = value
        split.append(path)
    return out, split
