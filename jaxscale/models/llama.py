"""A Llama-style decoder-only LM in Flax NNX with a scanned (stacked) layer stack.

The model knows nothing of meshes, training or checkpoints: it declares logical axes and calls
`constrain` on key activations. The layer stack is one `Block` whose parameters carry a leading
`layers` dimension; `__call__` scans over it, and `embed` / `run_layers` / `head` are exposed so a
pipeline schedule can drive the same stack stage by stage. Decoding passes a stacked `KVCache`
(`init_cache`) and the slot to write at: the same modules then return (logits, updated cache).
The language-model task (`LM`: the next-token loss, the packed batch's preparation and the
held-out sums) is in `models/lm_task.py`; its FLOP counts are in `models/llama_flops.py`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.attention import ATTENTION_IMPLS, SOFTCAP_IMPLS, Attention, KVCache
from jaxscale.models.layers import MLP, RMSNorm, param
from jaxscale.models.moe import MoE, MoEConfig, check_moe
from jaxscale.models.moe import num_params as moe_params
from jaxscale.models.rope import Rope, check_rope
from jaxscale.models.runner import LayerRunner
from jaxscale.models.scan import check_remat, scan_layers
from jaxscale.models.shard_sums import batch_shards, lookup
from jaxscale.precision import Policy, get_policy
from jaxscale.rules import constrain


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    embed: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mlp: int = 512
    max_len: int = 2048
    rope_theta: float = 10000.0
    # Rotary scaling (HF `rope_scaling`): none | linear | llama3; see jaxscale/models/rope.py.
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0       # llama3 only
    rope_high_freq_factor: float = 4.0      # llama3 only
    rope_original_max_len: int = 8192       # llama3 only: the pre-extension context length
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    remat: str = "none"
    # The LM head and loss run over the sequence in this many strided chunks, each recomputed
    # in the backward pass (`head_losses`): the (batch, length, vocab) float32 logits and their
    # gradient exist one chunk at a time. 1: the whole sequence at once; 0 (default): automatic,
    # the fewest chunks that keep a chip's logits under `lm_task.LOGITS_BUDGET`.
    loss_chunks: int = 0
    # or "dot_product_attention" (fused; cuDNN flash on GPUs), or "splash" (the Pallas TPU
    # flash kernel: no score matrix in HBM; models/splash.py)
    attention: str = "einsum"
    # Sliding-window attention (Mistral's `sliding_window`): a query at position i sees the keys
    # at i - sliding_window < j <= i only (in training, evaluation and the KV cache alike);
    # 0 or None: the full causal context. Checked by `check_sliding_window`.
    sliding_window: int | None = 0
    # attention across sequence shards (mesh.context > 1): "allgather", "ring" or "ring_vjp"
    # (models/context.py)
    context_attention: str = "allgather"
    # the order of a training sequence over its shards: "auto" (zigzag for the ring when the
    # length allows), "zigzag" (load-balanced causal work) or "natural" (models/context.py)
    context_order: str = "auto"
    # Decoder switches (Qwen2/2.5 and Qwen3 are this model with them on; `models/qwen.py`):
    qkv_bias: bool = False   # a bias on the q/k/v projections
    qk_norm: bool = False    # per-head RMSNorm of q and k before rotary
    # Gemma's switches (`models/gemma.py`):
    norm_offset: bool = False      # RMSNorms scale by 1 + weight (weights start at zero)
    post_norms: bool = False       # RMSNorms after attention and after the MLP too (4 a block)
    embed_scale: bool = False      # embeddings times sqrt(embed), in the compute dtype
    mlp_activation: str = "silu"   # or "gelu_tanh" (GeGLU): `layers.ACTIVATIONS`
    query_pre_attn_scalar: float = 0.0  # scores scaled by 1/sqrt(this); 0: head_dim
    # A local/global pattern: layer i is "sliding_attention" (the `sliding_window`, rotary
    # `rope_local_theta` when set) or "full_attention"; empty: every layer alike (the window,
    # if any, on all). A mixed pattern is scanned as a per-layer flag (`Block.per_layer`).
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 0.0  # rotary base of the local layers; 0: rope_theta
    # Gemma 2's soft-capping, x -> cap * tanh(x / cap), of the attention scores and of the
    # final logits; 0: none. Attention soft-capping runs the einsum or splash kernel.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Mixture of experts in place of the dense MLP (num_experts > 0): jaxscale/models/moe.py.
    moe: MoEConfig = MoEConfig()

    @classmethod
    def from_config(cls, model_cfg: Mapping[str, Any]) -> "LlamaConfig":
        fields = cls.__dataclass_fields__
        kw = {k: v for k, v in dict(model_cfg).items() if k in fields}
        if "moe" in kw:
            kw["moe"] = MoEConfig.from_config(kw["moe"])
        if "layer_types" in kw:
            kw["layer_types"] = tuple(kw["layer_types"] or ())
        return cls(**kw)

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: does it use the sliding window (and the local rotary)? Without
        `layer_types`, every layer does exactly when there is a window."""
        if not self.layer_types:
            return (bool(self.sliding_window),) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def local_rope(self) -> Rope:
        """The local layers' rotary (Gemma 3's `rope_local_base_freq`: plain, unscaled)."""
        return Rope(self.rope_local_theta) if self.rope_local_theta else self.rope

    @property
    def rope(self) -> Rope:
        """The rotary settings every attention layer (and the KV-cache decoder) uses."""
        return Rope(self.rope_theta, self.rope_scaling, self.rope_factor,
                    self.rope_low_freq_factor, self.rope_high_freq_factor,
                    self.rope_original_max_len)

    @property
    def moe_layers(self) -> int:
        """How many layers run the experts: every `moe.every`-th (none without experts)."""
        return self.num_layers // self.moe.every if self.moe.num_experts else 0

    def num_params(self) -> int:
        e, f, l = self.embed, self.mlp, self.num_layers
        attn = e * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        ffn = self.moe_layers * moe_params(self.moe, e, f) + (l - self.moe_layers) * 3 * e * f
        per_layer = attn + 2 * e + self._switch_params()
        head = 0 if self.tie_embeddings else e * self.vocab_size
        return self.vocab_size * e + l * per_layer + ffn + e + head

    def _switch_params(self) -> int:
        """Parameters per layer of the switches: the q/k/v bias and the q/k norm scales."""
        d = self.head_dim
        return (self.qkv_bias * d * (self.num_heads + 2 * self.num_kv_heads)
                + self.qk_norm * 2 * d + self.post_norms * 2 * self.embed)


