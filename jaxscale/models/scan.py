"""Running a stacked layer block: `lax.scan` over its leading `layers` dimension, with the
rematerialisation policy chosen by name.

Every model and every pipeline schedule runs its layers through `scan_layers`, and every config
check of `model.remat` goes through `check_remat`, so a new policy is one line in
`REMAT_POLICIES`.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxscale.errors import ConfigError
from jaxscale.models.attention import KVCache

# `jax.checkpoint` policies by config name: which intermediates the backward pass may keep.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}



def check_remat(name: str) -> None:
    """Raises a ConfigError naming the known policies when `name` is not one of them."""
    if name not in REMAT_POLICIES:
        raise ConfigError(f"model.remat={name!r} is not a remat policy; use one of "
                          f"{', '.join(REMAT_POLICIES)}.")


def scan_layers(block: nnx.Module, h_BTE: jax.Array, positions_BT: jax.Array,
                remat: str = "none", cache: KVCache | None = None,
                cache_index: jax.Array | None = None, segments_BT: jax.Array | None = None
                ) -> jax.Array | tuple[jax.Array, KVCache]:
    """Applies a stacked `block` layer by layer with `lax.scan` (optionally rematerialised).

    With a stacked `cache` (L, B, S, K, D) each layer reads and writes its own slice, and the
    result is (h, updated cache).
    """
    graphdef, state = nnx.split(block)
    if cache is not None:
        def apply_cached(h, xs):
            layer_state, layer_cache = xs
            return nnx.merge(graphdef, layer_state)(h, positions_BT, layer_cache, cache_index,
                                                    segments_BT)

        h_BTE, cache = jax.lax.scan(apply_cached, h_BTE, (state, cache))
        return h_BTE, cache.constrained()

    packed = {} if segments_BT is None else {"segments_BT": segments_BT}  # ViT blocks: never

    def apply_one(h, layer_state):
        return nnx.merge(graphdef, layer_state)(h, positions_BT, **packed), None

    if remat != "none":
        apply_one = jax.checkpoint(apply_one, policy=REMAT_POLICIES[remat])
    h_BTE, _ = jax.lax.scan(apply_one, h_BTE, state)
    return h_BTE
