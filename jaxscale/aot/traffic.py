"""The analytic collective bytes a compiled step should move, to check the collective table
against: the MoE capacity path's token dispatch (`models/moe.capacity_experts`).

Each MoE layer's expert buffers, (rows, experts X, slots C, embed E) in the compute dtype, are
filled with rows over all the batch's mesh axes and computed with experts over `expert`, so the
reshard between the two is an all-to-all over `expert`, of the buffer's per-chip share each way:
tokens to their experts and the experts' outputs back (2 a layer in the forward pass), their
transposes in the backward pass (2 more), and the forward pair again where remat recomputes the
layer (every `model.remat` but `none`). The dropless path (grouped matmul) has no dispatch to
count here; with `mesh.expert` 1 the buffers never move. Bytes follow `aot.hlo`: an all-to-all's
payload per chip, as the table shows it.
"""

from __future__ import annotations

import math

import ml_collections as mlc
import numpy as np


def moe_all_to_all_bytes(config: mlc.ConfigDict, mesh) -> float:
    """All-to-all bytes per chip per step of the MoE dispatch on `mesh` (0: none expected).

    The buffers' rows split as the rules split `batch` (the presets: data x fsdp x expert),
    C = moe.capacity(capacity_factor, seq_len x experts_per_token, num_experts) per row."""
    from jaxscale.models.moe import ROW_AXES, MoEConfig, capacity  # lazy: jax
    from jaxscale.precision import get_policy
    from jaxscale.rules import AxisRules

    moe = MoEConfig.from_config(config.model.get("moe"))
    if not moe.num_experts or moe.capacity_factor <= 0 or mesh.shape.get("expert", 1) <= 1:
        return 0.0
    rows, t, x = config.data.batch_size, config.data.seq_len, moe.num_experts
    shape = (rows, x, capacity(moe.capacity_factor, t * moe.experts_per_token, x),
             config.model.embed)
    spec = AxisRules.from_config(config).spec(ROW_AXES, shape, mesh, warn=False)
    axes = spec[0] or ()
    shards = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
    itemsize = np.dtype(get_policy(config.precision).compute).itemsize
    per_layer = 4 + 2 * (config.model.get("remat", "none") != "none")
    return config.model.num_layers * per_layer * math.prod(shape) * itemsize / shards
