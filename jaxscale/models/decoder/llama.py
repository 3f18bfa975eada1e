"""A Llama-style decoder-only LM in Flax NNX with a scanned (stacked) layer stack.

The model knows nothing of meshes, training or checkpoints: it declares logical axes and calls
`constrain` on key activations. The layer stack is one `Block` (`block.py`) whose parameters
carry a leading `layers` dimension; `__call__` scans over it, and `embed` / `run_layers` / `head`
are exposed so a pipeline schedule can drive the same stack stage by stage. Decoding passes a
stacked cache (`init_cache`; or a tuple of one cache per layer, `nn/scan.layer_caches`) and the
slot to write at: the same modules then return (logits, updated cache). Its config and checks are in `config.py`; the language-model task (`LM`: the
next-token loss, the packed batch's preparation and the held-out sums) in `lm_task.py`; its FLOP
counts in `flops.py`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.models.attention.kinds import attention_of
from jaxscale.models.decoder.block import dense_first, dense_stack, layer_stack
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.decoder.mtp import MTP
from jaxscale.models.nn.layers import RMSNorm, param
from jaxscale.models.nn.scan import check_remat, scan_layers
from jaxscale.models.nn.shard_sums import batch_shards, take_rows_sum_shards
from jaxscale.models.runner import LayerRunner
from jaxscale.precision import Policy, get_policy
from jaxscale.rules import constrain


class Llama(nnx.Module):
    # The scanned layer stacks, in layer order: a decoding program may run them unrolled on
    # one cache per layer, their weights sliced once per call (`nn/scan.copy_layer_weights`).
    LAYER_STACKS = ("dense_layers", "layers")

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, policy: Policy | None = None):
        policy = policy or get_policy("32-true")
        check_remat(cfg.remat)
        self.cfg, self.policy = cfg, policy
        self.embedding = param(rngs, (cfg.vocab_size, cfg.embed), ("vocab", "embed"),
                               fan_in=1, dtype=policy.param)
        if dense_first(cfg):  # DeepSeek's dense first layers, their own scanned stack
            self.dense_layers = dense_stack(cfg, policy, rngs)
        self.layers = layer_stack(cfg, policy, rngs)
        self.final_norm = RMSNorm(cfg.embed, cfg.norm_eps, policy, offset=cfg.norm_offset)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.embed, cfg.vocab_size), ("embed", "vocab"),
                                 fan_in=cfg.embed, dtype=policy.param)
        if cfg.mtp_depth:  # multi-token prediction: the training loss alone calls it
            self.mtp = MTP(cfg, policy, rngs)

    def embed(self, tokens_BT: jax.Array) -> jax.Array:
        table_VE, compute = self.embedding[...], self.policy.compute
        shards = batch_shards(tokens_BT.shape[0])
        if shards > 1 and jnp.dtype(compute) != table_VE.dtype:  # gradient crosses in compute
            h_BTE = take_rows_sum_shards(table_VE, tokens_BT, shards, compute).astype(compute)
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

    def head(self, h_BTE: jax.Array, w_EV: jax.Array | None = None,
             norm: RMSNorm | None = None) -> jax.Array:
        """Logits (B, T, V) of the last layer's output; `w_EV` replaces `head_weight()`,
        `norm` the final norm (the MTP module's own, `mtp_hidden`).

        Also (S, b, T, E) rows with an (S, E, V) weight: one weight copy per batch shard, the
        form in which a loss-chunk scan accumulates the head's gradient without collectives."""
        h_BTE = (norm or self.final_norm)(h_BTE).astype(self.policy.dtype_for("logits"))
        w_EV = self.head_weight() if w_EV is None else w_EV
        if w_EV.ndim == 3:
            logits = jnp.einsum("sbte,sev->sbtv", h_BTE, w_EV)
        else:
            logits = jnp.einsum("bte,ev->btv", h_BTE, w_EV)
        if cap := self.cfg.final_softcap:  # Gemma 2
            logits = cap * jnp.tanh(logits / cap)
        lead = ("batch", None) if w_EV.ndim == 3 else ("batch",)
        return constrain(logits, *lead, "length", "vocab")

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> Any:
        """An empty cache stacked over the layers for `batch` rows of up to `max_len` positions,
        in the layout of the model's attention component (grouped-query: a `KVCache`)."""
        return attention_of(self.cfg).init_cache(self.cfg.num_layers, batch, max_len,
                                                 dtype or self.policy.compute)

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None,
                 run_layers: LayerRunner | None = None, *,
                 cache: Any = None, cache_index: jax.Array | None = None,
                 segments_BT: jax.Array | None = None) -> jax.Array | tuple[jax.Array, Any]:
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
            h_BTE, k = self.embed(tokens_BT), dense_first(self.cfg)
            kw = dict(cache_index=cache_index, segments_BT=segments_BT)
            per_layer = isinstance(cache, tuple)  # one cache per layer (`layer_caches`)
            split = (lambda s: cache[s]) if per_layer else (
                lambda s: jax.tree.map(lambda a: a[s], cache))
            parts = [split(slice(None, k)), split(slice(k, None))]
            if k:
                h_BTE, parts[0] = scan_layers(self.dense_layers, h_BTE, positions_BT,
                                              cache=parts[0], **kw)
            h_BTE, parts[1] = scan_layers(self.layers, h_BTE, positions_BT, cache=parts[1], **kw)
            if per_layer:
                return self.head(h_BTE), tuple(c.constrained() for c in parts[0] + parts[1])
            if k:
                cache = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *parts)
            else:
                cache = parts[1]
            return self.head(h_BTE), cache.constrained()
        h_BTE = self.hidden(tokens_BT, positions_BT, run_layers, segments_BT)
        with head_scope(run_layers):
            return self.head(h_BTE)

    def hidden(self, tokens_BT: jax.Array, positions_BT: jax.Array,
               run_layers: LayerRunner | None = None,
               segments_BT: jax.Array | None = None) -> jax.Array:
        """The last layer's output (before the final norm and head): the layers scanned, or
        run by `run_layers` (a pipeline schedule)."""
        h_BTE = self.embed(tokens_BT)
        if dense_first(self.cfg):  # refused with pipeline stages (moe/layer.check_moe)
            h_BTE = scan_layers(self.dense_layers, h_BTE, positions_BT, self.cfg.remat,
                                segments_BT=segments_BT)
        if run_layers is None:
            return scan_layers(self.layers, h_BTE, positions_BT, self.cfg.remat,
                               segments_BT=segments_BT)
        packed = {} if segments_BT is None else {"segments_BT": segments_BT}
        return run_layers(self.layers, h_BTE, positions_BT, **packed)


def mtp_hidden(model: Llama, h_BTE: jax.Array, next_BT: jax.Array, positions_BT: jax.Array,
               segments_BT: jax.Array | None = None) -> jax.Array:
    """The MTP module's output (before its final norm) from the main model's last-layer
    output `h_BTE` and the next tokens `next_BT` (the main targets): `mtp.MTP`."""
    return model.mtp(model.final_norm(h_BTE), model.embed(next_BT), positions_BT, segments_BT)


def head_scope(run_layers: LayerRunner | None) -> contextlib.AbstractContextManager:
    """The context the head runs in after `run_layers`: a pipeline runner may split the head's
    rows over its stages (computed once, not once per stage;
    `parallel/stages.batch_over_stages`)."""
    return getattr(run_layers, "head_scope", contextlib.nullcontext)()
