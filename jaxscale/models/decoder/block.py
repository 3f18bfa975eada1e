"""The decoder's transformer block (pre-norm attention and MLP or MoE) and its scanned stack.

The block's attention is the component `model.attention_kind` names (`attention/kinds.py`),
which builds it; its cache (a pytree of the component's layout, one layer's slice here) passes
through untouched. `layer_stack` builds what the decoder scans: one `Block` stacked over the
layers, or with MoE on every n-th layer one `LayerGroup` of n blocks per scan step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.models.attention.kinds import attention_of
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.moe.layer import MoE
from jaxscale.models.nn.layers import MLP, RMSNorm
from jaxscale.precision import Policy
from jaxscale.rules import constrain


class Block(nnx.Module):
    """One pre-norm transformer block (created stacked: every parameter has a `layers` dim).
    With `post_norms` (Gemma) the attention and MLP outputs are normalised again before they
    join the residual stream."""

    def __init__(self, cfg: LlamaConfig, policy: Policy, rngs: nnx.Rngs, stack: int,
                 moe: bool | None = None):
        moe = bool(cfg.moe.num_experts) if moe is None else moe  # experts or the dense MLP
        norm = lambda: RMSNorm(cfg.embed, cfg.norm_eps, policy, stack=stack,
                               offset=cfg.norm_offset)
        self.attn_norm = norm()
        self.attn = attention_of(cfg).build(policy, rngs, stack)
        self.mlp_norm = norm()
        self.mlp = (MoE(cfg.embed, cfg.mlp, cfg.moe, policy, rngs, stack=stack)
                    if moe else MLP(cfg.embed, cfg.mlp, policy, rngs, stack=stack,
                                                    activation=cfg.mlp_activation))
        if cfg.post_norms:
            self.attn_post_norm, self.mlp_post_norm = norm(), norm()
        # A mixed local/global pattern, scanned with the layers (None: every layer alike).
        local = cfg.local_layers
        self.local_pattern = local if len(set(local)) > 1 else None

    def per_layer(self) -> dict[str, jax.Array] | None:
        """What differs between layers besides their parameters, stacked (L,) for the scan
        (`scan_layers`): the `local` flag of a mixed pattern; None when every layer is alike."""
        if self.local_pattern is None:
            return None
        return {"local": jnp.asarray(self.local_pattern)}

    def _post(self, name: str, out_BTE: jax.Array) -> jax.Array:
        return getattr(self, name)(out_BTE) if hasattr(self, name) else out_BTE

    def __call__(self, h_BTE: jax.Array, positions_BT: jax.Array, cache: Any = None,
                 cache_index: jax.Array | None = None, segments_BT: jax.Array | None = None,
                 local: jax.Array | None = None) -> jax.Array | tuple[jax.Array, Any]:
        """The block's output; with a (one-layer) `cache`, (output, updated cache)."""
        attn_out = self.attn(self.attn_norm(h_BTE), positions_BT, cache, cache_index,
                             segments_BT, local)
        if cache is not None:
            attn_out, cache = attn_out
        h_BTE = h_BTE + self._post("attn_post_norm", attn_out)
        h_BTE = h_BTE + self._post("mlp_post_norm", self.mlp(self.mlp_norm(h_BTE)))
        h_BTE = constrain(h_BTE, "batch", "length", "embed")
        return h_BTE if cache is None else (h_BTE, cache)


class LayerGroup(nnx.Module):
    """`model.moe.every` = n > 1 consecutive layers: n-1 dense blocks (`dense_0`..) then one
    MoE block (`moe`), each stacked over the num_layers / n groups, so the scan runs one group
    per step (MaxText's interleaved MoE blocks). Layer i has the experts when (i + 1) % n == 0,
    Hugging Face Qwen-MoE's `decoder_sparse_step`. Pipeline stages split the groups."""

    def __init__(self, cfg: LlamaConfig, policy: Policy, rngs: nnx.Rngs, stack: int):
        self.every = cfg.moe.every
        for j in range(self.every - 1):
            setattr(self, f"dense_{j}", Block(cfg, policy, rngs, stack, moe=False))
        self.moe = Block(cfg, policy, rngs, stack, moe=True)
        local = cfg.local_layers
        self.local_pattern = local if len(set(local)) > 1 else None

    @property
    def layers_per_step(self) -> int:
        """Layers a scan step runs (`scan.scan_layers` views the KV cache so)."""
        return self.every

    def blocks(self) -> list[Block]:
        """The group's blocks in layer order."""
        return [getattr(self, f"dense_{j}") for j in range(self.every - 1)] + [self.moe]

    def per_layer(self) -> dict[str, jax.Array] | None:
        """The mixed local/global flag as (groups, n) for the scan over groups."""
        if self.local_pattern is None:
            return None
        return {"local": jnp.asarray(self.local_pattern).reshape(-1, self.every)}

    def __call__(self, h_BTE: jax.Array, positions_BT: jax.Array, cache: Any = None,
                 cache_index: jax.Array | None = None, segments_BT: jax.Array | None = None,
                 local: jax.Array | None = None) -> jax.Array | tuple[jax.Array, Any]:
        """The group's output; with the group's (n, ...) `cache`, (output, updated cache)."""
        caches, per_layer = [], isinstance(cache, tuple)  # a tuple: one cache per layer
        for j, block in enumerate(self.blocks()):
            layer_cache = (cache[j] if per_layer else None if cache is None
                           else jax.tree.map(lambda a, j=j: a[j], cache))
            h_BTE = block(h_BTE, positions_BT, layer_cache, cache_index, segments_BT,
                          None if local is None else local[j])
            if cache is not None:
                h_BTE, layer_cache = h_BTE
                caches.append(layer_cache)
        if cache is None or per_layer:
            return h_BTE if cache is None else (h_BTE, tuple(caches))
        return h_BTE, jax.tree.map(lambda *a: jnp.stack(a), *caches)


def layer_stack(cfg: LlamaConfig, policy: Policy, rngs: nnx.Rngs) -> Block | LayerGroup:
    """The scanned stack: one `Block` per layer, or with MoE on every n-th layer
    (`model.moe.every` > 1) one `LayerGroup` of n layers per scan step; without the first
    `moe.first_k_dense_replace` layers (`dense_stack`)."""
    n = cfg.moe.every if cfg.moe.num_experts else 1
    layers = cfg.num_layers - dense_first(cfg)
    if n == 1:
        return Block(cfg, policy, rngs, stack=layers)
    return LayerGroup(cfg, policy, rngs, stack=layers // n)


def dense_first(cfg: LlamaConfig) -> int:
    """How many first layers keep the dense MLP before the MoE stack (DeepSeek's
    first_k_dense_replace; 0 without experts)."""
    return cfg.moe.first_k_dense_replace if cfg.moe.num_experts else 0


def dense_stack(cfg: LlamaConfig, policy: Policy, rngs: nnx.Rngs) -> Block | None:
    """The first `dense_first` layers, a dense `Block` stack scanned before `layer_stack`'s
    (their parameters differ in shape from the MoE layers', so they cannot share its scan);
    None when there are none."""
    k = dense_first(cfg)
    return Block(cfg, policy, rngs, stack=k, moe=False) if k else None

