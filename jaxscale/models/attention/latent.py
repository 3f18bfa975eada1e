"""Multi-head latent attention (DeepSeek-V2 / V3, `model.attention_kind=latent`) and its cache.

Why a component of its own: keys and values are not projected per head from the residual
stream but up-projected from a small per-token latent c (`kv_lora_rank` wide, RMS-normalised),
with one extra key part shared by every head that carries the rotary (`qk_rope_head_dim`); the
query is projected through its own low-rank bottleneck (`q_lora_rank`, normalised; 0: one
direct projection, as DeepSeek-V2-Lite). A head's query and key are [nope | rope]
(`qk_nope_head_dim` + `qk_rope_head_dim` wide) while its value is `v_head_dim` wide, so the
score and value head dims differ.

Two ways of computing the same attention:
- Expanded (training, evaluation, any call without a cache): [k_nope | v] = c.Wkv_b per head
  (Wk_b and Wv_b: the two parts of that one weight, `wkv_b`), then ordinary multi-head
  attention with `kernels.attend`. einsum and splash take a value head dim unlike the key's;
  the fused `dot_product_attention` kernel and attention across sequence shards need them
  equal, so there the values are zero-padded to the key's width and the padding sliced off
  the output (exact: zero columns add nothing).
- Absorbed (any call with a cache: prefill and decoding): the cache holds only c and the
  rotated rope key, `kv_lora_rank + qk_rope_head_dim` numbers per token and layer (not per
  head). Since q_nope.k_nope = (q_nope.Wk_b^T).c, the query is moved into latent space
  (q_lat = q_nope.Wk_b^T per head), the scores are [q_lat | q_rope].[c | k_rope], the values
  are c itself, and the output returns through Wv_b before `wo`: multi-query attention over the
  cache with one shared "head" of width kv_lora_rank + qk_rope_head_dim. It reuses `attend`
  (and its masks) unchanged; the query is rescaled so the kernel's 1/sqrt(width) equals the
  expanded form's 1/sqrt(qk_nope + qk_rope).

The softmax scale is 1/sqrt(qk_nope + qk_rope) times `softmax_scale` (DeepSeek's YaRN
mscale_all_dim term squared when the rotary is YaRN-scaled: `Rope.score_scale`). Rotary runs
on the rope parts in the "rotate half" layout: DeepSeek's interleaved pairs are permuted into it
when weights are imported (`interop/hf_deepseek.py`).
Shape suffixes: B batch, T query length, S key length (cache length), H heads, E embed,
Q q_lora_rank, C kv_lora_rank (the latent), N qk_nope_head_dim, R qk_rope_head_dim,
D qk head dim (N + R), V v_head_dim, L layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.attention.component import AttentionKind, layer_of, put_slots
from jaxscale.models.attention.kernels import attend, check_impl
from jaxscale.models.attention.mask import Mask
from jaxscale.models.attention.sequence import context
from jaxscale.models.nn.layers import RMSNorm, param, project, weight
from jaxscale.models.nn.rope import Rope, rotary
from jaxscale.precision import Policy
from jaxscale.rules import constrain

# The latent norms' epsilon: DeepSeek's `q_a_layernorm` / `kv_a_layernorm` are built with the
# RMSNorm default, not the model's rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# Logical axes of the stacked cache (latent and rope key: replicated over `tensor`, every head
# reads them, as multi-query attention's one kv head); a layer's slice drops the first.
CACHE_AXES = ("layers", "batch", "length", None)
# Kernels that take a value head dim unlike the key's (others get zero-padded values).
UNEQUAL_DIMS = ("einsum", "splash")


@dataclass(frozen=True)
class MLAConfig:
    """`config.model.mla`: the latent attention's widths (DeepSeek-V3's by default)."""

    q_lora_rank: int = 1536       # the query's bottleneck; 0: q projected directly (V2-Lite)
    kv_lora_rank: int = 512       # the cached latent c
    qk_rope_head_dim: int = 64    # the rotary part of q and k (k's shared by every head)
    qk_nope_head_dim: int = 128   # the part of q and k without position
    v_head_dim: int = 128

    @classmethod
    def from_config(cls, mla_cfg: Mapping[str, Any] | None) -> "MLAConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(mla_cfg or {}).items() if k in names})

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@flax.struct.dataclass
class LatentCache:
    """Every cache slot's normalised latent (B, S, C) and rotated rope key (B, S, R), (L, ...)
    stacked, and its segment id (0: padding or not yet written), as `KVCache` keeps them;
    `layer` set (`at_layer`): a layer's view of the stack, written in place (`component.py`)."""

    latent: jax.Array
    k_rope: jax.Array
    segments: jax.Array
    layer: jax.Array | None = None

    @classmethod
    def zeros(cls, layers: int, batch: int, max_len: int, mla: MLAConfig, dtype: Any
              ) -> "LatentCache":
        """An empty stacked cache, sharded by the rules through its logical names."""
        zeros = lambda width: constrain(jnp.zeros((layers, batch, max_len, width), dtype),
                                        *CACHE_AXES)
        segments = constrain(jnp.zeros((layers, batch, max_len), jnp.int32), *CACHE_AXES[:3])
        return cls(zeros(mla.kv_lora_rank), zeros(mla.qk_rope_head_dim), segments)

    def at_layer(self, layer: jax.Array | None) -> "LatentCache":
        """Layer `layer`'s view of this stacked cache (None: the stack itself again)."""
        return self.replace(layer=layer)

    def constrained(self) -> "LatentCache":
        """The cache (a stack or one layer's slice) sharded by the rules."""
        axes = CACHE_AXES[len(CACHE_AXES) - self.latent.ndim:]
        return self.replace(latent=constrain(self.latent, *axes),
                            k_rope=constrain(self.k_rope, *axes),
                            segments=constrain(self.segments, *axes[:-1]))

    def write(self, latent_BTC: jax.Array, k_rope_BTR: jax.Array, index: jax.Array,
              segments_BT: jax.Array | None = None) -> "LatentCache":
        """This layer's cache with the new tokens written at slots index..index+T-1."""
        if segments_BT is None:
            segments_BT = jnp.ones(latent_BTC.shape[:2], jnp.int32)
        put = lambda old, new: put_slots(old, new, (0, index, 0), self.layer)
        return self.replace(latent=put(self.latent, latent_BTC),
                            k_rope=put(self.k_rope, k_rope_BTR),
                            segments=put_slots(self.segments, segments_BT.astype(jnp.int32),
                                               (0, index), self.layer))

    def read(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """This layer's (latents (B, S, C), rope keys (B, S, R), segment ids (B, S))."""
        return tuple(layer_of(a, self.layer) for a in (self.latent, self.k_rope, self.segments))

    def __getitem__(self, name: str) -> jax.Array:
        return getattr(self, name)


def _attend(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKV: jax.Array, mask: Mask, impl: str,
            **kw: Any) -> jax.Array:
    """`attend`, with the narrower of the key and value head dims zero-padded to the other's
    (and the padding sliced off the output) where the kernel or the sequence shards need them
    equal. Exact: zero value columns add nothing; zero query/key columns add no score (the
    query is rescaled so the kernel's 1/sqrt(width) stays that of the unpadded width)."""
    dv, dk = v_BSKV.shape[-1], k_BSKD.shape[-1]
    shards = context.sequence_shards(q_BTHD.shape[1], impl) if mask.aligned else None
    if dv == dk or (impl in UNEQUAL_DIMS and shards is None):
        return attend(q_BTHD, k_BSKD, v_BSKV, mask, impl=impl, **kw)
    pad = lambda x, width: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    if dk > dv:
        return attend(q_BTHD, k_BSKD, pad(v_BSKV, dk), mask, impl=impl, **kw)[..., :dv]
    q_BTHD = pad(q_BTHD, dv) * jnp.asarray(math.sqrt(dv / dk), q_BTHD.dtype)
    return attend(q_BTHD, pad(k_BSKD, dv), v_BSKV, mask, impl=impl, **kw)


class LatentAttention(nnx.Module):
    """Multi-head latent attention; shards over `batch` and `heads` (the latent and the rope
    key are replicated over `tensor`, as one kv head)."""

    # Read through `project` (or whole through `weight` when absorbed): may carry LoRA adapters.
    LORA_WEIGHTS = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")

    def __init__(self, embed: int, heads: int, mla: MLAConfig, rope: Rope, policy: Policy,
                 impl: str, rngs: nnx.Rngs, *, stack: int | None = None,
                 context_impl: str = "allgather", softmax_scale: float = 1.0):
        check_impl(impl)
        kw = dict(stack=stack, dtype=policy.param)
        q, c, d = mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim
        if q:
            self.wq_a = param(rngs, (embed, q), ("embed", "q_lora"), fan_in=embed, **kw)
            self.q_norm = RMSNorm(q, LATENT_NORM_EPS, policy, stack=stack)
            self.wq_b = param(rngs, (q, heads, d), ("q_lora", "heads", "head_dim"), fan_in=q,
                              **kw)
        else:
            self.wq = param(rngs, (embed, heads, d), ("embed", "heads", "head_dim"),
                            fan_in=embed, **kw)
        self.wkv_a = param(rngs, (embed, c + mla.qk_rope_head_dim), ("embed", None),
                           fan_in=embed, **kw)
        self.kv_norm = RMSNorm(c, LATENT_NORM_EPS, policy, stack=stack)
        # The key's nope part and the value, per head [k_nope | v] (DeepSeek's kv_b_proj):
        # one up-projection of the latent, one matmul.
        self.wkv_b = param(rngs, (c, heads, mla.qk_nope_head_dim + mla.v_head_dim),
                           ("kv_lora", "heads", "head_dim"), fan_in=c, **kw)
        self.wo = param(rngs, (heads, mla.v_head_dim, embed), ("heads", "head_dim", "embed"),
                        fan_in=heads * mla.v_head_dim, **kw)
        self.mla, self.rope, self.policy, self.impl = mla, rope, policy, impl
        self.context_impl, self.softmax_scale = context_impl, softmax_scale

    def _query(self, x_BTE: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q_nope (B, T, H, N), rotated q_rope (B, T, H, R)), the softmax scale folded in."""
        c = self.policy.compute
        if self.mla.q_lora_rank:
            q_BTQ = self.q_norm(project(self, "wq_a", "bte,eq->btq", x_BTE, c))
            q_BTHD = project(self, "wq_b", "btq,qhd->bthd", q_BTQ, c)
        else:
            q_BTHD = project(self, "wq", "bte,ehd->bthd", x_BTE, c)
        q_BTHD = checkpoint_name(constrain(q_BTHD, "batch", "length", "heads", "head_dim"),
                                 "qkv_proj")
        if self.softmax_scale != 1.0:
            q_BTHD = q_BTHD * jnp.asarray(self.softmax_scale, q_BTHD.dtype)
        n = self.mla.qk_nope_head_dim
        return q_BTHD[..., :n], rotary(q_BTHD[..., n:], positions_BT, self.rope)

    def _latent(self, x_BTE: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(normalised latent (B, T, C), rotated rope key (B, T, R)): what the cache keeps."""
        kv_BTX = project(self, "wkv_a", "bte,ex->btx", x_BTE, self.policy.compute)
        kv_BTX = checkpoint_name(constrain(kv_BTX, "batch", "length", None), "qkv_proj")
        c = self.mla.kv_lora_rank
        k_rope_BT1R = rotary(kv_BTX[:, :, None, c:], positions_BT, self.rope)
        return self.kv_norm(kv_BTX[..., :c]), k_rope_BT1R[:, :, 0]

    def _expanded(self, q_nope_BTHN: jax.Array, q_rope_BTHR: jax.Array, latent_BTC: jax.Array,
                  k_rope_BTR: jax.Array, mask: Mask) -> jax.Array:
        """Attention with per-head keys and values up-projected from the latent: (B, T, H, V)."""
        c = self.policy.compute
        kv_BTHX = checkpoint_name(project(self, "wkv_b", "btc,chx->bthx", latent_BTC, c),
                                  "qkv_proj")
        n = self.mla.qk_nope_head_dim
        k_nope_BTHN, v_BTHV = kv_BTHX[..., :n], kv_BTHX[..., n:]
        heads = k_nope_BTHN.shape[2]
        k_rope_BTHR = jnp.broadcast_to(k_rope_BTR[:, :, None], (*k_rope_BTR.shape[:2], heads,
                                                                k_rope_BTR.shape[-1]))
        axes = ("batch", "length", "heads", "head_dim")
        q_BTHD = constrain(jnp.concatenate([q_nope_BTHN, q_rope_BTHR], -1), *axes)
        k_BTHD = constrain(jnp.concatenate([k_nope_BTHN, k_rope_BTHR.astype(c)], -1), *axes)
        return _attend(q_BTHD, k_BTHD, constrain(v_BTHV, *axes), mask, self.impl,
                       softmax_dtype=self.policy.dtype_for("softmax"),
                       context_impl=self.context_impl)

    def _absorbed(self, q_nope_BTHN: jax.Array, q_rope_BTHR: jax.Array, latent_BSC: jax.Array,
                  k_rope_BSR: jax.Array, mask: Mask) -> jax.Array:
        """Attention over the cached latents with the up-projections absorbed into the query
        and output (multi-query, one shared head of C + R): (B, T, H, V)."""
        c, n = self.policy.compute, self.mla.qk_nope_head_dim
        wkv_CHX = weight(self, "wkv_b").astype(c)
        q_lat_BTHC = jnp.einsum("bthn,chn->bthc", q_nope_BTHN, wkv_CHX[..., :n])
        q_BTHX = jnp.concatenate([q_lat_BTHC, q_rope_BTHR], -1)
        # The kernel divides by sqrt(C + R); the expanded form by sqrt(N + R).
        q_BTHX = q_BTHX * jnp.asarray(math.sqrt(q_BTHX.shape[-1] / self.mla.qk_head_dim), c)
        latent_BSC, k_rope_BSR = latent_BSC.astype(c), k_rope_BSR.astype(c)
        k_BS1X = jnp.concatenate([latent_BSC, k_rope_BSR], -1)[:, :, None]
        out_BTHC = _attend(constrain(q_BTHX, "batch", "length", "heads", None), k_BS1X,
                           latent_BSC[:, :, None], mask, self.impl,
                           softmax_dtype=self.policy.dtype_for("softmax"))
        return jnp.einsum("bthc,chv->bthv", out_BTHC, wkv_CHX[..., n:])

    def __call__(self, x_BTE: jax.Array, positions_BT: jax.Array,
                 cache: LatentCache | None = None, cache_index: jax.Array | None = None,
                 segments_BT: jax.Array | None = None, local: jax.Array | None = None
                 ) -> jax.Array | tuple[jax.Array, LatentCache]:
        """Attention output (B, T, E); with a `cache`, (output, cache with this call's latents
        written at `cache_index`), attending over every slot written so far (absorbed form).
        `local` is the decoder's per-layer window flag, which latent attention does not take
        (its config check refuses windows)."""
        c = self.policy.compute
        q_nope_BTHN, q_rope_BTHR = self._query(x_BTE, positions_BT)
        latent_BTC, k_rope_BTR = self._latent(x_BTE, positions_BT)
        t = x_BTE.shape[1]
        if cache is None:
            out_BTHV = self._expanded(q_nope_BTHN, q_rope_BTHR, latent_BTC, k_rope_BTR,
                                      Mask.sequence(t, segments_BT))
        else:
            cache = cache.write(latent_BTC, k_rope_BTR, cache_index, segments_BT).constrained()
            latent_BSC, k_rope_BSR, cached_segments_BS = cache.read()
            mask = Mask.cached(t, cache_index, latent_BSC.shape[1], segments_BT,
                               cached_segments_BS)
            out_BTHV = self._absorbed(q_nope_BTHN, q_rope_BTHR, latent_BSC, k_rope_BSR, mask)
        out_BTHV = checkpoint_name(constrain(out_BTHV, "batch", "length", "heads", "head_dim"),
                                   "attn_out")
        out_BTE = constrain(project(self, "wo", "bthv,hve->bte", out_BTHV, c),
                            "batch", "length", "embed")
        out_BTE = checkpoint_name(out_BTE, "out_proj")
        return out_BTE if cache is None else (out_BTE, cache)


# The decoder switches latent attention has no place for: (field, value that is off).
_REFUSED = (("sliding_window", 0), ("layer_types", ()), ("qkv_bias", False),
            ("qk_norm", False), ("attn_softcap", 0.0), ("query_pre_attn_scalar", 0.0),
            ("out_bias", False), ("attn_sinks", False))


class Latent(AttentionKind):
    """The latent component: reads `embed`, `num_heads`, `model.mla` and the rotary of the
    config; a cache of C + R numbers per token and layer (`LatentCache`)."""

    @property
    def mla(self) -> MLAConfig:
        return self.cfg.mla

    def check(self) -> None:
        m, c = self.mla, self.cfg
        widths = {f.name: getattr(m, f.name) for f in fields(m)}
        if any(v < 0 for v in widths.values()) or min(
                m.kv_lora_rank, m.qk_rope_head_dim, m.v_head_dim) < 1 or m.qk_rope_head_dim % 2:
            raise ConfigError(paragraph(
                f"model.mla={widths} must hold positive kv_lora_rank, qk_rope_head_dim (even,",
                "for rotary pairs) and v_head_dim, and non-negative q_lora_rank (0: the query",
                "projected directly) and qk_nope_head_dim (DeepSeek-V3: 1536, 512, 64, 128, 128)."))
        switched = [(k, getattr(c, k)) for k, off in _REFUSED
                    if getattr(c, k, off) not in (off, None, (), 0)]
        if switched:
            raise ConfigError(paragraph(
                f"model.{switched[0][0]}={switched[0][1]!r} has no place in latent attention",
                "(model.attention_kind=latent, DeepSeek's): it has no window, q/k/v or output",
                "biases, q/k norms beyond its latent norms, score soft-cap, query scalar or",
                "attention sinks. Turn the switch off, or use model.attention_kind=grouped_query."))

    def softmax_scale(self) -> float:
        """The factor on 1/sqrt(qk_head_dim): under YaRN DeepSeek's mscale_all_dim term squared
        (`Rope.score_scale`, transformers' `yarn_apply_mscale`), 1 otherwise. The rotation's
        own attention factor on q and k (the rope parts) is `rotary`'s."""
        return self.cfg.rope.score_scale

    def build(self, policy: Policy, rngs: nnx.Rngs, stack: int | None) -> LatentAttention:
        c = self.cfg
        return LatentAttention(c.embed, c.num_heads, self.mla, c.rope, policy, c.attention,
                               rngs, stack=stack, context_impl=c.context_attention,
                               softmax_scale=self.softmax_scale())

    def init_cache(self, layers: int, batch: int, max_len: int, dtype: Any) -> LatentCache:
        return LatentCache.zeros(layers, batch, max_len, self.mla, dtype)

    def num_params(self) -> int:
        m = self.mla
        norms = m.q_lora_rank + m.kv_lora_rank
        return sum(self.named_matmuls().values()) + norms

    def named_matmuls(self) -> dict[str, int]:
        m, e, h = self.mla, self.cfg.embed, self.cfg.num_heads
        q = (e * m.q_lora_rank + m.q_lora_rank * h * m.qk_head_dim if m.q_lora_rank
             else e * h * m.qk_head_dim)
        kv = e * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (
            m.qk_nope_head_dim + m.v_head_dim)
        return {"qkv_proj": q + kv, "out_proj": h * m.v_head_dim * e}

    def score_flops(self, seq_len: int) -> float:
        """QK^T over the qk head dim and AV over the value head dim (the expanded form)."""
        m = self.mla
        return 2.0 * self.cfg.num_heads * (m.qk_head_dim + m.v_head_dim) * seq_len

    def activation_widths(self) -> dict[str, int]:
        m, h = self.mla, self.cfg.num_heads
        return {"qkv_proj": h * m.qk_head_dim + m.kv_lora_rank + m.qk_rope_head_dim
                + h * (m.qk_nope_head_dim + m.v_head_dim),
                "attn_out": h * m.v_head_dim, "out_proj": self.cfg.embed}

    def kv_elements(self, tensor: int = 1) -> float:
        """The latent and the rope key, whole on every `tensor` shard (one shared head)."""
        return float(self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
