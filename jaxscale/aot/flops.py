"""The analytic FLOPs a compiled train step should contain, to check the compiled count against.

Every count is a fact of the model's table entry (`jaxscale.models.MODELS`; the Llama's in
`models/decoder/flops.py`), so nothing here names a model. `model_flops` is the PaLM-convention
training count (`flops_per_token`: 6 per matmul parameter per token plus 12·L·H·Q·T for
attention), the number MFU is quoted in. A rematerialised step does more: the entry's
`recompute_flops` adds the forward matmuls the backward pass redoes (and, under
`model.loss_chunks > 1`, each chunk's logits), and an MoE capacity path computes the empty slots
of its expert buffers (the entry's `padding_flops`). So compiled FLOPs = model + recompute +
padding, to within the matmuls outside the model (none on these steps); a pipeline adds its
bubble iterations on top (they compute on padding).

With `model.attention=splash` the attention matmuls run inside Pallas kernels, custom calls with no
dot in the HLO to count: `kernel_flops` is what the compiled count then misses, the entry's
`attention_flops` (the attention part of model + recompute, counted as the einsum computes it; the
kernel itself skips the tiles a causal mask hides and recomputes QK^T in its backward pass, so its
true count differs), which the report adds and labels as analytic.

A dropless MoE step's grouped matmuls (`ragged-dot`, megablox) are counted by the HLO at their
static rows, every row of the gathered or worst-case received buffer, while only the routed rows
(tokens x experts_per_token) are multiplied: `routed_flops` is what they compute, which the
report puts in place of the static count (`hlo_flops.grouped_flops`) for the FLOPs the estimate
charges. Across sequence shards the splash
blocks (`models/attention/sequence/context_splash.py`) are such kernels too, unless the sequence's
layout is off their grid and the einsum tiles run (`context.splash_blocks_run`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_collections as mlc


def _entry(config: mlc.ConfigDict) -> Any:
    """The model table entry of the config's model (imported late: the models pull in jax)."""
    from jaxscale.models import entry_of
    return entry_of(config.model)


def _per_step(config: mlc.ConfigDict, count: Callable[[Any, int], float] | None, num_chips: int
              ) -> float | None:
    """A per-token count of the model's entry, per chip per step (None without the count),
    of the model with its automatic loss chunks resolved (`resolved_model`)."""
    d = config.data
    if count is None:
        return None
    return (count(resolved_model(config, num_chips), d.seq_len) * d.batch_size * d.seq_len
            / num_chips)


def resolved_model(config: mlc.ConfigDict, num_chips: int) -> Any:
    """`config.model` with `loss_chunks=0` (automatic, the default) replaced by the count the
    step will take (`lm_task.choose_loss_chunks` for a chip's float32 logits of one micro-batch
    under the config's rules): the counts ask `loss_chunks > 1` for the head's recompute, and
    an automatic choice of several chunks recomputes it as an explicit one does (GPT-OSS-20B,
    one 4,096-token sequence a chip: 4 chunks, 2·E·V = 1.2e9 FLOPs a token, 3.4% of its step).
    """
    m = config.model
    if m.get("loss_chunks", 1) or "vocab_size" not in m:
        return m
    import numpy as np
    from jax.sharding import AbstractMesh

    from jaxscale.mesh import MESH_AXES, MeshError, resolve_mesh_shape
    from jaxscale.models.decoder.lm_task import choose_loss_chunks
    from jaxscale.rules import AxisRules, as_tuple

    d = config.data
    try:
        ici, dcn = resolve_mesh_shape(config.get("mesh") or {}, num_chips)
    except MeshError:  # a mesh that does not fit the chips: the compile says so
        return m
    sizes = {a: ici[a] * dcn[a] for a in MESH_AXES}
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
    shape = (d.batch_size // max(config.train.get("grad_accum", 1), 1), d.seq_len, m.vocab_size)
    spec = AxisRules.from_config(config).activation_spec(("batch", "length", "vocab"), shape,
                                                         mesh)
    shards = [int(np.prod([sizes[a] for a in as_tuple(axes)])) for axes in spec]
    chip_bytes = float(np.prod(shape)) * 4 / float(np.prod(shards))
    chunks = choose_loss_chunks(d.seq_len, chip_bytes, shards[1])
    resolved = mlc.ConfigDict(m.to_dict())
    resolved.loss_chunks = chunks
    return resolved


def model_flops(config: mlc.ConfigDict, num_chips: int) -> float | None:
    """Analytic model FLOPs per chip per step (PaLM convention), or None for a model whose
    entry has no count."""
    return _per_step(config, _entry(config).flops_per_token, num_chips)


def kernel_flops(config: mlc.ConfigDict, num_chips: int) -> float:
    """Attention FLOPs per chip per step done inside Pallas kernels (`model.attention=splash`
    where the kernel applies), invisible to the HLO dot count; 0 otherwise."""
    from jaxscale.models.attention.sequence.context import splash_blocks_run
    from jaxscale.models.attention.splash import block_size

    m, d = config.model, config.data
    if m.get("attention", "einsum") != "splash" or block_size(d.seq_len) is None:
        return 0.0
    mesh = config.get("mesh") or {}
    shards = mesh.get("context", 1) * mesh.get("dcn_context", 1)
    if shards > 1 and not splash_blocks_run(d.seq_len, shards, m.get("context_order", "auto"),
                                            m.get("context_attention", "allgather")):
        return 0.0  # the einsum tiles run across the sequence shards: the HLO counts them
    return _per_step(config, _entry(config).attention_flops, num_chips) or 0.0


def padding_flops(config: mlc.ConfigDict, num_chips: int) -> float:
    """Matmul FLOPs per chip per step on padding the model count leaves out (an MoE capacity
    path's empty expert slots); 0 for a model without any."""
    return _per_step(config, _entry(config).padding_flops, num_chips) or 0.0


def expected_flops(config: mlc.ConfigDict, num_chips: int) -> float | None:
    """Model FLOPs plus the remat recompute and the padding, per chip per step: what the
    compiled step holds."""
    base = model_flops(config, num_chips)
    recompute = _per_step(config, _entry(config).recompute_flops, num_chips)
    if base is None or recompute is None:
        return None
    return base + recompute + padding_flops(config, num_chips)


def routed_flops(config: mlc.ConfigDict, num_chips: int) -> float:
    """The routed experts' matmul FLOPs per chip per step at the routed rows (every token's
    experts_per_token assignments, the chips' mean: exact in total, one chip's share follows
    the routing), on the layers with experts (`sparse_layers`: DeepSeek's dense first layers
    have none): three matmuls, forward and two backward, and the forward again under a remat
    policy that recomputes them (all but `none` and `dots`, as `recompute_flops` has it). 0
    without a dropless MoE (a capacity path's buffers are static: the HLO counts them)."""
    from jaxscale.models.moe.config import MoEConfig, expert_width, sparse_layers  # lazy: jax

    m, d = config.model, config.data
    moe = MoEConfig.from_config(m.get("moe"))
    if not moe.num_experts or moe.capacity_factor > 0:
        return 0.0
    passes = 3 + (m.get("remat", "none") not in ("none", "dots"))
    per_token = 2.0 * 3 * m.embed * expert_width(moe, m.mlp) * moe.experts_per_token
    layers = sparse_layers(moe, m.num_layers)
    return layers * passes * per_token * d.batch_size * d.seq_len / num_chips
