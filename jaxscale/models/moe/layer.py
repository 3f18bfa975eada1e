"""A mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE, DeepSeek-style shared experts).

`MoE` replaces the decoder's dense SwiGLU (`layers.MLP`) when `model.moe.num_experts > 0`. The
configured router (`routers.py`, `model.moe.router`) picks `experts_per_token` experts per token
and their combine weights; each expert is a SwiGLU whose
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

The router's auxiliary losses and per-call load statistics are sown by the block
(`routers.ROUTER_STATS`) and become the loss term and `moe_*` metrics in `routers.router_loss`.
Shape suffixes: N tokens (B x T), K choices per token, X experts, M assignments (N x K),
C slots per expert, E embed, F expert hidden width.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.moe.config import DISPATCHES, GROUPED_MATMULS, MoEConfig, expert_width
from jaxscale.models.moe.dropless import dropless_experts, expert_parallel
from jaxscale.models.moe.gmm import PLAIN, SwiGLU
from jaxscale.models.moe.routers import ROUTERS, STATS, route
from jaxscale.models.nn.layers import MLP, param, weight
from jaxscale.precision import Policy
from jaxscale.rules import constrain


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
    require(moe.router in ROUTERS,
            f"model.moe.router={moe.router!r} is not one of {', '.join(ROUTERS)}: the router",
            "decides how tokens pick experts (models/moe/routers.py). Pick one of those, or add",
            "a line to ROUTERS for a new one.")
    require(1 <= k <= n,
            f"model.moe.experts_per_token={k} must be between 1 and model.moe.num_experts={n}:",
            "each token is routed to that many distinct experts. Lower experts_per_token or add",
            "experts.")
    require(moe.capacity_factor >= 0,
            f"model.moe.capacity_factor={moe.capacity_factor} must be >= 0: 0 routes every token",
            "(dropless grouped matmul), a positive factor sizes each expert's buffer at that",
            "multiple of an even share of the tokens (1.25 is common).")
    require(moe.mlp >= 0 and moe.shared_experts >= 0,
            f"model.moe.mlp={moe.mlp} and model.moe.shared_experts={moe.shared_experts} must be",
            ">= 0 (mlp 0: the expert width is model.mlp; shared_experts 0: none).")
    require(moe.swiglu_limit >= 0 and moe.swiglu_alpha > 0,
            f"model.moe.swiglu_limit={moe.swiglu_limit} must be >= 0 and",
            f"model.moe.swiglu_alpha={moe.swiglu_alpha} > 0: a positive limit clamps the",
            "experts' gate and up activations (GPT-OSS: 7.0, alpha 1.702); 0 keeps the plain",
            "SwiGLU.")
    require(moe.router_aux_loss_coef >= 0 and moe.router_z_loss_coef >= 0,
            f"model.moe.router_aux_loss_coef={moe.router_aux_loss_coef} and",
            f"model.moe.router_z_loss_coef={moe.router_z_loss_coef} must be >= 0 (0: the loss is",
            "reported but not trained on).")
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
        self.act = SwiGLU(moe.swiglu_limit, moe.swiglu_alpha)
        zeros = dict(init="zeros", **kw)
        if moe.router_bias:  # GPT-OSS: on the router's logits
            self.router_bias = param(None, (n,), (None,), **zeros)
        if moe.expert_bias:  # GPT-OSS: on each expert's gate, up and down projections
            self.b_gate = param(None, (n, f), ("expert", "mlp"), **zeros)
            self.b_up = param(None, (n, f), ("expert", "mlp"), **zeros)
            self.b_down = param(None, (n, embed), ("expert", "embed"), **zeros)

    def _biases(self) -> tuple[jax.Array, ...] | None:
        """(gate, up, down) expert biases, or None without them."""
        if not self.moe.expert_bias:
            return None
        return tuple(getattr(self, n)[...] for n in ("b_gate", "b_up", "b_down"))

    def _dropless(self, x_BTE: jax.Array, weights_BTK: jax.Array, experts_BTK: jax.Array,
                  w: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        """Expert-parallel when the rules split the experts over devices, else on the tokens
        as GSPMD shards them (`dropless.py`). The down projection's bias is added here, once
        per assignment weighted by the router (the expert-parallel sums would add it once per
        hidden shard)."""
        dtype = self.policy.compute
        grouped = self.moe.grouped_matmul
        biases = self._biases()
        gate_up = None if biases is None else biases[:2]
        out_BTE = expert_parallel(x_BTE, weights_BTK, experts_BTK, w, dtype, grouped,
                                  self.moe.dispatch, self.act, gate_up)
        if out_BTE is None:
            B, T, E = x_BTE.shape
            out_BTE = dropless_experts(
                x_BTE.reshape(B * T, E), weights_BTK.reshape(B * T, -1),
                experts_BTK.reshape(B * T, -1), w, dtype, grouped, self.act, gate_up
            ).reshape(B, T, E)
        if biases is None:
            return out_BTE
        combine_BTX = jnp.einsum("btk,btkx->btx", weights_BTK.astype(dtype), jax.nn.one_hot(
            experts_BTK, self.moe.num_experts, dtype=dtype))
        return out_BTE + jnp.einsum("btx,xe->bte", combine_BTX, biases[2].astype(dtype))

    def __call__(self, x_BTE: jax.Array) -> jax.Array:
        # Routed per row: the (B, T) layout keeps the batch's sharding through top_k.
        bias = self.router_bias[...] if self.moe.router_bias else None
        weights_BTK, experts_BTK, stats = route(x_BTE, self.router[...], self.moe, bias)
        w = tuple(weight(self, n) for n in self.LORA_WEIGHTS)  # LoRA deltas folded in
        if self.moe.capacity_factor > 0:
            out_BTE, dropped = capacity_experts(x_BTE, weights_BTK, experts_BTK, w,
                                                self.moe.capacity_factor, self.policy.compute,
                                                self.act, self._biases())
            stats = stats.at[STATS.index("dropped")].set(dropped)
        else:
            out_BTE = self._dropless(x_BTE, weights_BTK, experts_BTK, w)
        self.router_stats = nnx.Intermediate(stats)  # stacked over layers by scan_layers
        if self.moe.shared_experts:
            out_BTE = out_BTE + self.shared(x_BTE)
        return constrain(out_BTE, "batch", "length", "embed")


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
                     dtype: Any, act: SwiGLU = PLAIN, biases: tuple | None = None
                     ) -> tuple[jax.Array, jax.Array]:
    """(output (B, T, E), share of the assignments dropped): fixed per-expert buffers per row
    of the batch (B, X, C, E), C = capacity(capacity_factor, T x k, X), as MaxText. `act`:
    the experts' activation; `biases`: their (gate, up, down) biases (GPT-OSS), per slot, so a
    dropped assignment gets none.

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
    b_gate, b_up, b_down = ((None,) * 3 if biases is None
                            else (b.astype(dtype)[None, :, None] for b in biases))
    gate_up = [jnp.einsum("bxce,xef->bxcf", buf_BXCE, w_XEF) for w_XEF in (w_gate_XEF, w_up_XEF)]
    if biases is not None:
        gate_up = [h + b for h, b in zip(gate_up, (b_gate, b_up))]
    # named as the dense MLP's, for remat policies
    h_BXCF = act(*(checkpoint_name(h, "mlp_gate_up") for h in gate_up))
    out_BXCE = jnp.einsum("bxcf,xfe->bxce", h_BXCF, w_down_XFE)
    out_BXCE = constrain(out_BXCE if biases is None else out_BXCE + b_down, *BUFFER_AXES)
    out_BXCE = constrain(out_BXCE, *ROW_AXES)  # all-to-all back to the rows' devices
    kept_BM = slot_BM < C
    weight_BM = (jnp.swapaxes(weights_BTK, 1, 2).reshape(B, -1) * kept_BM).astype(dtype)
    combine = jax.vmap(lambda o_XCE, e_M, s_M, w_M: jnp.zeros((T, o_XCE.shape[2]), dtype).at[
        tokens_M].add(o_XCE.at[e_M, s_M].get(mode="fill", fill_value=0) * w_M[:, None]))
    out_BTE = combine(out_BXCE, experts_BM, slot_BM, weight_BM)
    return out_BTE, jnp.mean((~kept_BM).astype(jnp.float32))