def check_config(m: Mapping[str, Any], seq_len: int) -> None:
    """The Llama's own `config.model` checks, run by `config.validate` through the model table
    (a ConfigError paragraph naming the field): what would otherwise fail deep inside the build
    or silently compute another model."""
    def require(ok: bool, *sentences: str) -> None:
        if not ok:
            raise ConfigError(paragraph(*sentences))

    require(m["num_heads"] % m["num_kv_heads"] == 0,
            f"model.num_heads={m['num_heads']} must be a multiple of model.num_kv_heads="
            f"{m['num_kv_heads']} (grouped-query attention shares each kv head among a group).")
    require(m["head_dim"] % 2 == 0,
            f"model.head_dim={m['head_dim']} must be even for rotary embeddings.")
    require(seq_len <= m["max_len"], f"data.seq_len={seq_len} exceeds model.max_len={m['max_len']}.")
    check_rope(m)
    attention = m.get("attention", "einsum")
    require(attention in ATTENTION_IMPLS,
            f"model.attention={attention!r}: use one of {', '.join(ATTENTION_IMPLS)}.")
    check_sliding_window(m)
    check_layer_pattern(m)
    chunks = m.get("loss_chunks", 0)
    require(isinstance(chunks, int) and (chunks == 0 or chunks >= 1 and seq_len % chunks == 0),
            f"model.loss_chunks={chunks!r} must be 0 (automatic) or a positive divisor of",
            f"data.seq_len ({seq_len}): the LM head and loss run over the sequence in that many",
            "chunks (1: all at once; 4-16 cut the float32 logits' memory that many times).")
    check_moe(m)


def check_sliding_window(m: Mapping[str, Any]) -> None:
    """`model.sliding_window`: None or a non-negative int (0: full causal attention). Every
    kernel in `ATTENTION_IMPLS` applies it (einsum and the KV cache through `Mask.dense`, the
    fused kernel's `local_window_size`, splash's `LocalMask`), so no kernel is refused."""
    window = m.get("sliding_window", 0)
    if window is None or (isinstance(window, int) and not isinstance(window, bool)
                          and window >= 0):
        return
    raise ConfigError(paragraph(
        f"model.sliding_window={window!r} must be a non-negative integer: the number of",
        "latest positions a query attends to, itself included (Mistral's sliding_window,",
        "e.g. 4096), or 0 for the full causal context.",
    ))


