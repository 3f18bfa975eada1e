"""Parameters saved before q/k/v and gate/up were fused, converted on load.

Llama weights written before `models/nn/fused.py` (separate `attn/wq`, `attn/wk`, `attn/wv`,
`mlp/w_gate`, `mlp/w_up`) still load everywhere weights are read (`sources.open_weights`:
`config.init_from`, `launch.convert --to_hf`, `launch.evaluate`): each complete set of parts
becomes one lazy fused leaf, joined exactly (concatenation and reshape only) when it is read.
LoRA adapters keep their part names (`wq_lora_a`), which is what a fused model uses too.
A *training* checkpoint of the old layout cannot resume (its optimizer moments are in the old
layout too): `checkpoint.Checkpointer.restore` says so and names `config.init_from` as the fix.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from jaxscale.models.nn.fused import Fused, fuse_parts, is_legacy
from jaxscale.weights.leaf import Index, Leaf


def _fused_leaf(spec: Fused, parts: list[Leaf]) -> Leaf:
    """A lazy leaf reading its parts whole and joining them (one fused leaf on the host)."""
    shape = jax.eval_shape(spec.join, *[jax.ShapeDtypeStruct(p.shape, p.dtype)
                                        for p in parts]).shape

    def read(index: Index | None) -> np.ndarray:
        arr = spec.join(*[np.asarray(p.read()) for p in parts])
        return arr if index is None else arr[index]

    return Leaf(shape, parts[0].dtype, read)


def fuse_legacy_leaves(leaves: Mapping[str, Leaf]) -> dict[str, Leaf]:
    """`leaves` with a pre-fusion Llama's parts joined into fused leaves (others untouched)."""
    if not is_legacy(leaves):
        return dict(leaves)
    return fuse_parts(leaves, join=_fused_leaf)


LEGACY_RESUME = (
    "was written before jaxscale fused the Llama's q/k/v and gate/up projections (it holds",
    "separate attn/wq, attn/wk, attn/wv, mlp/w_gate and mlp/w_up), so its optimizer state",
    "cannot resume this run. Its weights still load, converted on load: start a fresh workdir",
    "with --config.init_from=<this workdir> (the optimizer state restarts), or export them",
    "with `jaxscale convert --from_workdir=<this workdir> --to_hf=DIR`.",
)
