"""`config.model.moe` as a dataclass, and the sizes every consumer derives from it.

Apart from `layer.py` so that the routers (`routers.py`), which read these fields, sit below the
block that calls them: `config` < `routers` < `layer`. Its checks against the mesh live with the
block (`layer.check_moe`), which knows the routers' table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

GROUPED_MATMULS = ("auto", "ragged_dot", "megablox", "dense")
DISPATCHES = ("auto", "allgather", "ragged_all_to_all")


@dataclass(frozen=True)
class MoEConfig:
    """`config.model.moe`: num_experts 0 keeps the dense MLP."""

    num_experts: int = 0
    router: str = "softmax_topk"  # how tokens pick experts (routers.py: ROUTERS)
    experts_per_token: int = 2
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1 (Mixtral, Qwen3)
    mlp: int = 0                 # each expert's hidden width; 0: model.mlp
    shared_experts: int = 0      # always-on dense SwiGLU of shared_experts x the expert width
    capacity_factor: float = 0.0  # 0: dropless (grouped matmul); > 0: fixed expert buffers
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    # MoE on every n-th layer, the dense MLP on the others: layer i has the experts when
    # (i + 1) % every == 0 (HF Qwen-MoE's decoder_sparse_step); num_layers must divide by it.
    every: int = 1
    # Dropless only (`dropless.py`): the grouped matmul's kernel and, with an expert
    # axis, how tokens reach their experts; "auto" picks by platform and shapes.
    grouped_matmul: str = "auto"  # auto | ragged_dot | megablox | dense
    dispatch: str = "auto"        # auto | allgather | ragged_all_to_all
    # GPT-OSS's experts: a bias on the router's logits and on each expert's three projections,
    # and the clamped SwiGLU (gmm.SwiGLU) when swiglu_limit > 0 (0: the plain SwiGLU).
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702

    @classmethod
    def from_config(cls, moe_cfg: Mapping[str, Any] | None) -> "MoEConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(moe_cfg or {}).items() if k in names})


def expert_width(moe: MoEConfig, mlp: int) -> int:
    """Each expert's SwiGLU hidden width (`model.moe.mlp`, or the dense `model.mlp`)."""
    return moe.mlp or mlp


def num_params(moe: MoEConfig, embed: int, mlp: int) -> int:
    """Parameters of one MoE block: router, experts and shared experts, biases included."""
    f = expert_width(moe, mlp)
    biases = moe.router_bias + moe.expert_bias * (2 * f + embed)
    return embed * moe.num_experts + moe.num_experts * (3 * embed * f + biases) \
        + 3 * embed * f * moe.shared_experts


def active_mlp(m: Mapping[str, Any]) -> tuple[int, int]:
    """(the SwiGLU width a token passes through, router matmul parameters) of a `config.model`
    section's feed-forward block: its experts_per_token + shared_experts experts for MoE
    (what FLOPs per token count), or the dense `mlp` and no router."""
    moe = MoEConfig.from_config(m.get("moe"))
    if not moe.num_experts:
        return m["mlp"], 0
    width = expert_width(moe, m["mlp"])
    return width * (moe.experts_per_token + moe.shared_experts), m["embed"] * moe.num_experts
