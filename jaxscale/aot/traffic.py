"""The analytic bytes that attention across sequence shards moves, to check a compiled step by.

With `mesh.context` x `mesh.dcn_context` = n > 1 (`models/context.py`), each chip holds `rows`
sequences' T/n tokens and K/tensor kv heads of head dim D, so one key (or value) block is
rows x T/n x K/tensor x D elements of the compute dtype. Per layer and pass:

- `ring`: n - 1 `ppermute`s each of the key and the value block (plus the block's int32 slots,
  and segment ids when packed) in the forward pass; the backward pass sends the blocks'
  cotangents back around the ring (keys and values again, no ints). `ring_vjp` (custom VJP)
  instead rotates keys, values and slots with their float32 dK and dV n times.
- `allgather`: one `all_gather` of keys and values (and their ints); the backward pass
  reduce-scatters the cotangents of the gathered blocks. Counted as `aot/hlo.py` counts them
  (the gathered result, the scattered input: n blocks each), and mixed in the compiled
  report with FSDP's own gathers and scatters of the weights.

A rematerialised layer (`model.remat` other than none) runs its forward pass again in the
backward pass, so its forward traffic counts twice. Bytes per chip per step, for every
micro-batch, the way `aot/hlo.py` counts a collective.
"""

from __future__ import annotations

from typing import Any

import ml_collections as mlc

COMPUTE_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2}


def attention_traffic(config: mlc.ConfigDict) -> dict[str, Any] | None:
    """Expected attention bytes per chip per step across sequence shards: the forward kind
    and bytes (`collective-permute` for the ring, `all-gather` for allgather; remat's second
    forward pass included) and the backward pass's, or None when nothing splits the
    sequence."""
    m, d, mesh = config.model, config.data, config.mesh
    n = mesh.get("context", 1) * mesh.get("dcn_context", 1)
    if n <= 1:
        return None
    batch_shards = max(1, mesh.get("data", 1)) * mesh.get("fsdp", 1) * mesh.get("dcn_data", 1)
    rows = d.batch_size / (config.train.grad_accum * batch_shards * mesh.get("dcn_fsdp", 1))
    tokens = rows * d.seq_len / n  # one chip's tokens of one micro-batch
    kv_heads = m.num_kv_heads / min(mesh.get("tensor", 1), m.num_kv_heads)
    block = tokens * kv_heads * m.head_dim * COMPUTE_BYTES.get(config.precision, 2)
    ints = d.seq_len / n * 4 + (tokens * 4 if d.get("sources") else 0)
    forward_passes = 1 + (m.get("remat", "none") != "none")
    variant = m.get("context_attention", "allgather")
    ring = variant != "allgather"
    steps = n - 1 if ring else n
    scale = m.num_layers * config.train.grad_accum
    backward = steps * 2 * block
    if variant == "ring_vjp":  # k, v, slots and float32 dK, dV, n hops
        backward = n * (2 * block + ints + 2 * tokens * kv_heads * m.head_dim * 4)
    return {"variant": variant, "shards": n, "block_bytes": block,
            "forward_kind": "collective-permute" if ring else "all-gather",
            "forward": forward_passes * steps * (2 * block + ints) * scale,
            "backward_kind": "collective-permute" if ring else "reduce-scatter",
            "backward": backward * scale}
