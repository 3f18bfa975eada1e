"""A mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE, DeepSeek-style shared experts).

`MoE` replaces the decoder's dense SwiGLU (`layers.MLP`) when `model.moe.num_experts > 0`. A
softmax router picks `experts_per_token` experts per token (their weights renormalised to sum to
one with `norm_topk_prob`, as Mixtral's top-2 and Qwen3-MoE do); each expert is a SwiGLU whose
stacked weights carry the logical axes (`expert`, `embed`, `mlp`), so the rules decide where
they live. `shared_experts` adds an always-on dense SwiGLU of `shared_experts` x the expert width
(Qwen2-MoE / DeepSeek), equal to that many shared experts summed.

Two compute paths, chosen by `capacity_factor`:
- 0 (dropless): the token-expert assignments are sorted by expert and the three matmuls run as
  grouped matmuls (`gmm.py`: `jax.lax.ragged_dot`, or Pallas megablox on TPU, as
  `grouped_matmul` picks): no token is dropped. With the experts split over devices
  (`mesh.expert` > 1) it runs expert-parallel in a shard_map (`dropless.py`): each
  assignment sent to its expert's device by a ragged all-to-all (`dispatch.py`,
  TPU and GPU) or the expert group's tokens all-gathered (CPU), as `dispatch` picks.
- > 0: every expert gets, per sequence (row of the batch, so drops do not depend on the mesh),
  a fixed buffer of ceil(capacity_factor x the row's assignments / experts) slots, filled in
  priority order (every token's first choice before any second choice, tokens in
  order); assignments past a full buffer are dropped (their weight contributes nothing) and
  counted. Static shapes, at the price of drops.

The router's auxiliary losses (Switch-style load balancing, ST-MoE z-loss) and per-call load
statistics are *sown* as an `nnx.Intermediate` (`ROUTER_STATS`): `scan_layers` stacks them over
the layers, and `router_loss` (called by the LM task) turns them into the loss term and the
step's `moe_*` metrics.
Shape suffixes: N tokens (B x T), K choices per token, X experts, M assignments (N x K),
C slots per expert, E embed, F expert hidden width.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.moe.dropless import dropless_experts, expert_parallel, swiglu
from jaxscale.models.nn.layers import MLP, param, weight
from jaxscale.precision import Policy
from jaxscale.rules import constrain

# The per-call router statistics, in the order of the sown vector (all float32 scalars):
# aux: Switch load-balancing loss E * sum_e f_e * P_e (f_e: share of the token-expert
#   assignments routed to e, P_e: mean router probability of e); 1.0 when perfectly balanced.
#   (Hugging Face Mixtral's `load_balancing_loss_func` is experts_per_token times this.)
# z: mean over tokens of logsumexp(router logits)^2 (ST-MoE), keeps the logits small.
# dropped: share of the assignments dropped by full expert buffers (0 when dropless).
# load_max / load_min: the busiest / idlest expert's assignments relative to a balanced load.
STATS = ("aux", "z", "dropped", "load_max", "load_min")
ROUTER_STATS = "router_stats"  # the name of the sown Intermediate
METRICS = {"aux": "moe_aux_loss", "z": "moe_z_loss", "dropped": "moe_dropped",
           "load_max": "moe_load_max", "load_min": "moe_load_min"}


GROUPED_MATMULS = ("auto", "ragged_dot", "megablox", "dense")
DISPATCHES = ("auto", "allgather", "ragged_all_to_all")


@dataclass(frozen=True)
class MoEConfig:
    """`config.model.moe`: num_experts 0 keeps the dense MLP."""

    num_experts: int = 0
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

    @classmethod
    def from_config(cls, moe_cfg: Mapping[str, Any] | None) -> "MoEConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(moe_cfg or {}).items() if k in names})


def check_moe(m: Mapping[str, Any], mesh: Mapping[str, Any] | None = None,
              repeats: int = 1) -> None:
    """`config.model.moe`'s checks (a ConfigError paragraph naming the field and the fix); with
    `config.mesh` (and `pipeline.repeats`), that the experts divide over its `expert` axis and
    every pipeline stage holds whole groups of `every` layers."""
    moe = MoEConfig.from_config(m.get("moe"))
    n, k = moe.num_experts, moe.experts_per_token

    def require(ok: bool, *sentences: str) -> None:
        if not ok:
            raise ConfigError(paragraph(*sentences))

    require(n >= 0, f"model.moe.num_experts={n} must be >= 0 (0: the dense MLP, no experts).")
    experts_axis = (mesh or {}).get("expert", 1) * (mesh or {}).get("dcn_expert", 1)
    require(n > 0 or experts_axis <= 1,
            f"mesh.expert x mesh.dcn_expert={experts_axis} but model.moe.num_experts=0: the",
            "expert axis shards MoE experts, and a dense model has none. Set mesh.expert=1 (and",
            "mesh.dcn_expert=1) and split the batch over mesh.data instead, or give the model",
            "experts (model.moe.num_experts).")
    if n == 0:
        return
    require(1 <= k <= n,
            f"model.moe.experts_per_token={k} must be between 1 and model.moe.num_experts={n}:",
            "each token is routed to that many distinct experts. Lower experts_per_token or add",
            "experts.")
    require(math.isfinite(moe.capacity_factor) and moe.capacity_factor >= 0,
            f"model.moe.capacity_factor={moe.capacity_factor} must be >= 0: 0 routes every token",
            "(dropless grouped matmul), a positive factor sizes each expert's buffer at that",
            "multiple of an even share of the tokens (1.25 is common); it must be a finite",
            "number (for no drops at all, use 0).")
    require(moe.mlp >= 0 and moe.shared_experts >= 0,
            f"model.moe.mlp={moe.mlp} and model.moe.shared_experts={moe.shared_experts} must be",
            ">= 0 (mlp 0: the expert width is model.mlp; shared_experts 0: none).")
    require(0 <= moe.router_aux_loss_coef < math.inf and 0 <= moe.router_z_loss_coef < math.inf,
            f"model.moe.router_aux_loss_coef={moe.router_aux_loss_coef} and",
            f"model.moe.router_z_loss_coef={moe.router_z_loss_coef} must be >= 0 (0: the loss is",
            "reported but not trained on; finite numbers).")
    require(moe.grouped_matmul in GROUPED_MATMULS,
            f"model.moe.grouped_matmul={moe.grouped_matmul!r} is not one of",
            f"{', '.join(GROUPED_MATMULS)}: auto picks the Pallas megablox kernel on TPU where",
            "the shapes fill its 128-wide tiles and jax.lax.ragged_dot otherwise, dense (every",
            "row times every expert) off TPU.")
    require(moe.dispatch in DISPATCHES,
            f"model.moe.dispatch={moe.dispatch!r} is not one of {', '.join(DISPATCHES)}: auto",
            "sends each token only to the devices holding its experts (ragged all-to-all) on",
            "TPU and GPU, and all-gathers the expert group's tokens on CPU, which has no ragged",
            "all-to-all.")
    layers = m.get("num_layers", moe.every)
    require(isinstance(moe.every, int) and moe.every >= 1 and layers % moe.every == 0,
            f"model.moe.every={moe.every!r} must be a positive divisor of",
            f"model.num_layers={layers}: the layers are scanned in groups of every-1 dense",
            "layers and one MoE layer. Use 1 (experts on every layer), a divisor of num_layers,",
            "or change num_layers.")
    if mesh is None:
        return
    require(experts_axis <= 1 or n % experts_axis == 0,
            f"model.moe.num_experts={n} is not divisible by the {experts_axis} devices of the",
            "mesh's expert axis (mesh.expert x mesh.dcn_expert): each device holds an equal",
            "share of the experts. Use a multiple of that many experts, or a smaller expert axis.")
    parts = mesh.get("pipeline", 1) * mesh.get("dcn_pipeline", 1) * max(repeats, 1)
    require(moe.every == 1 or layers % (parts * moe.every) == 0,
            f"model.moe.every={moe.every} with mesh.pipeline x mesh.dcn_pipeline x",
            f"pipeline.repeats={parts}: each pipeline stage (in each repeat) must hold whole",
            f"groups of {moe.every} layers (every-1 dense, one MoE), so",
            f"model.num_layers={layers} must be divisible by {parts * moe.every}. Change",
            "num_layers, the pipeline size, the repeats or model.moe.every.")


def expert_width(moe: MoEConfig, mlp: int) -> int:
    """Each expert's SwiGLU hidden width (`model.moe.mlp`, or the dense `model.mlp`)."""
    return moe.mlp or mlp