def check_layer_pattern(m: Mapping[str, Any]) -> None:
    """`model.layer_types`: one known kind per layer. A mixed pattern passes each layer's
    window to the mask as a traced value: einsum (and the KV cache) take it, splash chooses
    between its static local and global kernels per layer (`models/splash.py`); the fused
    kernel builds its mask from a static window, so it is refused."""
    kinds = tuple(m.get("layer_types") or ())
    known = ("sliding_attention", "full_attention")
    bad = [k for k in kinds if k not in known]
    if kinds and (bad or len(kinds) != m["num_layers"]):
        raise ConfigError(paragraph(
            f"model.layer_types={list(kinds)!r} must name one of {', '.join(known)} for each",
            f"of the model.num_layers={m['num_layers']} layers (or be empty: every layer alike)."))
    attention = m.get("attention", "einsum")
    if m.get("attn_softcap") and attention not in SOFTCAP_IMPLS:
        raise ConfigError(paragraph(
            f"model.attention={attention!r} does not soft-cap the attention scores",
            f"(model.attn_softcap={m['attn_softcap']}, Gemma 2's): use model.attention=einsum",
            "(or splash on TPUs)."))
    if len(set(kinds)) > 1 and attention not in ("einsum", "splash"):
        raise ConfigError(paragraph(
            f"model.attention={attention!r} cannot follow a mixed model.layer_types (local and",
            "global layers, Gemma's pattern): the layers are scanned, so each layer's window is",
            "a traced value, and that kernel needs a static window. Use model.attention=einsum",
            "(or splash on TPUs)."))


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
        rope = cfg.local_rope if all(cfg.local_layers) else cfg.rope
        self.attn = Attention(cfg.embed, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              rope, policy, cfg.attention, rngs, stack=stack,
                              **attention_switches(cfg))
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

    def __call__(self, h_BTE: jax.Array, positions_BT: jax.Array, cache: KVCache | None = None,
                 cache_index: jax.Array | None = None, segments_BT: jax.Array | None = None,
                 local: jax.Array | None = None) -> jax.Array | tuple[jax.Array, KVCache]:
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

    def __call__(self, h_BTE: jax.Array, positions_BT: jax.Array, cache: KVCache | None = None,
                 cache_index: jax.Array | None = None, segments_BT: jax.Array | None = None,
                 local: jax.Array | None = None) -> jax.Array | tuple[jax.Array, KVCache]:
        """The group's output; with the group's (n, ...) `cache`, (output, updated cache)."""
        caches = []
        for j, block in enumerate(self.blocks()):
            layer_cache = None if cache is None else jax.tree.map(lambda a, j=j: a[j], cache)
            h_BTE = block(h_BTE, positions_BT, layer_cache, cache_index, segments_BT,
                          None if local is None else local[j])
            if cache is not None:
                h_BTE, layer_cache = h_BTE
                caches.append(layer_cache)
        return h_BTE if cache is None else (h_BTE, jax.tree.map(
            lambda *a: jnp.stack(a), *caches))


