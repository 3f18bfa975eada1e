"""A toy attention kind for tests (`shared_kv`): one key/value latent per position for all heads.

What it proves: a new attention layout is one module (this one) plus one line in
`models/attention/kinds.py`'s `ATTENTIONS` (the tests add it to the table with monkeypatch, so
nothing is shipped or registered by importing this file). Every query head attends to a single
(D,) vector per position, rotated and used as both key and value; the cache holds that latent
alone, (layers, batch, slots, D) with the slots' segment ids, not grouped-query's (k, v) of
(kv heads, D). The decoder block, its FLOP counts, generation and the AOT memory and traffic
models ask this component and need no edit.
Shape suffixes: B batch, T query length, S cache length, H heads, D head dim, E embed.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.errors import ConfigError
from jaxscale.models.attention.component import AttentionKind
from jaxscale.models.attention.kernels import attend
from jaxscale.models.attention.mask import Mask
from jaxscale.models.nn.layers import param, project
from jaxscale.models.nn.rope import Rope, rotary
from jaxscale.precision import Policy
from jaxscale.rules import constrain

AXES = ("layers", "batch", "length", "head_dim")  # the latent's, stacked over the layers


@flax.struct.dataclass
class LatentCache:
    """The latent of every slot, (L, B, S, D) stacked or (B, S, D) for one layer, and each
    slot's segment id (0: padding or not yet written)."""

    kv: jax.Array
    segments: jax.Array

    @classmethod
    def zeros(cls, layers: int, batch: int, max_len: int, head_dim: int,
              dtype: Any) -> LatentCache:
        return cls(jnp.zeros((layers, batch, max_len, head_dim), dtype),
                   jnp.zeros((layers, batch, max_len), jnp.int32)).constrained()

    def constrained(self, axes: tuple[str, ...] = AXES) -> LatentCache:
        return LatentCache(constrain(self.kv, *axes), constrain(self.segments, *axes[:-1]))

    def write(self, kv_BTD: jax.Array, index: jax.Array,
              segments_BT: jax.Array | None) -> LatentCache:
        if segments_BT is None:
            segments_BT = jnp.ones(kv_BTD.shape[:2], jnp.int32)
        update = jax.lax.dynamic_update_slice
        return LatentCache(update(self.kv, kv_BTD.astype(self.kv.dtype), (0, index, 0)),
                           update(self.segments, segments_BT.astype(jnp.int32), (0, index)))


class SharedKVAttention(nnx.Module):
    """Causal attention of H query heads over one shared, rotated key/value latent."""

    LORA_WEIGHTS = ("wq", "wkv", "wo")  # read through `project`

    def __init__(self, embed: int, heads: int, head_dim: int, rope: Rope, policy: Policy,
                 impl: str, rngs: nnx.Rngs, *, stack: int | None, window: int,
                 context_impl: str):
        kw = dict(stack=stack, dtype=policy.param)
        self.wq = param(rngs, (embed, heads, head_dim), ("embed", "heads", "head_dim"),
                        fan_in=embed, **kw)
        self.wkv = param(rngs, (embed, head_dim), ("embed", "head_dim"), fan_in=embed, **kw)
        self.wo = param(rngs, (heads, head_dim, embed), ("heads", "head_dim", "embed"),
                        fan_in=heads * head_dim, **kw)
        self.rope, self.policy, self.impl = rope, policy, impl
        self.window, self.context_impl = window, context_impl

    def __call__(self, x_BTE: jax.Array, positions_BT: jax.Array, cache: LatentCache | None = None,
                 cache_index: jax.Array | None = None, segments_BT: jax.Array | None = None,
                 local: jax.Array | None = None) -> jax.Array | tuple[jax.Array, LatentCache]:
        c = self.policy.compute
        q_BTHD = rotary(project(self, "wq", "bte,ehd->bthd", x_BTE, c), positions_BT, self.rope)
        q_BTHD = constrain(q_BTHD, "batch", "length", "heads", "head_dim")
        kv_BTD = project(self, "wkv", "bte,ed->btd", x_BTE, c)
        kv_BTD = rotary(kv_BTD[:, :, None], positions_BT, self.rope)[:, :, 0]
        t = x_BTE.shape[1]
        if cache is None:
            kv_BSD, mask = kv_BTD, Mask.sequence(t, segments_BT, window=self.window)
        else:
            cache = cache.write(kv_BTD, cache_index, segments_BT).constrained(AXES[1:])
            kv_BSD = cache.kv.astype(c)
            mask = Mask.cached(t, cache_index, kv_BSD.shape[1], segments_BT, cache.segments,
                               window=self.window)
        kv_BS1D = constrain(kv_BSD[:, :, None], "batch", "length", None, "head_dim")
        out_BTHD = attend(q_BTHD, kv_BS1D, kv_BS1D, mask, impl=self.impl,
                          softmax_dtype=self.policy.dtype_for("softmax"),
                          context_impl=self.context_impl)
        out_BTHD = checkpoint_name(constrain(out_BTHD, "batch", "length", "heads", "head_dim"),
                                   "attn_out")
        out_BTE = checkpoint_name(constrain(project(self, "wo", "bthd,hde->bte", out_BTHD, c),
                                            "batch", "length", "embed"), "out_proj")
        return out_BTE if cache is None else (out_BTE, cache)


class SharedKV(AttentionKind):
    """The component: reads `embed`, `num_heads`, `head_dim`, the rotary, the kernel, the
    window and the context variant of the decoder config; refuses the grouped-query switches
    it does not implement."""

    def check(self) -> None:
        c = self.cfg
        unsupported = [n for n in ("qkv_bias", "qk_norm", "attn_softcap", "query_pre_attn_scalar",
                                   "layer_types") if getattr(c, n)]
        if unsupported or c.head_dim % 2:
            raise ConfigError(f"model.attention_kind=shared_kv implements none of {unsupported} "
                              f"and needs an even head_dim (rotary), not {c.head_dim}.")

    def build(self, policy: Policy, rngs: nnx.Rngs, stack: int | None) -> SharedKVAttention:
        c = self.cfg
        return SharedKVAttention(c.embed, c.num_heads, c.head_dim, c.rope, policy, c.attention,
                                 rngs, stack=stack, window=c.sliding_window or 0,
                                 context_impl=c.context_attention)

    def init_cache(self, layers: int, batch: int, max_len: int, dtype: Any) -> LatentCache:
        return LatentCache.zeros(layers, batch, max_len, self.cfg.head_dim, dtype)

    def num_params(self) -> int:
        return self.matmul_params()

    def named_matmuls(self) -> dict[str, int]:
        return {"out_proj": self.cfg.num_heads * self.cfg.head_dim * self.cfg.embed}

    def matmul_params(self) -> int:
        c = self.cfg  # wq, wkv (unnamed: recomputed under every named policy) and wo
        return c.embed * c.head_dim * (2 * c.num_heads + 1)

    def score_flops(self, seq_len: int) -> float:
        return 4.0 * self.cfg.num_heads * self.cfg.head_dim * seq_len

    def activation_widths(self) -> dict[str, int]:
        return {"attn_out": self.cfg.num_heads * self.cfg.head_dim, "out_proj": self.cfg.embed}

    def kv_elements(self, tensor: int = 1) -> float:
        return float(self.cfg.head_dim)  # one latent, on every tensor shard
