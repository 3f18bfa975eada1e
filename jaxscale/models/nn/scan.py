"""Running a stacked layer block: `lax.scan` over its leading `layers` dimension, with the
rematerialisation policy chosen by name.

Every model and every pipeline schedule runs its layers through `scan_layers`, and every config
check of `model.remat` goes through `check_remat`, so a new policy is one line in a table.

Besides none / full and jax's two dot policies, the policies between them are named by what they
keep: the model tags its key activations with `jax.ad_checkpoint.checkpoint_name` (the names in
`ACTIVATION_NAMES`), and `NAMED_POLICIES` says which names each policy saves in HBM and which it
offloads to pinned host memory (saved there in the forward pass, copied back for the backward);
everything else in the layer is recomputed. A remat policy only changes what the backward pass
recomputes, never the values: every policy gives the loss and gradients of `none`.

Decoding may instead carry one cache per layer (`layer_caches`) on weights sliced once per call
(`LayerCopies`): the layers then run unrolled, each on its own buffers, because XLA:CPU copies
any slice of a stacked array that feeds a dot (the rollout sampler's `copy_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.errors import ConfigError, paragraph

# The activations the decoder block names (`checkpoint_name`), per token and layer:
ACTIVATION_NAMES = (
    "qkv_proj",     # the fused q/k/v projection's output (before rotary): (H + 2K) x D
    "attn_out",     # attention's output before the out projection (MaxText's "context"): H x D
    "out_proj",     # the out projection's output: E
    "mlp_gate_up",  # the MLP's fused gate/up projection: 2 x F, the largest
)
# The MLP's down projection is not named: it is the block's last matmul, only added to the
# residual, and no backward pass needs it (nothing could save it).


class Named(NamedTuple):
    """A policy by names: what stays in HBM (`saved`) and what goes to host (`offloaded`)."""

    saved: tuple[str, ...] = ()
    offloaded: tuple[str, ...] = ()

    def policy(self) -> Any:
        if not self.offloaded:
            return jax.checkpoint_policies.save_only_these_names(*self.saved)
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=list(self.saved),
            names_which_can_be_offloaded=list(self.offloaded),
            offload_src="device", offload_dst="pinned_host")


_QKV, _OUT = ("qkv_proj",), ("out_proj",)
_PROJECTIONS = ("qkv_proj", "out_proj", "mlp_gate_up")  # every weight matmul a backward needs
# Policies by name, from the most HBM kept (least recompute) to the least. `minimal` (as in
# MaxText) keeps every weight matmul's output, recomputing only norms, rotary, attention's two
# einsums and SwiGLU's product; `save_dot_except_mlp` keeps the attention projections only, the
# MLP (the largest activations: gate/up is 2 x F wide) recomputed.
NAMED_POLICIES: dict[str, Named] = {
    "minimal": Named(saved=_PROJECTIONS),
    "save_dot_except_mlp": Named(saved=_QKV + _OUT),
    "save_qkv_proj": Named(saved=_QKV),
    "save_attn_out": Named(saved=("attn_out",)),
    "save_out_proj": Named(saved=_OUT),
    "minimal_offloaded": Named(offloaded=_PROJECTIONS),
    "qkv_proj_offloaded": Named(offloaded=_QKV),
}

# `jax.checkpoint` policies by config name: which intermediates the backward pass may keep.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    **{name: named.policy() for name, named in NAMED_POLICIES.items()},
}


def offloaded_names(remat: str) -> tuple[str, ...]:
    """The activation names `remat` keeps in pinned host memory (none for most policies)."""
    named = NAMED_POLICIES.get(remat)
    return () if named is None else named.offloaded



def check_remat(name: str) -> None:
    """Raises a ConfigError naming the known policies when `name` is not one of them."""
    if name not in REMAT_POLICIES:
        raise ConfigError(f"model.remat={name!r} is not a remat policy; use one of "
                          f"{', '.join(REMAT_POLICIES)}.")


def layer_data(block: nnx.Module) -> dict[str, jax.Array]:
    """What the block's layers differ in besides their parameters (`Block.per_layer`: Gemma's
    local/global flag), stacked (L,) over the whole model's layers; {} for a uniform stack. A
    pipeline schedule splits it over its stages beside the weights and hands each stage its
    slice (`scan_layers(per_layer=...)`)."""
    return getattr(block, "per_layer", lambda: None)() or {}


def _per_layer(block: nnx.Module, given: Mapping[str, jax.Array] | None) -> dict[str, jax.Array]:
    """The per-layer data to scan beside the block's stacked state: `given` (a pipeline stage's
    slice) or the block's own, which must then cover exactly the layers the state holds."""
    extra = dict(layer_data(block) if given is None else given)
    if not extra:
        return extra
    layers = {len(x) for x in extra.values()}
    stacked = {leaf.shape[0] for leaf in jax.tree.leaves(nnx.state(block))}
    if layers != stacked:
        raise ConfigError(paragraph(
            f"The model's local/global layer pattern (model.layer_types) covers {layers.pop()}",
            f"layers, but this stack holds {sorted(stacked)}: a stack that runs a slice of the",
            "layers (a pipeline stage) must be given its slice of the pattern",
            "(`scan_layers(per_layer=...)`, as the pipeline schedules in jaxscale/parallel do)."))
    return extra