def layer_stack(cfg: LlamaConfig, policy: Policy, rngs: nnx.Rngs) -> Block | LayerGroup:
    """The scanned stack: one `Block` per layer, or with MoE on every n-th layer
    (`model.moe.every` > 1) one `LayerGroup` of n layers per scan step."""
    n = cfg.moe.every if cfg.moe.num_experts else 1
    if n == 1:
        return Block(cfg, policy, rngs, stack=cfg.num_layers)
    return LayerGroup(cfg, policy, rngs, stack=cfg.num_layers // n)


def attention_switches(cfg: LlamaConfig) -> dict[str, Any]:
    """The `Attention` keywords of the config's decoder switches. A pattern of one kind is
    static: its window (none for global layers) and rotary; a mixed one is chosen per layer."""
    local = set(cfg.local_layers)
    window = cfg.sliding_window if True in local else 0
    mixed = dict(local_rope=cfg.local_rope) if len(local) > 1 and cfg.rope_local_theta else {}
    return dict(window=window, context_impl=cfg.context_attention,
                qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps,
                norm_offset=cfg.norm_offset, query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                softcap=cfg.attn_softcap, **mixed)


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, policy: Policy | None = None):
        policy = policy or get_policy("32-true")
        check_remat(cfg.remat)
        self.cfg, self.policy = cfg, policy
        self.embedding = param(rngs, (cfg.vocab_size, cfg.embed), ("vocab", "embed"),
                               fan_in=1, dtype=policy.param)
        self.layers = layer_stack(cfg, policy, rngs)
        self.final_norm = RMSNorm(cfg.embed, cfg.norm_eps, policy, offset=cfg.norm_offset)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.embed, cfg.vocab_size), ("embed", "vocab"),
                                 fan_in=cfg.embed, dtype=policy.param)

    def embed(self, tokens_BT: jax.Array) -> jax.Array:
        table_VE, compute = self.embedding[...], self.policy.compute
        shards = batch_shards(tokens_BT.shape[0])
        if shards > 1 and jnp.dtype(compute) != table_VE.dtype:  # gradient crosses in compute
            h_BTE = lookup(table_VE, tokens_BT, shards, compute).astype(compute)
        else:
            h_BTE = jnp.take(table_VE, tokens_BT, axis=0).astype(compute)
        if self.cfg.embed_scale:  # Gemma: sqrt(embed), rounded to the compute dtype as HF does
            h_BTE = h_BTE * jnp.asarray(math.sqrt(self.cfg.embed), self.policy.compute)
        return constrain(h_BTE, "batch", "length", "embed")

    def head_weight(self) -> jax.Array:
        """The LM head's (embed, vocab) weight in the logits dtype (the embedding's transpose
        when tied). `lm_task.head_losses` gathers it once for all its loss chunks."""
        dtype = self.policy.dtype_for("logits")
        if self.cfg.tie_embeddings:
            return self.embedding[...].astype(dtype).T
        return self.lm_head[...].astype(dtype)

    def head(self, h_BTE: jax.Array, w_EV: jax.Array | None = None) -> jax.Array:
        """Logits (B, T, V) of the last layer's output; `w_EV` replaces `head_weight()`.

        Also (S, b, T, E) rows with an (S, E, V) weight: one weight copy per batch shard, the
        form in which a loss-chunk scan accumulates the head's gradient without collectives."""
        h_BTE = self.final_norm(h_BTE).astype(self.policy.dtype_for("logits"))
        w_EV = self.head_weight() if w_EV is None else w_EV
        if w_EV.ndim == 3:
            logits = jnp.einsum("sbte,sev->sbtv", h_BTE, w_EV)
        else:
            logits = jnp.einsum("bte,ev->btv", h_BTE, w_EV)
        if cap := self.cfg.final_softcap:  # Gemma 2
            logits = cap * jnp.tanh(logits / cap)
        lead = ("batch", None) if w_EV.ndim == 3 else ("batch",)
        return constrain(logits, *lead, "length", "vocab")

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty stacked KV cache for `batch` rows of up to `max_len` positions."""
        cfg = self.cfg
        return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim,
                             dtype or self.policy.compute)

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
                 run_layers: LayerRunner | None = None, *,
                 cache: KVCache | None = None, cache_index: jax.Array | None = None,
                 segments_BT: jax.Array | None = None) -> jax.Array | tuple[jax.Array, KVCache]:
        """Logits for `tokens_BT`; `run_layers(block, h, positions)` may replace the scan.

        Packed rows: `segments_BT` (document ids, 0 on padding) keeps attention inside each
        document and `positions_BT` restarts at 0 in each, so every document sees what it would
        alone.

        Decoding: with a stacked `cache`, the tokens take cache slots cache_index.. (and, by
        default, those positions) and the result is (logits, updated cache).
        """
        if positions_BT is None:
            start = 0 if cache is None else cache_index
            positions_BT = jnp.broadcast_to(start + jnp.arange(tokens_BT.shape[1]),
                                            tokens_BT.shape)
        if cache is not None:
            h_BTE, cache = scan_layers(self.layers, self.embed(tokens_BT), positions_BT,
                                       cache=cache, cache_index=cache_index,
                                       segments_BT=segments_BT)
            return self.head(h_BTE), cache
        h_BTE = self.hidden(tokens_BT, positions_BT, run_layers, segments_BT)
        with head_scope(run_layers):
            return self.head(h_BTE)

    def hidden(self, tokens_BT: jax.Array, positions_BT: jax.Array,
               run_layers: LayerRunner | None = None,
               segments_BT: jax.Array | None = None) -> jax.Array:
        """The last layer's output (before the final norm and head): the layers scanned, or
        run by `run_layers` (a pipeline schedule)."""
        h_BTE = self.embed(tokens_BT)
        if run_layers is None:
            return scan_layers(self.layers, h_BTE, positions_BT, self.cfg.remat,
                               segments_BT=segments_BT)
        packed = {} if segments_BT is None else {"segments_BT": segments_BT}
        return run_layers(self.layers, h_BTE, positions_BT, **packed)


def head_scope(run_layers: LayerRunner | None) -> contextlib.AbstractContextManager:
    """The context the head runs in after `run_layers`: a pipeline runner may split the head's
    rows over its stages (computed once, not once per stage; `parallel/gpipe.batch_over_stages`)."""
    return getattr(run_layers, "head_scope", contextlib.nullcontext)()