def num_params(moe: MoEConfig, embed: int, mlp: int) -> int:
    """Parameters of one MoE block: router, experts and shared experts."""
    f = expert_width(moe, mlp)
    return embed * moe.num_experts + moe.num_experts * 3 * embed * f \
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


class MoE(nnx.Module):
    """Router + experts (+ shared experts); `__call__` returns the block's output and sows
    the router's statistics (`ROUTER_STATS`). LoRA adapters on the experts are per expert
    (`adapters/lora.py`), folded into the weights (`nn.layers.weight`): they take no dropout."""

    LORA_WEIGHTS = ("w_gate", "w_up", "w_down")
    PROJECTED = False  # read whole (`nn.layers.weight`), not through `nn.layers.project`

    def __init__(self, embed: int, mlp: int, moe: MoEConfig, policy: Policy, rngs: nnx.Rngs,
                 *, stack: int | None = None):
        n, f = moe.num_experts, expert_width(moe, mlp)
        kw = dict(stack=stack, dtype=policy.param)
        self.router = param(rngs, (embed, n), ("embed", None), fan_in=embed, **kw)
        self.w_gate = param(rngs, (n, embed, f), ("expert", "embed", "mlp"), fan_in=embed, **kw)
        self.w_up = param(rngs, (n, embed, f), ("expert", "embed", "mlp"), fan_in=embed, **kw)
        self.w_down = param(rngs, (n, f, embed), ("expert", "mlp", "embed"), fan_in=f, **kw)
        if moe.shared_experts:
            self.shared = MLP(embed, f * moe.shared_experts, policy, rngs, stack=stack)
        self.moe, self.policy = moe, policy

    def _dropless(self, x_BTE: jax.Array, weights_BTK: jax.Array, experts_BTK: jax.Array,
                  w: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        """Expert-parallel when the rules split the experts over devices, else on the tokens
        as GSPMD shards them (`dropless.py`)."""
        dtype = self.policy.compute
        grouped = self.moe.grouped_matmul
        out_BTE = expert_parallel(x_BTE, weights_BTK, experts_BTK, w, dtype, grouped,
                                  self.moe.dispatch)
        if out_BTE is not None:
            return out_BTE
        B, T, E = x_BTE.shape
        return dropless_experts(x_BTE.reshape(B * T, E), weights_BTK.reshape(B * T, -1),
                                experts_BTK.reshape(B * T, -1), w, dtype, grouped
                                ).reshape(B, T, E)

    def __call__(self, x_BTE: jax.Array) -> jax.Array:
        # Routed per row: the (B, T) layout keeps the batch's sharding through top_k.
        weights_BTK, experts_BTK, stats = route(x_BTE, self.router[...], self.moe)
        w = tuple(weight(self, n) for n in self.LORA_WEIGHTS)  # LoRA deltas folded in
        if self.moe.capacity_factor > 0:
            out_BTE, dropped = capacity_experts(x_BTE, weights_BTK, experts_BTK, w,
                                                self.moe.capacity_factor, self.policy.compute)
            stats = stats.at[STATS.index("dropped")].set(dropped)
        else:
            out_BTE = self._dropless(x_BTE, weights_BTK, experts_BTK, w)
        self.router_stats = nnx.Intermediate(stats)  # stacked over layers by scan_layers
        if self.moe.shared_experts:
            out_BTE = out_BTE + self.shared(x_BTE)
        return constrain(out_BTE, "batch", "length", "embed")


def route(x_NE: jax.Array, router_EX: jax.Array, moe: MoEConfig
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(top-k weights (N, k) float32, expert ids (N, k), stats vector (len(STATS),)); N may be
    several leading dimensions (e.g. B, T), the statistics are over all of them.

    The router runs in float32 whatever the compute dtype: its softmax decides which matmuls
    run, and bf16 logits flip near-ties between experts."""
    n, k = moe.num_experts, moe.experts_per_token
    logits_NX = x_NE.astype(jnp.float32) @ router_EX.astype(jnp.float32)
    probs_NX = jax.nn.softmax(logits_NX, axis=-1)
    weights_NK, experts_NK = jax.lax.top_k(probs_NX, k)
    if moe.norm_topk_prob:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    leading = tuple(range(probs_NX.ndim - 1))
    counts_X = jnp.sum(jax.nn.one_hot(experts_NK, n, dtype=jnp.float32), axis=(*leading, -2))
    share_X = counts_X / experts_NK.size                 # f_e: share of the assignments
    prob_X = jnp.mean(probs_NX, axis=leading)            # P_e: carries the gradient
    aux = n * jnp.sum(share_X * prob_X)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_NX, axis=-1)))
    load_X = share_X * n
    stats = jnp.stack([aux, z, jnp.zeros(()), jnp.max(load_X), jnp.min(load_X)])
    return weights_NK, experts_NK, stats


# Logical axes of the capacity path's (rows, experts, slots, embed) buffers while the experts
# compute: rows over the batch axes other than `expert` (presets: `expert_batch`), experts over
# `expert`. Filled and emptied with rows over all the batch axes (`batch`), so the reshard
# between the two is an all-to-all over `expert`: tokens travel, expert weights never do.
BUFFER_AXES = ("expert_batch", "expert", None, None)
ROW_AXES = ("batch", None, None, None)


def capacity(capacity_factor: float, assignments: int, num_experts: int) -> int:
    """Slots per expert: capacity_factor x an even share of the assignments, rounded up."""
    return max(1, math.ceil(capacity_factor * assignments / num_experts))


def _slots(experts_TK: jax.Array, X: int, C: int) -> tuple[jax.Array, jax.Array]:
    """(expert, slot) of one row's assignments in priority order (every token's first choice
    before any second choice, tokens in order); slot C (out of range) where the buffer is full."""
    experts_M = experts_TK.T.reshape(-1)
    onehot_MX = jax.nn.one_hot(experts_M, X, dtype=jnp.int32)
    slot_M = jnp.sum(jnp.cumsum(onehot_MX, axis=0) * onehot_MX, axis=1) - 1
    return experts_M, jnp.minimum(slot_M, C)


def capacity_experts(x_BTE: jax.Array, weights_BTK: jax.Array, experts_BTK: jax.Array,
                     w: tuple[jax.Array, jax.Array, jax.Array], capacity_factor: float,
                     dtype: Any) -> tuple[jax.Array, jax.Array]:
    """(output (B, T, E), share of the assignments dropped): fixed per-expert buffers per row
    of the batch (B, X, C, E), C = capacity(capacity_factor, T x k, X), as MaxText.

    Per row, so that the drops do not depend on the mesh: each device fills the buffers of its
    own rows, and the all-to-all hands every expert its slots from all rows."""
    w_gate_XEF, w_up_XEF, w_down_XFE = (a.astype(dtype) for a in w)
    X, (B, T, k) = w_gate_XEF.shape[0], experts_BTK.shape
    C = capacity(capacity_factor, T * k, X)
    experts_BM, slot_BM = jax.vmap(_slots, in_axes=(0, None, None))(experts_BTK, X, C)
    tokens_M = jnp.tile(jnp.arange(T), k)
    fill = jax.vmap(lambda x_TE, e_M, s_M: jnp.zeros((X, C, x_TE.shape[1]), dtype)
                    .at[e_M, s_M].set(x_TE[tokens_M], mode="drop"))
    buf_BXCE = constrain(fill(x_BTE.astype(dtype), experts_BM, slot_BM), *ROW_AXES)
    buf_BXCE = constrain(buf_BXCE, *BUFFER_AXES)  # all-to-all: rows' slots to their experts
    h_BXCF = swiglu(*(checkpoint_name(jnp.einsum("bxce,xef->bxcf", buf_BXCE, w_XEF),
                                      "mlp_gate_up")  # as the dense MLP's, for remat policies
                      for w_XEF in (w_gate_XEF, w_up_XEF)))
    out_BXCE = constrain(jnp.einsum("bxcf,xfe->bxce", h_BXCF, w_down_XFE), *BUFFER_AXES)
    out_BXCE = constrain(out_BXCE, *ROW_AXES)  # all-to-all back to the rows' devices
    kept_BM = slot_BM < C
    weight_BM = (jnp.swapaxes(weights_BTK, 1, 2).reshape(B, -1) * kept_BM).astype(dtype)
    combine = jax.vmap(lambda o_XCE, e_M, s_M, w_M: jnp.zeros((T, o_XCE.shape[2]), dtype).at[
        tokens_M].add(o_XCE.at[e_M, s_M].get(mode="fill", fill_value=0) * w_M[:, None]))
    out_BTE = combine(out_BXCE, experts_BM, slot_BM, weight_BM)
    return out_BTE, jnp.mean((~kept_BM).astype(jnp.float32))


def _router_stats(sown: nnx.State) -> jax.Array | None:
    """The router statistics in `sown` (what a forward pass's layers sowed), (MoE layers,
    len(STATS)); None without MoE layers."""
    stats = [v.get_value() for path, v in nnx.to_flat_state(sown) if path[-1] == ROUTER_STATS]
    if not stats:
        return None
    return jnp.concatenate([s.reshape(-1, len(STATS)) for s in stats])


def router_objective(sown: nnx.State, moe: MoEConfig) -> jax.Array | float:
    """The router's loss term, aux_coef x aux + z_coef x z averaged over the MoE layers, of
    the statistics in `sown`; 0.0 without MoE layers. Linear in them: a schedule that runs the
    backward itself (1F1B) differentiates it from its constant gradient."""
    stats_LS = _router_stats(sown)
    if stats_LS is None:
        return 0.0
    named = dict(zip(STATS, jnp.mean(stats_LS, axis=0)))
    return moe.router_aux_loss_coef * named["aux"] + moe.router_z_loss_coef * named["z"]


def router_loss(model: nnx.Module, moe: MoEConfig) -> jax.Array | float:
    """The router's loss term of a forward pass (`router_objective`). Pops the sown
    statistics and records the step's metrics (`METRICS`) on `model` as Intermediates named by
    the metric (`task.step_metrics` pops them).
    0.0 for a model without MoE layers."""
    sown = nnx.pop(model, nnx.Intermediate)
    stats_LS = _router_stats(sown)
    if stats_LS is None:
        return 0.0
    named = dict(zip(STATS, jnp.mean(stats_LS, axis=0)))
    for stat, metric in METRICS.items():
        setattr(model, metric, nnx.Intermediate(jax.lax.stop_gradient(named[stat])))
    return router_objective(sown, moe)
