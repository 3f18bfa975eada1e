"""Rough guesses of a step's bytes per chip and of its time, used only to order the planner.

Why: the planner compiles candidates likeliest-winner first under a budget. The less a step
recomputes the faster it is, so the lightest remat that fits wins; but for large models no remat
needs several times the HBM, and trying it first would spend the budget on refusals. This guess
decides which policy to try first (and which are too far over to try at all), and the time guess
(`step_seconds`: the analytic FLOPs with the recompute, plus the collectives a mesh and
accumulation imply) orders the rest, fastest first. Neither is reported and neither decides a
fit or a rank: the compiler does (`aot.compile`). The bytes are the one memory model
(`aot.memory`) scaled by `CALIBRATION` or `REMAT_CALIBRATION`, because the model's counts miss
libtpu's compiled totals (bench/RESULTS.md has the compiled totals of these steps).
Nothing here names a model: the parameter count comes from the model table (`ModelDef`), the
widths from the `config.model` fields every transformer in it has.
"""

from __future__ import annotations

import ml_collections as mlc

from jaxscale.aot.memory import BF16, Dims, state_bytes_per_param, step_bytes
from jaxscale.hardware import Chip

CALIBRATION = 1.5  # libtpu's compiled total / the memory model's count, about, where measured
# ... for a policy that keeps every activation (none, dots): the model counts ten embed-wide
# and four mlp-wide tensors a layer, libtpu keeps more (7B, 4 sequences a chip: 68.4 GiB
# compiled, 47 counted). With remat the model over-counts instead (its two live layers and
# whole float32 logits; 7B on v5e-256: full 5.25 GiB compiled, 8.0 counted; save_qkv_proj 10.6,
# 14.7): REMAT_CALIBRATION scales those, so that the guess ranks the policies as libtpu does.
REMAT_CALIBRATION = 0.75
KEEPS_ALL = ("none", "dots", "dots_no_batch")


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

    from jaxscale.objectives import holds_reference
    from jaxscale.precision import get_policy

    if dims is None or mesh.get("pipeline", 1) > 1:
        return None
    policy, seq = get_policy(config.precision), config.data.seq_len
    state = state_bytes_per_param(np.dtype(policy.param).itemsize,
                                  np.dtype(policy.compute).itemsize, accumulate=accum > 1)
    if holds_reference(config):  # dpo / ipo: a frozen copy of the weights, sharded as they are
        state += np.dtype(policy.param).itemsize
    tokens = config.data.batch_size / (mesh["data"] * mesh["fsdp"] * mesh.get("expert", 1)
                                       * accum) * seq
    scale = CALIBRATION if remat in KEEPS_ALL else REMAT_CALIBRATION
    return scale * step_bytes(
        dims, tokens=tokens, seq_len=seq, state_bytes=state, param_shards=mesh["fsdp"],
        tensor=mesh.get("tensor", 1), remat=remat, einsum_scores=attention == "einsum",
        loss_chunks=loss_chunks, expert=mesh.get("expert", 1))


def step_seconds(chip: Chip, dims: Dims | None, mesh: dict[str, int], accum: int,
                 tokens_per_chip: float, compute_s: float) -> float:
    """Guessed seconds of a step, no overlap: `compute_s` (the analytic FLOPs per chip with the
    remat recompute, `aot.flops.expected_flops`, at the chip's peak) plus the collectives a
    sharding implies, each over one ring of `chip.ring_bandwidth`: per micro-batch FSDP
    gathers the bf16 weights (of MoE experts only the chip's own, `Dims.local_params`) twice (forward, backward) and reduces their gradient: an
    all-reduce (twice a gather) where FSDP spans the slice, as libtpu compiles it on v5e-64 and
    v5e-256, a reduce-scatter beside a data axis (bench/RESULTS.md); the data axis all-reduces
    each fsdp shard's gradient; tensor parallelism moves every layer's
    activations about 16 times, forward and backward (7B on v5e-256 at tensor=2: about 320 ms
    of a step's collectives, bench/RESULTS.md). Only an order: the compiled
    estimate (`aot.roofline`) ranks."""
    if dims is None:
        return compute_s
    bw, ring = chip.ring_bandwidth, lambda n: (n - 1) / n
    fsdp, data, tensor = mesh["fsdp"], mesh["data"], mesh.get("tensor", 1)
    weights = dims.local_params(mesh.get("expert", 1)) * BF16 / tensor / max(
        mesh.get("pipeline", 1), 1)  # a chip gathers only its own experts
    reduce = 2 if data == 1 else 1  # FSDP alone all-reduces the gradient, beside data scatters
    comm = accum * (2 + reduce) * weights * ring(fsdp) / bw
    comm += accum * 2 * weights / fsdp * ring(data) / bw
    comm += 16 * dims.num_layers * tokens_per_chip * dims.embed * BF16 * ring(tensor) / bw
    return compute_s + comm


def state_floor_bytes(config: mlc.ConfigDict, dims: Dims | None, chips: int) -> float | None:
    """The least bytes per chip any sharding of `config` over `chips` can need: the weights in
    the parameter dtype and, for Adam (and LAMB), its two moments, every tensor split over
    every chip, nothing else (LoRA: the frozen weights alone, counted in bf16). Not a guess
    but a floor: a slice where it exceeds the HBM budget is ruled out without compiling (the
    plan's walk over a generation's slices, `launch.plan --topology=GEN`); None without dims."""
    import numpy as np

    from jaxscale.precision import get_policy

    if dims is None:
        return None
    param = np.dtype(get_policy(config.precision).param).itemsize
    if config.lora.rank:
        return dims.num_params * BF16 / chips
    moments = 2 * param if config.optim.name in ("adamw", "lamb") else 0
    return dims.num_params * (param + moments) / chips
