"""A rough guess of a step's bytes per chip under each remat policy, used only to order the
planner.

Why: the planner compiles candidates likeliest-winner first under a budget. The less a step
recomputes the faster it is, so the lightest remat that fits wins; but for large models no remat
needs several times the HBM, and trying it first would spend the budget on refusals. This guess
decides which policy to try first. It is never reported and never decides a fit: the compiler does (`aot.compile`). It is
the one memory model (`aot.memory`) scaled by `CALIBRATION`, because the model's counts fall
short of libtpu's compiled totals (bench/RESULTS.md has the compiled totals of these steps).
Nothing here names a model: the parameter count comes from the model table (`ModelDef`), the
widths from the `config.model` fields every transformer in it has.
"""

from __future__ import annotations

import ml_collections as mlc

from jaxscale.aot.memory import Dims, state_bytes_per_param, step_bytes

CALIBRATION = 1.5  # libtpu's compiled total / the memory model's count, about, where measured


def dims_of(config: mlc.ConfigDict) -> Dims | None:
    """The model's parameter count and widths (building its abstract shapes, no arrays), or
    None for a model without the widths the memory model needs. Once per config: the planner
    passes the result to `remat_bytes` for each candidate."""
    from jaxscale.models import ModelDef  # lazy: the planner's module import stays light
    from jaxscale.precision import get_policy

    num_params = ModelDef.build(config.model, get_policy(config.precision)).num_params()
    return Dims.from_model(config.model, num_params)


def remat_bytes(config: mlc.ConfigDict, dims: Dims | None, mesh: dict[str, int], accum: int,
                attention: str, loss_chunks: int, remat: str) -> float | None:
    """Guessed bytes per chip of `config`'s step under `remat` on `mesh` (sizes by axis, data
    including slices) with `accum` micro-batches, `attention` and `loss_chunks`, or None where
    there is no guess (no `dims`, or pipeline stages, whose schedules hold activations
    differently). A policy named by what it saves is counted by those activations' bytes per
    layer and token (`memory.NAME_WIDTHS`), so the planner can order the policies between
    none and full."""
    import numpy as np

    from jaxscale.precision import get_policy

    if dims is None or mesh.get("pipeline", 1) > 1:
        return None
    policy, seq = get_policy(config.precision), config.data.seq_len
    state = state_bytes_per_param(np.dtype(policy.param).itemsize,
                                  np.dtype(policy.compute).itemsize, accumulate=accum > 1)
    tokens = config.data.batch_size / (mesh["data"] * mesh["fsdp"] * mesh.get("expert", 1)
                                       * accum) * seq
    return CALIBRATION * step_bytes(
        dims, tokens=tokens, seq_len=seq, state_bytes=state, param_shards=mesh["fsdp"],
        tensor=mesh.get("tensor", 1), remat=remat, einsum_scores=attention == "einsum",
        loss_chunks=loss_chunks)
