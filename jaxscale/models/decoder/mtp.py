"""DeepSeek-V3's multi-token prediction (MTP) at depth 1: a training-only extra head that, at
position t, also predicts token t+2 (`model.mtp_depth=1`, weighted by `model.mtp_loss_weight`).

    x_t  = eh_proj([enorm(embedding(token_{t+1})); hnorm(h_t)])      (2E -> E)
    x_t  = Block(x_t)                                                 one block like the model's
    p_t  = softmax(head(final_norm(x_t)))   -> token_{t+2}            (the main model's LM head)

`h_t` is the main model's output after its final norm, as the published checkpoints' serving
code feeds it (vLLM's and SGLang's DeepSeek MTP: the target model's normed hidden states);
the embedding table and LM head are the main model's (the checkpoint's per-layer copies,
`model.layers.{N}.embed_tokens` and `shared_head.head`, are written on export only).
The block is built like the model's MoE layers (experts when the model has them), stacked over
one layer so that the decoder's scan, remat and router statistics (the block's sown router
statistics join the main layers' `moe_*` metrics and aux loss) apply to it unchanged.

Why a separate module: generation, evaluation and export never call it; only the LM task's
training loss (`lm_task.lm_loss`, through `Llama.mtp_hidden`) does, adding
mtp_loss_weight x the MTP cross entropy and reporting it as `mtp_loss`. The MTP loss is the
summed cross entropy of the counted t+2 targets divided by the main loss's target count (the
paper's 1/T for unpacked rows), so splitting a batch (accumulation, replicas) keeps it exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.models.decoder.block import Block
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.nn.layers import RMSNorm, param
from jaxscale.models.nn.scan import scan_layers
from jaxscale.precision import Policy
from jaxscale.rules import constrain

METRIC = "mtp_loss"  # the step metric: the unweighted MTP cross entropy


class MTP(nnx.Module):
    """One MTP module (depth 1): the two input norms, the 2E -> E projection, one transformer
    block (stacked over one layer) and the module's own final norm before the shared head."""

    def __init__(self, cfg: LlamaConfig, policy: Policy, rngs: nnx.Rngs):
        e = cfg.embed
        norm = lambda: RMSNorm(e, cfg.norm_eps, policy, offset=cfg.norm_offset)
        self.enorm, self.hnorm, self.final_norm = norm(), norm(), norm()
        # (2E, E): rows 0..E-1 take the normed embedding, E..2E-1 the normed hidden state.
        self.eh_proj = param(rngs, (2 * e, e), (None, "embed"), fan_in=2 * e, dtype=policy.param)
        self.block = Block(cfg, policy, rngs, stack=1)
        self.policy, self.remat = policy, cfg.remat

    def __call__(self, hidden_BTE: jax.Array, next_BTE: jax.Array, positions_BT: jax.Array,
                 segments_BT: jax.Array | None = None) -> jax.Array:
        """The block's output (before `final_norm`) from the main model's normed output
        `hidden_BTE` and the next tokens' embeddings `next_BTE`."""
        c = self.policy.compute
        x_BT2E = jnp.concatenate([self.enorm(next_BTE), self.hnorm(hidden_BTE)], axis=-1)
        x_BTE = jnp.einsum("btf,fe->bte", x_BT2E.astype(c), self.eh_proj[...].astype(c))
        x_BTE = constrain(x_BTE, "batch", "length", "embed")
        return scan_layers(self.block, x_BTE, positions_BT, self.remat,
                           segments_BT=segments_BT, per_layer={})


def mtp_targets(targets_BT: jax.Array, counted_BT: jax.Array,
                segments_BT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(the token two ahead of each input position (B, T), where it counts (B, T) bool): the
    main targets shifted left by one; the last position has none, and a packed row's position
    counts only when its t+1 and t+2 lie in its own document (and the t+2 target counts)."""
    pad = lambda x, v: jnp.concatenate([x[:, 1:], jnp.full_like(x[:, :1], v)], axis=1)
    counted_BT = pad(counted_BT, False)
    if segments_BT is not None:
        counted_BT = counted_BT & (segments_BT == pad(segments_BT, -1))
    return (constrain(pad(targets_BT, 0), "batch", "length"),
            constrain(counted_BT, "batch", "length"))


def record(model: nnx.Module, loss: jax.Array) -> None:
    """Records the step's `mtp_loss` metric on `model` (`task.step_metrics` pops it)."""
    setattr(model, METRIC, nnx.Intermediate(jax.lax.stop_gradient(loss)))
