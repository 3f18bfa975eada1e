"""Logical-axis rules presets, one per parallelism strategy: `--config.rules_preset=NAME`.

A preset replaces `config.rules` (see `AxisRules.from_config`); model code never changes. Every
preset is valid on every mesh (an axis of size 1 costs nothing), so a preset says which mesh
axes are *allowed* to shard what, and `config.mesh` says how large they are. Every preset puts
the stacked `layers` dimension on `pipeline`, so any of them runs pipeline stages when
`mesh.pipeline` > 1 (each stage stores only its own layers):

- `dp`: parameters replicated, batch split over `data` (and `fsdp`, if that axis is > 1).
- `fsdp`: ZeRO-3, parameters/gradients/optimizer state split over `fsdp` on their embed
  dimension (mlp/vocab as fallbacks), gathered layer by layer inside the scanned stack.
- `tp`: Megatron tensor parallelism: heads, kv heads, the mlp hidden and vocab dims over `tensor`.
- `fsdp_tp`: both (the default rules, `config.DEFAULT_RULES`).
- `pp`: pipeline stages over `pipeline` with FSDP and TP inside them (the same rules as
  `fsdp_tp`; the name says what the mesh is for).

Every preset also puts the `length` of activations on `context` (free when `mesh.context` is 1):
with `mesh.context` > 1 norms, MLPs and projections run on sequence shards and attention runs across
them (`models/attention/sequence/context.py`, `model.context_attention`). Weights have no `length`.

Every preset also puts MoE experts (`models/moe/layer.py`) on `expert` and splits the batch over it
as over `data` (free when `mesh.expert` is 1): with `mesh.expert` > 1 each device holds num_experts
/ expert of the experts and its own rows of the batch; tokens travel to their experts' devices and
back (an all-to-all), the weights never do.
"""

from __future__ import annotations

from typing import Any

_BATCH = ("batch", ("data", "fsdp", "expert"))
# Replicated, except the sequence `length` of activations over `context` (context parallelism)
# and MoE experts over `expert` (expert parallelism).
_REPLICATED = [("length", "context"), ("head_dim", None), ("norm", None), ("lora_rank", None),
               ("fused", None),  # the q/k/v and gate/up parts of a fused weight
               ("expert", "expert"),  # MoE experts (models/moe/layer.py)
               ("expert_batch", ("data", "fsdp"))]  # rows of the experts' capacity buffers
_STAGES = [("layers", "pipeline")]
_TP = [("vocab", "tensor"), ("heads", "tensor"), ("kv", "tensor"), ("mlp", "tensor")]
_FSDP = [("embed", "fsdp"), ("mlp", "fsdp"), ("vocab", "fsdp")]

PRESETS: dict[str, list[tuple[str, Any]]] = {
    "dp": [_BATCH, ("vocab", None), ("heads", None), ("kv", None), ("mlp", None),
           ("embed", None)] + _REPLICATED + _STAGES,
    "fsdp": [_BATCH] + _FSDP + [("heads", None), ("kv", None)] + _REPLICATED + _STAGES,
    "tp": [_BATCH] + _TP + [("embed", None)] + _REPLICATED + _STAGES,
    "fsdp_tp": [_BATCH] + _TP + _FSDP + _REPLICATED + _STAGES,
    "pp": [_BATCH] + _TP + _FSDP + _REPLICATED + _STAGES,
}


def preset_names() -> list[str]:
    return sorted(PRESETS)
