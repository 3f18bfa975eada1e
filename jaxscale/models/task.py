"""What training and evaluation ask of a task (`config.model.task`), and the eval sums they share.

A model family lists its tasks in its table entry (`jaxscale.models.MODELS`); the generic step
and `jaxscale.inference.evaluate` call the chosen `Task`'s functions and never branch on its name. The
functions live beside their model (the LM's in `decoder/lm_task.py`, classification's in
`models/vit.py`); this module only says their shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

# A batch: arrays sharing the leading `batch` dimension, e.g. {'tokens': (B, T+1)} or
# {'images', 'labels'}.
Batch = Mapping[str, jax.Array]


def same_batch(batch: Batch) -> Batch:
    """The batch preparation of tasks that need none."""
    return batch


@dataclass(frozen=True)
class Task:
    """One task of a model: its training loss, batch preparation and held-out sums."""

    # loss(model, batch, run_layers: LayerRunner | None) -> scalar mean loss of the batch.
    loss: Callable[..., jax.Array]
    # eval_sums(model, batch) -> {'loss', 'correct', 'count'}, each summed over the batch's
    # counted predictions (masked rows and padding excluded), so totals divide once at the end.
    eval_sums: Callable[[Any, Batch], dict[str, jax.Array]]
    # batch_spec(model_cfg, batch_size, seq_len, segments) -> {name: jax.ShapeDtypeStruct}: the
    # arrays of a global training batch, for compiling a step without reading data; `segments`:
    # the data's rows carry segment ids (packed documents, `data.packing.carries_segments`).
    batch_spec: Callable[[Mapping[str, Any], int, int, bool], dict[str, jax.ShapeDtypeStruct]]
    unit: str  # what the eval count counts, reported by that name: 'tokens' | 'examples'
    # Applied to the whole batch before a step splits it (accumulation, replicas, pipeline
    # microbatches), e.g. the packed LM's batch-wide target count (`lm_task.with_target_counts`).
    prepare: Callable[[Batch], Batch] = same_batch
    perplexity: bool = False     # evaluation also reports exp(mean loss)
    token_batches: bool = False  # trains on {'tokens': (B, T+1)} int32 batches (what AOT builds)
    # How `jaxscale train` fine-tunes this task's model from converted weights: the --config
    # value, and the flags after --config.init_from (the default: the user's config, which
    # takes its model from the weights).
    finetune: tuple[str, str] = ("CONFIG", "--config.model_from_weights=true")
    # sequence_logps(model, {'tokens': (B, T+1), 'loss_mask': (B, T+1)}, run_layers) ->
    # (summed log-probabilities of each row's masked targets (B,), their count (B,)): what
    # objectives that compare whole responses build on (`jaxscale/objectives/`), with the
    # task's own extra loss terms (the MoE router's) as a third, scalar value. None: the
    # model scores no sequences (an image classifier).
    sequence_logps: Callable[..., tuple[jax.Array, jax.Array, jax.Array]] | None = None
    # token_logps(model, {'tokens': (B, T+1), 'loss_mask': (B, T+1)}, run_layers) -> (the
    # log-probability of every target (B, T), the float mask of the targets `loss_mask` marks
    # (B, T), the extra loss term), positions in their natural order: what a policy gradient
    # (GRPO) compares token by token with the sampler's. None: no tokens to score.
    token_logps: Callable[..., tuple[jax.Array, jax.Array, jax.Array]] | None = None


def masked_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array | None
                ) -> dict[str, jax.Array]:
    """Summed cross entropy, correct argmax predictions and count of `targets` (any leading
    shape), weighted by `mask` (None: all count; one value per example broadcasts)."""
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    if mask is None:
        mask = jnp.ones(targets.shape, jnp.float32)
    elif mask.ndim < targets.ndim:  # one mask value per example
        mask = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (targets.ndim - mask.ndim)),
                                targets.shape)
    return {"loss": (losses * mask).sum(), "correct": (correct * mask).sum(),
            "count": mask.sum()}


def step_metrics(model: Any) -> dict[str, jax.Array]:
    """Extra metrics a task's loss recorded on `model` as `nnx.Intermediate` variables named by
    the metric (e.g. the MoE router's `moe_aux_loss`, `moe/layer.router_loss`), popped so the
    step can report them: {} for a model that records none."""
    return {"/".join(map(str, path)): v.get_value()
            for path, v in nnx.to_flat_state(nnx.pop(model, nnx.Intermediate))}
