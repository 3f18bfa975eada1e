"""What a model's forward pass and a task loss ask of a layer runner (a pipeline schedule).

A model runs its stacked layer block with `lax.scan` unless the step hands it a runner, which
replaces that scan (`runner(block, h_BTE, positions_BT[, segments_BT]) -> h_BTE`, e.g. GPipe
over the `pipeline` mesh axis). The train step and gradient accumulation read `microbatches` (batch rows
must divide into them) and call `scaled(loss_scale)` under float16 loss scaling. A runner with
`fuses_loss` (1F1B) runs the head and loss inside its schedule: a loss that supports that calls
`fused_loss` in place of the model's forward. A runner may also offer `head_scope()`, a context
the model runs its head in after the layers (GPipe: rows split over the stages, so the head is
computed once rather than on every stage). The implementations live in `jaxscale/parallel/`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

# (model, last layer's output h_BTE, targets_BT) -> the loss of the model's head on h (e.g.
# `decoder/lm_task.mean_head_loss`: the head and loss together, so they may run chunk by chunk).
# Not the step's loss of the parameters (`train/step.loss_and_metrics`): only its head's part.
HeadLoss = Callable[[Any, jax.Array, jax.Array], jax.Array]


@runtime_checkable
class LayerRunner(Protocol):
    microbatches: int  # a batch's rows are split into this many microbatches
    fuses_loss: bool   # True: use `fused_loss` (layers + head + loss) instead of `__call__`

    def __call__(self, block: Any, h_BTE: jax.Array, positions_BT: jax.Array | None,
                 segments_BT: jax.Array | None = None) -> jax.Array:
        """Runs the stacked `block` over `h_BTE`, as the model's own scan would (packed rows:
        `segments_BT`, the document id of each position, 0 on padding)."""

    def scaled(self, loss_scale: jax.Array) -> "LayerRunner":
        """This runner for a loss multiplied by `loss_scale` (float16 loss scaling)."""

    def fused_loss(self, model: Any, tokens_BT: jax.Array, targets_BT: jax.Array,
                   head_loss: HeadLoss, positions_BT: jax.Array | None = None,
                   segments_BT: jax.Array | None = None,
                   sown_loss: Callable[[Any], Any] | None = None,
                   sown_weight: jax.Array | float = 1.0) -> jax.Array:
        """head_loss(model, layers(model.embed(tokens)), targets), layers run by the runner
        (mean of the microbatches' losses; packed rows pass their positions and segments).
        What the layers sow is left on `model.layers`; `sown_loss` of it (the MoE router's
        losses, `sown_weight` times this loss's weight in the total) is differentiated with
        it, the backward running inside the schedule."""
