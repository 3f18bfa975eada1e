"""Grouped-query causal attention (the Llama family's), one implementation for training and
decoding, and its KV cache.

`Attention` projects q/k/v through one fused weight (`nn/fused.py`), applies the
decoder's switches (q/k/v bias, q/k norm, Gemma's query scale, soft-cap, local/global rotary and
window; GPT-OSS's per-head attention sinks and output bias) and computes attention with
`kernels.attend`. Sinks are a switch here rather than a kind of their own: they change neither
the parameters' layout nor the cache, only one term of the softmax, which every kernel that
takes them (`kernels.SINK_IMPLS`) adds itself.

Decoding keeps a `KVCache` (keys, values and segment ids of every slot so far, written at a
given index, held (B, K, S, D) for the attention's dots): `Attention(x, positions, cache, cache_index)` writes the new keys/values at
`cache_index` and attends over the whole cache, masking the slots not yet written (they are "in
the future"). Prompts of different lengths in one batch are left-padded with segment id 0 on the
padding and 1 (or a document id) on real tokens, positions restarting at each row's first real
token: a call that passes `segments_BT` sees only cached slots of its own segment, so every
row decodes exactly as its prompt would alone. Calls without segments write segment 1 and
mask nothing beyond causality; a padded batch must pass segments on every call.
Shape suffixes: B batch, T query length, S key length (cache length), H heads, K kv heads,
G heads per kv head, D head dim, E embed, L layers.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.attention.component import AttentionKind, layer_of, put_slots
from jaxscale.models.attention.kernels import attend, attend_cached, check_impl
from jaxscale.models.attention.mask import Mask
from jaxscale.models.nn.fused import FUSED_AXIS, QKV
from jaxscale.models.nn.layers import RMSNorm, param, project
from jaxscale.models.nn.rope import Rope, rotary
from jaxscale.precision import Policy
from jaxscale.rules import constrain

# Logical axes of a stacked cache (one slice per layer; a layer's slice drops the first) and
# of its segment ids. Keys and values are held kv head before slot, (B, K, S, D): the layout the
# attention's two dots read (`kernels.attend_cached`), so a decoding step neither transposes
# nor copies the cache.
CACHE_AXES = ("layers", "batch", "kv", "length", "head_dim")
SEGMENT_AXES = ("layers", "batch", "length")


def _layer_axes(ndim: int, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The trailing logical axes of an array of `ndim` dims (a stack or one layer's slice)."""
    return axes[len(axes) - ndim:]