def scan_layers(block: nnx.Module, h_BTE: jax.Array, positions_BT: jax.Array,
                remat: str = "none", cache: Any = None,
                cache_index: jax.Array | None = None, segments_BT: jax.Array | None = None,
                per_layer: Mapping[str, jax.Array] | None = None
                ) -> jax.Array | tuple[jax.Array, Any]:
    """Applies a stacked `block` layer by layer with `lax.scan` (optionally rematerialised).
    `per_layer`: the stack's slice of the model's per-layer data (`layer_data`), for a stack
    that holds a slice of the layers; by default the block's own.

    With a `cache` (any pytree whose leaves are stacked over the layers, (L, ...): the
    attention's own layout, opaque here) each layer reads and writes its own slice, and the
    result is (h, updated cache) (`_scan_cached`).
    Without one, what the layers sow as `nnx.Intermediate` (the MoE router's statistics) is
    left on `block`, stacked over the layers, as `nnx.scan` does.
    """
    if isinstance(block, LayerCopies):  # weights sliced once per decoding call
        if not isinstance(cache, tuple):
            raise TypeError("LayerCopies runs only with one cache per layer (layer_caches).")
        return _unrolled_cached(block.graphdef, block.states, _per_layer(block.block, per_layer),
                                h_BTE, positions_BT, cache, (cache_index, segments_BT),
                                getattr(block.block, "layers_per_step", 1))
    nnx.pop(block, nnx.Intermediate)  # a previous call's sown values are not layer inputs
    per_layer = _per_layer(block, per_layer)
    graphdef, state = nnx.split(block)
    if cache is not None:
        return _scan_cached(block, graphdef, state, per_layer, h_BTE, positions_BT, cache,
                            cache_index, segments_BT)

    packed = {} if segments_BT is None else {"segments_BT": segments_BT}  # ViT blocks: never

    def apply_one(h, xs):
        layer_state, extra = xs
        layer = nnx.merge(graphdef, layer_state)
        return layer(h, positions_BT, **packed, **extra), nnx.pop(layer, nnx.Intermediate)

    if remat != "none":
        apply_one = jax.checkpoint(apply_one, policy=REMAT_POLICIES[remat])
    h_BTE, sown = jax.lax.scan(apply_one, h_BTE, (state, per_layer))
    nnx.update(block, sown)  # what a layer sowed (the MoE router's stats), stacked (L, ...)
    return h_BTE


