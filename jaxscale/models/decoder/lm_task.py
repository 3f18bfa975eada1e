"""The language-model task of the decoder families (`LM`): the next-token loss `lm_loss` (the
LM head and loss together, chunk by chunk under `model.loss_chunks` (automatic by default), and
fused into a pipeline's last stage), over every target or the targets that packed rows and loss
masks count (chat: the assistant's tokens), the masked batch's preparation and target counts,
the held-out sums, and each row's summed log-probability of its masked targets
(`sequence_logps`, what preference objectives compare). Every entry of the model table built on
the decoder (`llama.py`) uses it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.attention.sequence import context
from jaxscale.models.decoder import mtp
from jaxscale.models.decoder.llama import Llama, head_scope, mtp_hidden
from jaxscale.models.moe.routers import router_loss, router_objective
from jaxscale.models.nn.shard_sums import shard_copies
from jaxscale.models.runner import LayerRunner
from jaxscale.models.task import Task, masked_sums
from jaxscale.rules import constrain, shard_counts

# Automatic loss chunking (`model.loss_chunks=0`, the default) splits the LM head and loss into
# the fewest chunks that keep a chip's float32 logits of one micro-batch at or under this. Why
# 1 GiB: the loss holds about three logits-sized float32 buffers at once (logits, softmax and
# their gradient), so the budget caps the head at ~3 GiB, a fifth of the smallest chip's HBM
# (v5e, 16 GiB), while below it chunking would buy little memory for its cost (one more head
# forward pass). 7B (32k vocabulary) at 64 x 2,048 tokens a chip: 15.6 GiB of logits, 16
# chunks; at 4 x 2,048 (and any tiny test model): 1 GiB or less, no chunks.
LOGITS_BUDGET = 1 << 30


def choose_loss_chunks(positions: int, chip_bytes: float, length_shards: int = 1,
                       budget: float | None = None) -> int:
    """The fewest chunks n, a divisor of `positions`, that bring `chip_bytes` (a chip's float32
    logits of the micro-batch) to `budget` (`LOGITS_BUDGET`) or under (the most chunks if none
    does); where it can, n also leaves each chunk's positions a multiple of `length_shards`, so
    a sequence-sharded length stays evenly sharded within a chunk."""
    divisors = [n for n in range(1, positions + 1) if positions % n == 0]
    even = [n for n in divisors if (positions // n) % length_shards == 0] or divisors
    budget = LOGITS_BUDGET if budget is None else budget
    return next((n for n in even if chip_bytes / n <= budget), even[-1])


def loss_chunks_for(model: Llama, shape_BTV: tuple[int, int, int]) -> int:
    """`model.cfg.loss_chunks`, or where it is 0 the automatic choice for logits of
    `shape_BTV` under the active sharding rules (a divisor of T by construction, whatever
    micro-batch, pipeline stage or packed rows the head sees)."""
    if model.cfg.loss_chunks:
        return model.cfg.loss_chunks
    shards = shard_counts(shape_BTV, "batch", "length", "vocab")
    chip_bytes = math.prod(shape_BTV) * 4 / math.prod(shards)
    return choose_loss_chunks(shape_BTV[1], chip_bytes, shards[1])


def token_losses(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Per-position cross entropy (B, T), computed in float32 whatever the logits' dtype: with
    bfloat16 logits (precision override `logits=bfloat16`) the upcast fuses into the log-sum-exp
    reduction, so only the logits are stored in bfloat16 and the softmax still sums in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32),
                                                           targets_BT)


@jax.custom_vjp
def _reduced_before_layers(w_EV: jax.Array, h_BTE: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Identity. Its backward pass hands the layers their cotangent only together with the head
    weight's gradient reduced into the weight's sharding (an optimization barrier ties the two),
    so the whole (E, V) float32 gradient the reduction produces is freed before the layers'
    backward pass, the step's peak, instead of overlapping it."""
    return w_EV, h_BTE


