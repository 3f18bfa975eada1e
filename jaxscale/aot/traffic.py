"""The analytic collective bytes a compiled step should move, to read the compiler's collective
table against: the MoE capacity path's token dispatch and attention across sequence shards.
Bytes per chip per step, counted the way `aot/hlo.py` counts a collective.

**MoE dispatch** (`models/moe/layer.capacity_experts`). Each MoE layer's expert buffers, (rows,
experts X, slots C, embed E) in the compute dtype, are filled with rows over all the batch's
mesh axes and computed with experts over `expert`, so the reshard between the two is an
all-to-all over `expert`, of the buffer's per-chip share each way: tokens to their experts and
the experts' outputs back (2 a layer in the forward pass), their transposes in the backward pass
(2 more), and the forward pair again where remat recomputes the layer (every `model.remat` but
`none`). With `mesh.expert` 1 the buffers never move.

**MoE dropless dispatch** (`models/moe/dispatch.py`, `model.moe.dispatch` ragged_all_to_all, or
auto on TPU). Each chip sends its n tokens' n x k assignments (embed E, compute dtype) to their
experts' devices and receives as many back: 2 ragged all-to-alls a layer forward, 2 in the
backward pass, 2 more under remat, each of n x k x E elements (`aot/hlo.py` counts the smaller of
the op's send and receive buffers: the rows sent). This is exact whatever the routing (every
assignment travels once; the share a device keeps for itself is counted too, as for the
all-to-all). The all-gather dispatch moves expert-axis x n tokens instead and has no separate
expectation here (it mixes with FSDP's gathers).

**Attention across sequence shards** (`models/attention/sequence/context.py`). With
`mesh.context` x `mesh.dcn_context` = n > 1, each chip holds `rows` sequences' T/n tokens, so
one K/V block, the keys and values of those tokens, is rows x T/n x the attention component's
`kv_elements(tensor)` elements of the compute dtype (grouped-query: 2 x K/tensor kv heads x
head dim D). Per layer and pass:

- `ring`: n - 1 `ppermute`s each of the key and the value block (plus the block's int32 slots,
  and segment ids when packed) in the forward pass; the backward pass sends the blocks'
  cotangents back around the ring (keys and values again, no ints). `ring_vjp` (custom VJP)
  instead rotates keys, values and slots with their float32 dK and dV n times.
- `allgather`: one `all_gather` of keys and values (and their ints); the backward pass
  reduce-scatters the cotangents of the gathered blocks. Counted as `aot/hlo.py` counts them
  (the gathered result, the scattered input: n blocks each), and mixed in the compiled
  report with FSDP's own gathers and scatters of the weights.
- With `model.attention=splash` (the splash blocks,
  `models/attention/sequence/context_splash.py`) the custom VJP makes `ring` the `ring_vjp`
  ring, and `allgather` reduce-scatters float32 dK, dV (under remat its backward pass's second
  gather of K/V is the recompute's, merged by the compiler).

A rematerialised layer (`model.remat` other than none) runs its forward pass again in the
backward pass, so its forward traffic counts twice.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections as mlc
import numpy as np


def _compute_bytes(config: mlc.ConfigDict) -> int:
    from jaxscale.precision import get_policy  # lazy: jax

    return np.dtype(get_policy(config.precision).compute).itemsize


def moe_all_to_all_bytes(config: mlc.ConfigDict, mesh) -> float:
    """All-to-all bytes per chip per step of the MoE dispatch on `mesh` (0: none expected).

    The buffers' rows split as the rules split `batch` (the presets: data x fsdp x expert),
    C = moe.capacity(capacity_factor, seq_len x experts_per_token, num_experts) per row."""
    from jaxscale.models.moe.config import MoEConfig  # lazy: jax
    from jaxscale.models.moe.layer import ROW_AXES, capacity
    from jaxscale.rules import AxisRules, as_tuple

    moe = MoEConfig.from_config(config.model.get("moe"))
    if not moe.num_experts or mesh.shape.get("expert", 1) <= 1:
        return 0.0
    if moe.capacity_factor <= 0:
        return moe_ragged_bytes(config, mesh)
    rows, t, x = config.data.batch_size, config.data.seq_len, moe.num_experts
    shape = (rows, x, capacity(moe.capacity_factor, t * moe.experts_per_token, x),
             config.model.embed)
    spec = AxisRules.from_config(config).activation_spec(ROW_AXES, shape, mesh)
    shards = math.prod(mesh.shape[a] for a in as_tuple(spec[0]))
    itemsize = _compute_bytes(config)
    per_layer = 4 + 2 * (config.model.get("remat", "none") != "none")
    moe_layers = config.model.num_layers // moe.every  # MoE on every `every`-th layer
    return moe_layers * per_layer * math.prod(shape) * itemsize / shards


def moe_ragged_bytes(config: mlc.ConfigDict, mesh) -> float:
    """Ragged all-to-all bytes per chip per step of the dropless dispatch on `mesh` (0 when it
    does not run: `model.moe.dispatch=allgather`, or auto where the expert axes do not split the
    tokens). n: the step's tokens over the mesh axes that split `batch` and `length`."""
    from jaxscale.models.moe.config import MoEConfig  # lazy: jax
    from jaxscale.rules import AxisRules, as_tuple

    moe = MoEConfig.from_config(config.model.get("moe"))
    if moe.dispatch == "allgather":
        return 0.0
    b, t, e = config.data.batch_size, config.data.seq_len, config.model.embed
    batch, length, _ = AxisRules.from_config(config).activation_spec(
        ("batch", "length", "embed"), (b, t, e), mesh)
    token_axes = as_tuple(batch) + as_tuple(length)
    if "expert" not in token_axes:
        return 0.0
    tokens = b * t / math.prod(mesh.shape[a] for a in token_axes)
    per_layer = 4 + 2 * (config.model.get("remat", "none") != "none")
    return (config.model.num_layers * per_layer * tokens * moe.experts_per_token * e
            * _compute_bytes(config))