@flax.struct.dataclass
class KVCache:
    """Keys and values of every cache slot: (B, K, S, D) for one layer, (L, B, K, S, D)
    stacked, and each slot's segment id, (B, S) or (L, B, S) (0: padding or not yet written).

    A pytree, so a stacked cache scans over layers like the stacked parameters; `cache['k']`
    reads a field by name. `layer` set (`at_layer`, by `scan_layers`): the arrays are the
    whole stack and this is layer `layer`'s view of it, written in place and read by `read`,
    so that a decoding step does not copy every layer's cache out of the stack and back.
    """

    k: jax.Array
    v: jax.Array
    segments: jax.Array
    layer: jax.Array | None = None

    @classmethod
    def zeros(cls, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
              dtype: Any) -> "KVCache":
        """An empty stacked cache, sharded by the rules through its logical names."""
        zeros = lambda: constrain(jnp.zeros((layers, batch, kv_heads, max_len, head_dim), dtype),
                                  *CACHE_AXES)
        segments = constrain(jnp.zeros((layers, batch, max_len), jnp.int32), *SEGMENT_AXES)
        return cls(zeros(), zeros(), segments)

    def at_layer(self, layer: jax.Array | None) -> "KVCache":
        """Layer `layer`'s view of this stacked cache (None: the stack itself again)."""
        return self.replace(layer=layer)

    def constrained(self) -> "KVCache":
        """The cache (a stack or one layer's slice) sharded by the rules."""
        return self.replace(k=constrain(self.k, *_layer_axes(self.k.ndim, CACHE_AXES)),
                            v=constrain(self.v, *_layer_axes(self.v.ndim, CACHE_AXES)),
                            segments=constrain(self.segments,
                                               *_layer_axes(self.segments.ndim, SEGMENT_AXES)))

    def write(self, k_BTKD: jax.Array, v_BTKD: jax.Array, index: jax.Array,
              segments_BT: jax.Array | None = None) -> "KVCache":
        """This layer's cache with new keys/values (and segment ids, default 1) written at
        slots index..index+T-1 (in the stack, at its layer, for a layer's view)."""
        if segments_BT is None:
            segments_BT = jnp.ones(k_BTKD.shape[:2], jnp.int32)
        put = lambda old, new_BTKD: put_slots(old, jnp.swapaxes(new_BTKD, 1, 2),
                                              (0, 0, index, 0), self.layer)
        return self.replace(k=put(self.k, k_BTKD), v=put(self.v, v_BTKD),
                            segments=put_slots(self.segments, segments_BT.astype(jnp.int32),
                                               (0, index), self.layer))

    def read(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """This layer's (keys (B, K, S, D), values (B, K, S, D), segment ids (B, S))."""
        return tuple(layer_of(a, self.layer) for a in (self.k, self.v, self.segments))

    def __getitem__(self, name: str) -> jax.Array:
        return getattr(self, name)


class Attention(nnx.Module):
    """Grouped-query causal attention; shards over `batch`, `heads` and `kv`."""

    # Read through `project`: may carry LoRA adapters. q/k/v are the parts of one fused weight
    # `wqkv` (E, K, G + 2, D), grouped by kv head (`nn/fused.py` says why): one matmul, so
    # one input all-reduce under tensor parallelism.
    LORA_WEIGHTS = ("wq", "wk", "wv", "wo")
    FUSED = {"wqkv": QKV}

    def __init__(self, embed: int, heads: int, kv_heads: int, head_dim: int,
                 rope: Rope | float, policy: Policy, impl: str, rngs: nnx.Rngs, *,
                 stack: int | None = None, window: int | None = None,
                 context_impl: str = "allgather", qkv_bias: bool = False,
                 qk_norm: bool = False, norm_eps: float = 1e-6, norm_offset: bool = False,
                 query_pre_attn_scalar: float = 0.0, local_rope: Rope | None = None,
                 softcap: float = 0.0, sinks: bool = False, out_bias: bool = False):
        if heads % kv_heads:
            raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads}.")
        check_impl(impl)
        kw = dict(stack=stack, dtype=policy.param)
        self.wqkv = param(rngs, (embed, kv_heads, heads // kv_heads + 2, head_dim),
                          ("embed", "kv", FUSED_AXIS, "head_dim"), fan_in=embed, **kw)
        self.wo = param(rngs, (heads, head_dim, embed), ("heads", "head_dim", "embed"),
                        fan_in=heads * head_dim, **kw)
        self.rope = rope if isinstance(rope, Rope) else Rope(theta=float(rope))
        self.policy, self.impl = policy, impl
        self.window = window or 0  # sliding window (`model.sliding_window`); 0: full causal
        self.context_impl = context_impl  # across sequence shards (`sequence/context.py`)
        # Gemma: scores scaled by 1/sqrt(query_pre_attn_scalar) instead of 1/sqrt(head_dim),
        # applied to q so every kernel keeps its own 1/sqrt(head_dim); 0: head_dim.
        scalar = query_pre_attn_scalar or head_dim
        self.query_scale = math.sqrt(head_dim / scalar)
        # Gemma's local/global pattern: the rotary of local layers (a per-layer `local` flag
        # picks it and the window, `Block.per_layer`); None: one rotary for every layer.
        self.local_rope = local_rope
        self.softcap = softcap  # Gemma 2: scores soft-capped at this (0: not)
        self._init_options(kv_heads, heads // kv_heads, head_dim, qkv_bias, qk_norm, norm_eps,
                           stack, norm_offset)
        # GPT-OSS: a learned logit per query head in every softmax denominator (`sinks`, (H,)),
        # and a bias on the output projection (`bo`, (E,)); both start at zero.
        self.has_sinks, self.out_bias = sinks, out_bias
        if sinks:
            self.sinks = param(None, (heads,), ("heads",), init="zeros", **kw)
        if out_bias:
            self.bo = param(None, (embed,), ("embed",), init="zeros", **kw)

    def _init_options(self, kv_heads: int, group: int, head_dim: int, qkv_bias: bool,
                      qk_norm: bool, norm_eps: float, stack: int | None,
                      norm_offset: bool = False) -> None:
        """The decoder's switches (Qwen2/2.5, Qwen3): a q/k/v bias `bqkv` (K, G + 2, D) fused
        like `wqkv` (`nn/fused.py`) and with its output axes, so the `kv` rule shards it
        with the kernel; per-head RMSNorms of q and k before rotary (`q_norm`, `k_norm`, scale
        on `head_dim`). Off, the module holds exactly the Llama's parameters."""
        self.qkv_bias, self.qk_norm = qkv_bias, qk_norm
        if qkv_bias:
            self.bqkv = param(None, (kv_heads, group + 2, head_dim),
                              ("kv", FUSED_AXIS, "head_dim"), init="zeros", stack=stack,
                              dtype=self.policy.param)
        if qk_norm:
            norm = lambda: RMSNorm(head_dim, norm_eps, self.policy, stack=stack, axis="head_dim",
                                   offset=norm_offset)
            self.q_norm, self.k_norm = norm(), norm()

    def _biased(self, qkv_BTKCD: jax.Array) -> jax.Array:
        """The fused q/k/v projection plus its bias, when the model has one."""
        if not self.qkv_bias:
            return qkv_BTKCD
        return qkv_BTKCD + self.bqkv[...].astype(qkv_BTKCD.dtype)[None, None]

    def _normed(self, q_BTHD: jax.Array, k_BTKD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q and k, each head RMS-normalised over `head_dim` when the model has qk-norm."""
        if not self.qk_norm:
            return q_BTHD, k_BTKD
        return self.q_norm(q_BTHD), self.k_norm(k_BTKD)

    def _rotated(self, x_BTND: jax.Array, positions_BT: jax.Array,
                 local: jax.Array | None) -> jax.Array:
        """Rotary of this layer: the local layers' own (`local_rope`) where `local` is set."""
        if local is None or self.local_rope is None:
            return rotary(x_BTND, positions_BT, self.rope)
        return jnp.where(local, rotary(x_BTND, positions_BT, self.local_rope),
                         rotary(x_BTND, positions_BT, self.rope))

    def __call__(self, x_BTE: jax.Array, positions_BT: jax.Array, cache: KVCache | None = None,
                 cache_index: jax.Array | None = None, segments_BT: jax.Array | None = None,
                 local: jax.Array | None = None) -> jax.Array | tuple[jax.Array, KVCache]:
        """Attention output (B, T, E); with a `cache`, (output, cache with this call's keys and
        values written at `cache_index`), attending over every slot written so far. With
        `segments_BT` (packed documents), a query sees only keys of its own segment. `local`
        (a traced bool, this layer's entry of a local/global pattern): the sliding window and
        the local rotary apply only where it is set."""
        c = self.policy.compute
        # Activation names (`checkpoint_name`) are what the named remat policies keep
        # (`nn/scan.py`): a name on anything else would change nothing else.
        qkv_BTKCD = constrain(project(self, "wqkv", "bte,ekcd->btkcd", x_BTE, c),
                              "batch", "length", "kv", FUSED_AXIS, "head_dim")
        qkv_BTKCD = checkpoint_name(self._biased(qkv_BTKCD), "qkv_proj")
        q_BTHD, k_BTKD, v_BTKD = QKV.split(qkv_BTKCD)
        q_BTHD, k_BTKD = self._normed(q_BTHD, k_BTKD)
        q_BTHD = self._rotated(q_BTHD, positions_BT, local)
        if self.query_scale != 1.0:
            q_BTHD = q_BTHD * jnp.asarray(self.query_scale, q_BTHD.dtype)
        q_BTHD = constrain(q_BTHD, "batch", "length", "heads", "head_dim")
        k_BTKD = constrain(self._rotated(k_BTKD, positions_BT, local),
                           "batch", "length", "kv", "head_dim")
        v_BTKD = constrain(v_BTKD, "batch", "length", "kv", "head_dim")
        t = x_BTE.shape[1]
        window = self.window if local is None else jnp.where(local, self.window, 0)
        softmax = self.policy.dtype_for("softmax")
        sinks_H = self.sinks[...].astype(jnp.float32) if self.has_sinks else None
        if cache is None:
            mask = Mask.sequence(t, segments_BT, window=window, local_window=self.window)
            out_BTHD = attend(q_BTHD, k_BTKD, v_BTKD, mask, impl=self.impl,
                              softmax_dtype=softmax, context_impl=self.context_impl,
                              softcap=self.softcap, sinks_H=sinks_H)
        else:
            cache = cache.write(k_BTKD, v_BTKD, cache_index, segments_BT).constrained()
            k_BKSD, v_BKSD, cached_segments_BS = cache.read()
            mask = Mask.cached(t, cache_index, k_BKSD.shape[2], segments_BT, cached_segments_BS,
                               window=window)
            out_BTHD = attend_cached(q_BTHD, k_BKSD.astype(c), v_BKSD.astype(c), mask,
                                     impl=self.impl, softmax_dtype=softmax,
                                     softcap=self.softcap, sinks_H=sinks_H)
        out_BTHD = checkpoint_name(constrain(out_BTHD, "batch", "length", "heads", "head_dim"),
                                   "attn_out")
        out_BTE = project(self, "wo", "bthd,hde->bte", out_BTHD, c)
        if self.out_bias:
            out_BTE = out_BTE + self.bo[...].astype(out_BTE.dtype)[None, None]
        out_BTE = constrain(out_BTE, "batch", "length", "embed")
        out_BTE = checkpoint_name(out_BTE, "out_proj")
        return out_BTE if cache is None else (out_BTE, cache)


def switches(cfg: Any) -> dict[str, Any]:
    """The `Attention` keywords of a decoder config's switches. A pattern of one kind is static:
    its window (none for global layers) and rotary; a mixed one is chosen per layer."""
    local = set(cfg.local_layers)
    window = cfg.sliding_window if True in local else 0
    mixed = dict(local_rope=cfg.local_rope) if len(local) > 1 and cfg.rope_local_theta else {}
    return dict(window=window, context_impl=cfg.context_attention,
                qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps,
                norm_offset=cfg.norm_offset, query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                softcap=cfg.attn_softcap, sinks=cfg.attn_sinks, out_bias=cfg.out_bias, **mixed)


def block_rope(cfg: Any) -> Rope:
    """The rotary a block's attention starts from: the local one when every layer is local."""
    return cfg.local_rope if all(cfg.local_layers) else cfg.rope


class GroupedQuery(AttentionKind):
    """The grouped-query component: K kv heads, each shared by H / K query heads; a (k, v)
    cache of (K, D) per slot. Reads `embed`, `num_heads`, `num_kv_heads`, `head_dim` and the
    decoder's switches (`switches`) of the config."""

    def check(self) -> None:
        h, k, d = self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim
        if k < 1 or h % k:
            raise ConfigError(paragraph(
                f"model.num_heads={h} must be a multiple of model.num_kv_heads={k} (grouped-query",
                "attention shares each kv head among a group)."))
        if d % 2:
            raise ConfigError(f"model.head_dim={d} must be even for rotary embeddings.")

    def build(self, policy: Policy, rngs: nnx.Rngs, stack: int | None) -> Attention:
        c = self.cfg
        return Attention(c.embed, c.num_heads, c.num_kv_heads, c.head_dim, block_rope(c),
                         policy, c.attention, rngs, stack=stack, **switches(c))

    def init_cache(self, layers: int, batch: int, max_len: int, dtype: Any) -> KVCache:
        return KVCache.zeros(layers, batch, max_len, self.cfg.num_kv_heads, self.cfg.head_dim,
                             dtype)

    def num_params(self) -> int:
        c = self.cfg
        qkv = c.head_dim * (c.num_heads + 2 * c.num_kv_heads)  # per embed row; the bias's size
        return (c.embed * qkv + c.num_heads * c.head_dim * c.embed
                + c.qkv_bias * qkv + c.qk_norm * 2 * c.head_dim
                + c.attn_sinks * c.num_heads + c.out_bias * c.embed)

    def named_matmuls(self) -> dict[str, int]:
        c = self.cfg
        return {"qkv_proj": c.embed * c.head_dim * (c.num_heads + 2 * c.num_kv_heads),
                "out_proj": c.num_heads * c.head_dim * c.embed}

    def score_flops(self, seq_len: int) -> float:
        """QK^T and AV over the keys each layer sees: `seq_len`, or on a sliding-window layer
        min(sliding_window, seq_len) (GPT-OSS: 128 on every other layer), averaged over the
        layers (the counts multiply this by the layer count)."""
        keys = self._keys(seq_len)
        return 4.0 * self.cfg.num_heads * self.cfg.head_dim * sum(keys) / len(keys)

    def masked_score_flops(self, seq_len: int) -> float:
        """The einsum kernel computes every score and masks those outside the window."""
        return 4.0 * self.cfg.num_heads * self.cfg.head_dim * seq_len - self.score_flops(seq_len)

    def _keys(self, seq_len: int) -> list[int]:
        """Keys a query sees on each layer (PaLM's convention: no causal saving)."""
        window = self.cfg.sliding_window or 0
        local = self.cfg.local_layers or (False,)
        return [min(window, seq_len) if window and is_local else seq_len for is_local in local]

    def activation_widths(self) -> dict[str, int]:
        c = self.cfg
        return {"qkv_proj": (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                "attn_out": c.num_heads * c.head_dim, "out_proj": c.embed}

    def kv_elements(self, tensor: int = 1) -> float:
        """Keys and values of K / tensor kv heads (all K on each shard when tensor > K: the
        `kv` rule then leaves them replicated)."""
        k = self.cfg.num_kv_heads
        return 2.0 * k / min(tensor, k) * self.cfg.head_dim

