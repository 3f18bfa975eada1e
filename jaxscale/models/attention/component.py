"""What a decoder asks of its attention: the component interface every attention kind implements.

Why a component: the decoder block, its FLOP counts, generation and the AOT memory and traffic
models each used to spell out grouped-query attention (its parameters, its (k, v) cache of
(kv heads, head_dim), its FLOPs and bytes). A component owns those facts, so a new kind
(latent attention, attention sinks, ...) is one module and one line in `kinds.ATTENTIONS`.

A component is made from the decoder's config (`Kind(cfg)`: any object with the `config.model`
fields as attributes, the decoder's `LlamaConfig`) and answers:
- `build(policy, rngs, stack)`: its module, the block's `attn`, whose parameters carry logical
  axes; it is called as `attn(x_BTE, positions_BT, cache, cache_index, segments_BT, local)` and
  returns the output (B, T, E), or with a one-layer `cache` (output, updated cache);
- `init_cache(layers, batch, max_len, dtype)`: an empty cache stacked over the layers, a pytree
  of the component's own layout whose `constrained()` shards it by its logical names (the layer
  scan and generation pass it along unopened). A cache that also offers `at_layer(l)` (layer
  l's view of the stack, which the module writes in place with `put_slots` and reads with
  `layer_of`; `at_layer(None)`: the stack again) is carried whole through the layer scan
  (`nn/scan.py`), so a decoding step copies no layer's cache out of the stack and back;
- `num_params()`: parameters per layer (biases and norms included);
- `named_matmuls()`, `matmul_params()`, `score_flops(seq_len)`: the matmul parameters per layer
  behind each activation name the remat policies keep (`nn/scan.ACTIVATION_NAMES`), all of them,
  and the forward FLOPs per token and layer of the attention itself (QK^T and AV, over the keys
  each layer sees: a sliding window's); `masked_score_flops(seq_len)`: what a masking kernel
  computes beyond those: the decoder's FLOP counts (`decoder/flops.py`) are built from these;
- `activation_widths()`: elements per token and layer of each activation it names, what the
  memory model (`aot/memory.py`) counts for a remat policy that keeps them;
- `kv_elements(tensor)`: elements per token and layer of what its cache holds, per `tensor`
  shard, which attention across sequence shards also moves (`aot/traffic.py`);
- `check()`: its own `config.model` checks (ConfigError paragraphs).
"""

from __future__ import annotations

import abc
from typing import Any

import jax
from flax import nnx

from jaxscale.precision import Policy


class AttentionKind(abc.ABC):
    """The base of the attention components (see the module docstring)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def check(self) -> None:
        """The kind's own checks of the decoder config; none by default."""
        return None

    @abc.abstractmethod
    def build(self, policy: Policy, rngs: nnx.Rngs, stack: int | None) -> nnx.Module:
        """The attention module of a block, its parameters stacked `stack` layers deep."""

    @abc.abstractmethod
    def init_cache(self, layers: int, batch: int, max_len: int, dtype: Any) -> Any:
        """An empty cache of `batch` rows and `max_len` slots, stacked over `layers`."""

    @abc.abstractmethod
    def num_params(self) -> int:
        """Parameters per layer."""

    @abc.abstractmethod
    def named_matmuls(self) -> dict[str, int]:
        """{activation name: parameters of the weight matmul whose output it names}."""

    def matmul_params(self) -> int:
        """Parameters per layer that take part in matmuls (6 FLOPs per token each in training):
        by default those behind the named activations; a kind with unnamed matmuls adds them."""
        return sum(self.named_matmuls().values())

    @abc.abstractmethod
    def score_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token and layer of QK^T and AV over `seq_len` keys, counted without
        the causal saving (PaLM's convention); a kind whose layers see fewer keys (a sliding
        window) counts those, averaged over the layers."""

    def masked_score_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token and layer that a kernel masking the scores instead of skipping
        them (einsum) spends beyond `score_flops`: 0 unless some layers see fewer keys."""
        return 0.0

    @abc.abstractmethod
    def activation_widths(self) -> dict[str, int]:
        """{activation name: elements per token and layer} of the activations it names."""

    @abc.abstractmethod
    def kv_elements(self, tensor: int = 1) -> float:
        """Elements per token and layer its cache holds on one of `tensor` shards."""



def put_slots(old: jax.Array, new: jax.Array, at: tuple, layer: jax.Array | None) -> jax.Array:
    """`old` (one layer's cache array, or the stack when `layer` is set) with `new` (one
    layer's shape) written at `at` (one layer's start indices), in place in the stack."""
    if layer is None:
        return jax.lax.dynamic_update_slice(old, new.astype(old.dtype), at)
    return jax.lax.dynamic_update_slice(old, new.astype(old.dtype)[None], (layer, *at))


def layer_of(a: jax.Array, layer: jax.Array | None) -> jax.Array:
    """Layer `layer`'s slice of a stacked cache array (`a` itself when `layer` is None)."""
    return a if layer is None else jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)