def attention_traffic(config: mlc.ConfigDict) -> dict[str, Any] | None:
    """Expected attention bytes per chip per step across sequence shards: the forward kind
    and bytes (`collective-permute` for the ring, `all-gather` for allgather; remat's second
    forward pass included) and the backward pass's, or None when nothing splits the
    sequence (or the model has no attention component to ask)."""
    from jaxscale.models import entry_of  # lazy: jax

    m, d, mesh = config.model, config.data, config.mesh
    n = mesh.get("context", 1) * mesh.get("dcn_context", 1)
    attention = entry_of(m).attention
    if n <= 1 or attention is None:
        return None
    batch_shards = max(1, mesh.get("data", 1)) * mesh.get("fsdp", 1) * mesh.get("dcn_data", 1)
    rows = d.batch_size / (config.train.grad_accum * batch_shards * mesh.get("dcn_fsdp", 1))
    tokens = rows * d.seq_len / n  # one chip's tokens of one micro-batch
    kv = tokens * attention(m).kv_elements(mesh.get("tensor", 1))  # a K/V block's elements
    kv_bytes = kv * _compute_bytes(config)
    ints = d.seq_len / n * 4 + (tokens * 4 if d.get("sources") else 0)
    forward_passes = 1 + (m.get("remat", "none") != "none")
    variant = m.get("context_attention", "allgather")
    if variant == "ring" and m.get("attention", "einsum") == "splash":
        variant = "ring_vjp"  # the splash blocks' ring has the custom VJP's ring backward
    ring = variant != "allgather"
    steps = n - 1 if ring else n
    scale = m.num_layers * config.train.grad_accum
    backward = steps * kv_bytes
    if variant == "ring_vjp":  # keys, values, slots and their float32 gradients, n hops
        backward = n * (kv_bytes + ints + kv * 4)
    elif m.get("attention", "einsum") == "splash":  # the splash blocks' VJP: float32 dK, dV
        backward = backward * 4 / _compute_bytes(config)
    return {"variant": variant, "shards": n, "kv_block_bytes": kv_bytes,
            "forward_kind": "collective-permute" if ring else "all-gather",
            "forward": forward_passes * steps * (kv_bytes + ints) * scale,
            "backward_kind": "collective-permute" if ring else "reduce-scatter",
            "backward": backward * scale}