def _reduced_fwd(w_EV: jax.Array, h_BTE: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
    return (w_EV, h_BTE), None


def _reduced_bwd(_: None, g: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    g_EV, g_BTE = g
    return jax.lax.optimization_barrier((constrain(g_EV, "embed", "vocab"), g_BTE))


_reduced_before_layers.defvjp(_reduced_fwd, _reduced_bwd)


def head_losses(model: Llama, h_BTE: jax.Array, targets_BT: jax.Array,
                norm: Any = None) -> jax.Array:
    """Per-position losses (B, T) of the head on the last layer's output `h_BTE` (normed by
    `norm` in place of the final norm: the MTP module's).

    With n = `loss_chunks_for(...)` > 1 the positions are split into n chunks, chunk k holding
    positions k, k+n, k+2n, ... (strided, so a sharded `length` stays sharded within a chunk),
    and a scan computes head and loss chunk by chunk, recomputing each chunk's logits in the
    backward pass: the float32 logits and their gradient, (B, T, V) each and the largest
    activations of a step with a big vocabulary, exist 1/n at a time, for one more head
    forward pass of compute.

    The head weight is gathered once, before the scan, not once per chunk: it is broadcast to
    one copy per batch shard (S, E, V), whole but for its vocabulary shards (one all-gather
    over the FSDP shards), so each chunk's weight gradient is a local sum on its batch shard
    that the scan accumulates without collectives; the copies' gradients are summed once, after
    the scan, straight into the weight's own sharding. (Constraining the (E, V) weight to
    replicated first moves the same bytes but all-reduces into a replicated float32 copy: half
    a GiB more per chip for a 128k vocabulary; bench/RESULTS.md.)"""
    B, T, E = h_BTE.shape
    n = loss_chunks_for(model, (B, T, model.cfg.vocab_size))
    S = shard_counts((B,), "batch")[0]
    if n == 1:
        if not _narrow_sum(model, S):
            return token_losses(model.head(h_BTE, norm=norm), targets_BT)
        w_SEV = _head_copies(model, model.head_weight(), S)
        logits_SbTV = model.head(h_BTE.reshape(S, B // S, T, E), w_SEV, norm)
        return token_losses(logits_SbTV, targets_BT.reshape(S, B // S, T)).reshape(B, T)
    if T % n:
        raise ConfigError(paragraph(
            f"model.loss_chunks={n} must divide the sequence length, {T} here: the LM head and",
            "loss run over the positions in that many equal chunks. Use a divisor of the",
            "length (1: no chunks; 0: automatic)."))
    w_EV, h_BTE = _reduced_before_layers(model.head_weight(), h_BTE)
    w_SEV = _head_copies(model, w_EV, S)
    to_chunks = lambda x: jnp.moveaxis(x.reshape(S, B // S, T // n, n, *x.shape[2:]), 3, 0)
    h_nSbCE = constrain(to_chunks(h_BTE), None, "batch", None, "length", "embed")

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def chunk(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        h_SbCE, targets_SbC = xs
        return None, token_losses(model.head(h_SbCE, w_SEV, norm), targets_SbC)

    _, losses_nSbC = jax.lax.scan(chunk, None, (h_nSbCE, to_chunks(targets_BT)))
    return jnp.moveaxis(losses_nSbC, 0, -1).reshape(B, T)


def _narrow_sum(model: Llama, shards: int) -> bool:
    """Whether the head weight's gradient is summed across `shards` batch shards in the compute
    dtype, narrower than the logits' (`shard_sums`): as the layers' gradients are."""
    return shards > 1 and jnp.dtype(model.policy.compute) != jnp.dtype(
        model.policy.dtype_for("logits"))


def _head_copies(model: Llama, w_EV: jax.Array, shards: int) -> jax.Array:
    """(S, E, V): one head weight copy per batch shard, whole but for its vocabulary shards;
    their gradients summed across the shards in the compute dtype where narrower."""
    if not _narrow_sum(model, shards):
        return constrain(jnp.broadcast_to(w_EV, (shards, *w_EV.shape)), "batch", None, "vocab")
    return shard_copies(w_EV, shards, model.policy.compute, (None, "vocab"), ("embed", "vocab"))


def mean_head_loss(model: Llama, h_BTE: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of the head on the last layer's output."""
    return jnp.mean(head_losses(model, h_BTE, targets_BT))


def lm_loss(model: Llama, batch: Mapping[str, jax.Array],
            run_layers: LayerRunner | None = None) -> jax.Array:
    """Next-token loss of a decoder LM on `batch['tokens']` (B, T+1): inputs [:, :-1],
    targets [:, 1:]. A runner that fuses the loss (1F1B) runs head and loss in its schedule.
    Packed rows (`segment_ids`, `positions`) count only targets inside the same document, and
    rows with a `loss_mask` (B, T+1) only the targets it marks (chat: the assistant's tokens):
    the loss is the mean over the counted targets. MoE layers add their router losses
    (`moe.router_loss`, which records the moe_* metrics), and an MTP module (`mtp.py`)
    mtp_loss_weight x its loss (recorded as `mtp_loss`)."""
    loss, mtp_loss = _next_token_loss(model, batch, run_layers)
    loss = loss + router_loss(model, model.cfg.moe)  # pops every sown value: record after
    if mtp_loss is None:
        return loss
    mtp.record(model, mtp_loss)
    return loss + model.cfg.mtp_loss_weight * mtp_loss


def _training_order(model: Llama, length: int) -> Any:
    """The order the sequence's positions lie in while the step runs (`model.context_order`):
    the zigzag order on sequence shards (`context.training_order`), else None (natural). The
    losses are sums over positions, so any order gives the same loss."""
    return context.training_order(length, model.cfg.context_order, model.cfg.context_attention)


def is_masked(batch: Mapping[str, jax.Array]) -> bool:
    """Whether some of the batch's targets carry no loss: packed rows (padding, document
    boundaries) or a `loss_mask`."""
    return "segment_ids" in batch or "loss_mask" in batch


def _next_token_loss(model: Llama, batch: Mapping[str, jax.Array],
                     run_layers: LayerRunner | None = None
                     ) -> tuple[jax.Array, jax.Array | None]:
    """(the next-token loss, the MTP module's loss or None without one)."""
    tokens_BT1 = constrain(batch["tokens"], "batch", "length")
    order = _training_order(model, tokens_BT1.shape[1] - 1)
    if model.cfg.mtp_depth:  # pipelines and sequence shards refused (config.check_mtp)
        rows = _rows(batch)
        h_BTE = model.hidden(rows.inputs_BT, rows.positions_BT, None, rows.segments_BT)
        count = _target_count(batch, rows.counted_BT)
        losses_BT = head_losses(model, h_BTE, rows.targets_BT)
        return (losses_BT * rows.counted_BT).sum() / count, _mtp_loss(model, h_BTE, rows, count)
    with context.sequence_order(order):
        if is_masked(batch):
            if run_layers is not None and run_layers.fuses_loss:
                return _fused_masked_loss(model, batch, run_layers, order), None
            losses_BT, mask_BT = masked_losses(model, batch, run_layers, order)
            return (losses_BT * mask_BT).sum() / _target_count(batch, mask_BT), None
        inputs_BT, targets_BT = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
        positions_BT = jnp.broadcast_to(jnp.arange(inputs_BT.shape[1]), inputs_BT.shape)
        if order is not None:
            inputs_BT, targets_BT, positions_BT = (_permuted(x, order) for x in (
                inputs_BT, targets_BT, positions_BT))
        if run_layers is not None and run_layers.fuses_loss:
            return run_layers.fused_loss(model, inputs_BT, targets_BT, mean_head_loss,
                                         positions_BT if order is not None else None,
                                         sown_loss=_router_objective(model)), None
        h_BTE = model.hidden(inputs_BT, positions_BT, run_layers)
        with head_scope(run_layers):
            return mean_head_loss(model, h_BTE, targets_BT), None


def _mtp_loss(model: Llama, h_BTE: jax.Array, rows: "_Rows", count: jax.Array) -> jax.Array:
    """The MTP module's summed cross entropy of its counted t+2 targets over `count`, the main
    loss's target count (`mtp.py`)."""
    targets_BT, counted_BT = mtp.mtp_targets(rows.targets_BT, rows.counted_BT, rows.segments_BT)
    x_BTE = mtp_hidden(model, h_BTE, rows.targets_BT, rows.positions_BT, rows.segments_BT)
    losses_BT = head_losses(model, x_BTE, targets_BT, norm=model.mtp.final_norm)
    return (losses_BT * counted_BT).sum() / count


def _permuted(x_BT: jax.Array | None, order: Any) -> jax.Array | None:
    """`x_BT`'s positions in `order`, still sharded by the rules."""
    return None if x_BT is None else constrain(x_BT[:, order], "batch", "length")


class _Rows(NamedTuple):
    inputs_BT: jax.Array
    targets_BT: jax.Array
    positions_BT: jax.Array
    segments_BT: jax.Array | None  # document ids of packed rows; None: one sequence a row
    counted_BT: jax.Array  # True where the target carries loss (its document's, and masked)


def _rows(batch: Mapping[str, jax.Array], order: Any = None) -> _Rows:
    """The rows' fields, each position laid in `order` when one is given. Packed rows count
    a target inside its input's document only; a `loss_mask` (aligned with `tokens`) counts
    the targets it marks."""
    tokens_BT1 = constrain(batch["tokens"], "batch", "length")
    B, T = tokens_BT1.shape[0], tokens_BT1.shape[1] - 1
    if "segment_ids" in batch:
        segments_BT1 = constrain(batch["segment_ids"], "batch", "length")
        positions_BT = constrain(batch["positions"], "batch", "length")[:, :-1]
        counted_BT = (segments_BT1[:, 1:] == segments_BT1[:, :-1]) & (segments_BT1[:, 1:] > 0)
        segments_BT = segments_BT1[:, :-1]
    else:
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        counted_BT, segments_BT = jnp.ones((B, T), bool), None
    if "loss_mask" in batch:
        counted_BT = counted_BT & (constrain(batch["loss_mask"], "batch", "length")[:, 1:] > 0)
    rows = _Rows(tokens_BT1[:, :-1], tokens_BT1[:, 1:], positions_BT, segments_BT, counted_BT)
    return rows if order is None else _Rows(*(_permuted(x, order) for x in rows))


def with_target_counts(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """`batch` plus `targets_per_row` (B,): the whole batch's counted targets / B on every row.

    The masked loss (packed rows, loss masks) is a mean over the batch's counted targets. A
    step that splits the batch (gradient accumulation, data replicas, pipeline microbatches)
    averages the parts' losses, and parts hold different numbers of counted targets; dividing
    each part by its rows' share of the batch-wide count (not by its own count) keeps the
    average exactly the batch's mean."""
    counted_BT = _rows(batch).counted_BT
    B = counted_BT.shape[0]
    count = jax.lax.stop_gradient(jnp.sum(counted_BT).astype(jnp.float32))
    return dict(batch, targets_per_row=jnp.full((B,), count / B, jnp.float32))


def _target_count(batch: Mapping[str, jax.Array], counted_BT: jax.Array) -> jax.Array:
    """What these rows' summed loss is divided by (see `with_target_counts`), at least 1."""
    count = (jnp.sum(batch["targets_per_row"]) if "targets_per_row" in batch
             else jnp.sum(counted_BT).astype(jnp.float32))
    return jnp.maximum(count, 1.0)


def masked_losses(model: Llama, batch: Mapping[str, jax.Array],
                  run_layers: LayerRunner | None = None, order: Any = None
                  ) -> tuple[jax.Array, jax.Array]:
    """Per-token losses (B, T) and their float mask: 1 where the target counts (inside its
    document, marked by the `loss_mask`), 0 on padding, document boundaries and unmarked
    targets; both with positions in `order` when given (the caller declares it,
    `context.sequence_order`)."""
    rows = _rows(batch, order)
    h_BTE = model.hidden(rows.inputs_BT, rows.positions_BT, run_layers, rows.segments_BT)
    with head_scope(run_layers):
        losses_BT = head_losses(model, h_BTE, rows.targets_BT)
    return losses_BT, rows.counted_BT.astype(jnp.float32)


def _fused_masked_loss(model: Llama, batch: Mapping[str, jax.Array],
                       run_layers: LayerRunner, order: Any = None) -> jax.Array:
    """The masked rows' loss through a runner that fuses the loss (1F1B). Such a runner
    averages per-microbatch losses, but microbatches hold different numbers of counted
    targets: each microbatch returns its masked loss *sum* over its fixed size b*T (targets
    that do not count marked -1), so the schedule yields sum / (B*T), rescaled here to
    sum / count."""
    rows = _rows(batch, order)

    def masked_sum(micro: Llama, h_bTE: jax.Array, targets_bT: jax.Array) -> jax.Array:
        losses_bT = head_losses(micro, h_bTE, jnp.maximum(targets_bT, 0))
        return jnp.sum(jnp.where(targets_bT >= 0, losses_bT, 0.0)) / targets_bT.size

    targets_BT = jnp.where(rows.counted_BT, rows.targets_BT, -1)
    scale = rows.counted_BT.size / _target_count(batch, rows.counted_BT)
    per_position = run_layers.fused_loss(model, rows.inputs_BT, targets_BT, masked_sum,
                                         rows.positions_BT, rows.segments_BT,
                                         sown_loss=_router_objective(model),
                                         sown_weight=1.0 / scale)  # the router's weighs 1
    return per_position * scale


def _router_objective(model: Llama) -> Callable[[Any], Any]:
    """The router's loss term of what the layers sow, for a runner that runs the backward in
    its schedule (1F1B) and so must differentiate it there (`moe.router_objective`)."""
    return functools.partial(router_objective, moe=model.cfg.moe)


def prepare_batch(batch: Mapping[str, jax.Array]) -> Mapping[str, jax.Array]:
    """Masked rows get their batch-wide target count before a step splits them
    (`with_target_counts`); other rows need nothing."""
    return with_target_counts(batch) if is_masked(batch) else batch


def eval_sums(model: Llama, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Summed next-token loss, correct predictions and count of one batch: the targets the
    training loss counts (`_rows`: each document's own, those a `loss_mask` marks), in rows
    the per-row `mask` keeps (the padding rows of a last held-out batch have mask 0)."""
    if is_masked(batch):
        rows = _rows(batch)
        logits_BTV = model(rows.inputs_BT, rows.positions_BT, segments_BT=rows.segments_BT)
        counted_BT = rows.counted_BT.astype(jnp.float32)
        if "mask" in batch:
            counted_BT = counted_BT * batch["mask"].astype(jnp.float32)[:, None]
        return masked_sums(logits_BTV, rows.targets_BT, counted_BT)
    tokens_BT1 = constrain(batch["tokens"], "batch", "length")
    return masked_sums(model(tokens_BT1[:, :-1]), tokens_BT1[:, 1:], batch.get("mask"))


def sequence_logps(model: Llama, batch: Mapping[str, jax.Array],
                   run_layers: LayerRunner | None = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(summed log-probabilities of each row's targets that `batch['loss_mask']` marks (B,),
    their count (B,), the router's loss term): a whole response's log-probability under the
    model, from the same head and chunked loss as training (`masked_losses`). Rows are one
    sequence each, right-padded (causal attention: the padding changes nothing before it)."""
    tokens_BT1 = constrain(batch["tokens"], "batch", "length")
    order = _training_order(model, tokens_BT1.shape[1] - 1)
    rows = {"tokens": tokens_BT1, "loss_mask": batch["loss_mask"]}
    with context.sequence_order(order):
        losses_BT, mask_BT = masked_losses(model, rows, run_layers, order)
    return (-(losses_BT * mask_BT).sum(axis=1), mask_BT.sum(axis=1),
            router_loss(model, model.cfg.moe))


def token_logps(model: Llama, batch: Mapping[str, jax.Array],
                run_layers: LayerRunner | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-probability of every target (B, T), the float mask `batch['loss_mask']` marks
    (B, T), the router's loss term), in the natural order of positions (laid back from the
    training order of sequence shards): `sequence_logps` before the sum over positions."""
    tokens_BT1 = constrain(batch["tokens"], "batch", "length")
    order = _training_order(model, tokens_BT1.shape[1] - 1)
    rows = {"tokens": tokens_BT1, "loss_mask": batch["loss_mask"]}
    with context.sequence_order(order):
        losses_BT, mask_BT = masked_losses(model, rows, run_layers, order)
    if order is not None:
        inverse = np.argsort(order)
        losses_BT, mask_BT = _permuted(losses_BT, inverse), _permuted(mask_BT, inverse)
    return -losses_BT, mask_BT, router_loss(model, model.cfg.moe)


def batch_spec(model_cfg: Mapping[str, Any], batch_size: int, seq_len: int,
               segments: bool) -> dict[str, jax.ShapeDtypeStruct]:
    """A training batch: `tokens` (batch, seq_len + 1) int32, inputs and shifted targets; rows
    that carry segments (packed documents) add `segment_ids` and `positions` of that shape."""
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32)
    return {"tokens": tokens, **({"segment_ids": tokens, "positions": tokens} if segments else {})}


LM = Task(lm_loss, eval_sums, batch_spec, unit="tokens", prepare=prepare_batch,
          perplexity=True, token_batches=True, sequence_logps=sequence_logps,
          token_logps=token_logps,
          finetune=("finetune_lm:lora", "--config.data.sources='text=YOUR/FILES/*.txt'"))