def _scan_cached(block: nnx.Module, graphdef: Any, state: Any, per_layer: Mapping[str, Any],
                 h_BTE: jax.Array, positions_BT: jax.Array, cache: Any,
                 cache_index: jax.Array | None, segments_BT: jax.Array | None
                 ) -> tuple[jax.Array, Any]:
    """`scan_layers` with a KV cache. A cache that offers layer views (`at_layer(l)`: the
    grouped-query and latent caches) is carried whole through the scan and each layer writes
    its new slots into the stack in place: as the scan's per-layer input and output, every
    layer's whole cache would be copied out of the stack and back on every decoding step. Any
    other cache is scanned as per-layer slices; a block whose scan step runs n layers
    (`layers_per_step`: the decoder's `LayerGroup` of dense and MoE layers) reads its step's
    (n, ...) slices."""
    n = getattr(block, "layers_per_step", 1)
    args = (cache_index, segments_BT)
    if isinstance(cache, tuple):
        raise TypeError("One cache per layer (layer_caches) runs only on LayerCopies.")
    if n == 1 and hasattr(cache, "at_layer"):
        def apply_in_place(carry, xs):
            h, stack = carry
            layer_state, extra, layer = xs
            h, stack = nnx.merge(graphdef, layer_state)(h, positions_BT, stack.at_layer(layer),
                                                        *args, **extra)
            return (h, stack.at_layer(None)), None

        layers = jax.tree.leaves(cache)[0].shape[0]
        (h_BTE, cache), _ = jax.lax.scan(apply_in_place, (h_BTE, cache),
                                         (state, per_layer, jnp.arange(layers)))
        return h_BTE, cache

    def apply_cached(h, xs):
        layer_state, layer_cache, extra = xs
        return nnx.merge(graphdef, layer_state)(h, positions_BT, layer_cache, *args, **extra)

    steps = jax.tree.map(lambda a: a.reshape(-1, n, *a.shape[1:]), cache) if n > 1 else cache
    h_BTE, steps = jax.lax.scan(apply_cached, h_BTE, (state, steps, per_layer))
    return h_BTE, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), steps) if n > 1 else steps


def layer_caches(cache: Any) -> tuple:
    """A stacked cache (leaves (L, ...)) as a tuple of L one-layer caches, each its own buffer:
    a decoding loop carrying these runs its layers unrolled (`_unrolled_cached`), so no step
    copies a layer's cache out of the stack to feed attention's dots (XLA:CPU's dynamic slice
    of the stack is a copy)."""
    layers = jax.tree.leaves(cache)[0].shape[0]
    return tuple(jax.tree.map(lambda a, l=l: a[l], cache) for l in range(layers))


def _unrolled_cached(graphdef: Any, states: list, per_layer: Mapping[str, Any], h_BTE: jax.Array,
                     positions_BT: jax.Array, caches: tuple, args: tuple, n: int
                     ) -> tuple[jax.Array, tuple]:
    """The stack's layers (scan steps of `n` layers) one after the other in Python, each on its
    own cache of `caches` (one per layer) and its own weights of `states` (`LayerCopies`)."""
    out = []
    for step in range(len(caches) // n):
        pick = lambda a, s=step: a[s]
        layer_cache = caches[step] if n == 1 else caches[step * n:(step + 1) * n]
        extra = {k: pick(v) for k, v in per_layer.items()}
        h_BTE, layer_cache = nnx.merge(graphdef, states[step])(
            h_BTE, positions_BT, layer_cache, *args, **extra)
        out.extend([layer_cache] if n == 1 else layer_cache)
    return h_BTE, tuple(out)


class LayerCopies:
    """A stacked block's weights sliced once into one state per scan step, for a decoding loop
    that runs its layers unrolled on per-layer caches: made outside the loop, so the slices are
    copied once per call instead of on every step (XLA:CPU copies a slice of the stack that
    feeds a dot, static or dynamic, and does not hoist it out of the loop). The cost: a second,
    transient copy of the stack's weights for the call. `scan_layers` runs it in place of the
    block (only with `layer_caches`)."""

    def __init__(self, block: nnx.Module):
        nnx.pop(block, nnx.Intermediate)
        self.block = block
        self.graphdef, state = nnx.split(block)
        steps = jax.tree.leaves(state)[0].shape[0]
        self.states = [jax.tree.map(lambda a, s=s: a[s], state) for s in range(steps)]


def copy_layer_weights(model: nnx.Module, names: tuple[str, ...]) -> None:
    """Replaces the model's stacked layer blocks `names` (those it has) by their `LayerCopies`:
    for a decoding program that runs them on `layer_caches`, and nothing else."""
    for name in names:
        if getattr(model, name, None) is not None:
            setattr(model, name, LayerCopies(getattr(model, name)))
