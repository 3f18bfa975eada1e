"""The dropless MoE compute (`model.moe.capacity_factor=0`): grouped matmuls on one device, and
expert parallelism over the mesh axes that the rules give the `expert` dimension.

`dropless_experts` sorts the token-expert assignments by expert and runs the three SwiGLU
matmuls as grouped matmuls (`gmm.py`: megablox or `jax.lax.ragged_dot` on TPU, no
token dropped, no FLOP on padding; elsewhere their dense form).

`expert_parallel` runs it with the experts split over devices (`mesh.expert` > 1 under the
presets), inside a `jax.shard_map` whose specs come from the active rules (as in
`attention/splash.py` and `attention/sequence/context.py`): tokens as the rules shard `batch`
and `length`, expert weights as they shard (`expert`, `embed`, `mlp`), with `embed` gathered (FSDP's
per-layer gather) and `mlp` kept split (tensor parallelism: a partial down projection, summed).
Each device:
1. all-gathers the tokens (and their router choices) of its expert group, the devices that
   share its other coordinates and hold the other experts;
2. runs its local experts on the assignments routed to them (the others sorted past the last
   group, where `ragged_dot` writes zeros), weighted by the router;
3. reduce-scatters the partial outputs back over the group: every token gets the sum of its
   experts' contributions on its own device.

Two dispatches (`model.moe.dispatch`). The all-gather above moves expert-axis x N tokens, runs
on every backend, is exact (the same grouped matmuls, only the summation order of a token's k
contributions differs), and costs (expert-axis / k) x the traffic of an exact all-to-all of
the assignments. That all-to-all's sizes depend on the routing: `jax.lax.ragged_all_to_all`
carries them on TPU and GPU (`dispatch.py`, the default there) but has no CPU
lowering, and a fixed-size `all_to_all` would reserve the worst case.
Shape suffixes: N tokens, K choices per token, X experts (x local), M assignments, E embed,
F expert hidden width.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxscale.models.moe.dispatch import ragged_dispatch, resolve_dispatch
from jaxscale.models.moe.gmm import (
    PLAIN,
    Biases,
    SwiGLU,
    Weights,
    expert_mlp,
    resolve_kernel,
    swiglu,
)
from jaxscale.rules import active_rules, as_tuple

__all__ = ["dropless_experts", "expert_parallel", "swiglu"]


def dropless_experts(x_NE: jax.Array, weights_NK: jax.Array, experts_NK: jax.Array,
                     w: Weights, dtype: Any, grouped: str = "auto", act: SwiGLU = PLAIN,
                     bias: Biases = None) -> jax.Array:
    """Every assignment computed: sorted by expert, grouped matmuls (`expert_mlp`, with `act`
    and the gate / up `bias`), unsorted and summed per token with its router weight. An expert
    id equal to the number of experts (X) marks an assignment that is not computed here (its
    output is zero). `grouped`: `model.moe.grouped_matmul` (`resolve_kernel`)."""
    w = tuple(a.astype(dtype) for a in w)
    N, k = experts_NK.shape
    X, E, F = w[0].shape
    kernel = resolve_kernel(grouped, E, F, dtype)
    flat_M = experts_NK.reshape(-1)                      # M = N * k assignments
    order_M = jnp.argsort(flat_M, stable=True)
    x_ME = x_NE.astype(dtype)[order_M // k]
    sizes_X = jnp.bincount(flat_M, length=X + 1)[:X].astype(jnp.int32)
    out_ME = expert_mlp(x_ME, sizes_X, w, kernel, act, bias)
    out_NKE = jnp.zeros_like(out_ME).at[order_M].set(out_ME).reshape(N, k, -1)
    return jnp.einsum("nke,nk->ne", out_NKE, weights_NK.astype(dtype))


def expert_parallel(x_BTE: jax.Array, weights_BTK: jax.Array, experts_BTK: jax.Array,
                    w: Weights, dtype: Any, grouped: str = "auto", dispatch: str = "auto",
                    act: SwiGLU = PLAIN, bias: Biases = None) -> jax.Array | None:
    """The dropless output (B, T, E) with the experts split over devices as the active rules
    say, or None when they are not split (no rules active, or the expert dimension's mesh axes
    all of size 1): then `dropless_experts` runs under GSPMD as is. `grouped`, `dispatch`:
    `model.moe.grouped_matmul` and `model.moe.dispatch` (`dispatch.py`)."""
    active = active_rules()
    if active is None:
        return None
    rules, mesh = active
    spec = lambda logical, x: tuple(rules.activation_spec(logical, x.shape, mesh, "<moe>"))
    expert, _, mlp = spec(("expert", "embed", "mlp"), w[0])
    expert_axes = as_tuple(expert)
    if math.prod(mesh.shape[a] for a in expert_axes) == 1:
        return None
    batch, length, _ = spec(("batch", "length", "embed"), x_BTE)
    token_axes = as_tuple(batch) + as_tuple(length)
    # A hidden dimension split over an axis that also splits the tokens cannot be summed over
    # it (different devices hold different tokens there): gather it instead.
    mlp = tuple(a for a in as_tuple(mlp) if a not in token_axes) or None
    group = tuple(a for a in expert_axes if a in token_axes)      # tokens gathered over these
    replicated = tuple(a for a in expert_axes if a not in token_axes) + as_tuple(mlp)
    x_spec, k_spec = P(batch, length, None), P(batch, length, None)
    w_specs = (P(expert, None, mlp), P(expert, None, mlp), P(expert, mlp, None))
    bias = () if bias is None else tuple(bias)  # gate / up biases split as their weights' outputs
    b_specs = (P(expert, mlp),) * len(bias)
    ragged = resolve_dispatch(dispatch, mesh.devices.flat[0].platform, group,
                              expert_axes) == "ragged_all_to_all"
    devices = math.prod(mesh.shape[a] for a in expert_axes)

    def body(x_bte, weights_btk, experts_btk, w_gate, w_up, w_down, *b_local):
        b, t, E = x_bte.shape
        x_nE, weights_nK = x_bte.reshape(b * t, E), weights_btk.reshape(b * t, -1)
        experts_nK = experts_btk.reshape(b * t, -1)
        w, bias = (w_gate, w_up, w_down), (b_local or None)
        if ragged:  # each assignment to its expert's device and back; hidden shards summed
            out_nE = ragged_dispatch(x_nE, weights_nK, experts_nK, w, dtype, group, devices,
                                     grouped, act, bias)
            out_nE = jax.lax.psum(out_nE, as_tuple(mlp)) if mlp else out_nE
            return out_nE.reshape(b, t, E)
        if group:  # every token of the expert group, with its router choices
            x_nE, weights_nK, experts_nK = (jax.lax.all_gather(a, group, tiled=True)
                                            for a in (x_nE, weights_nK, experts_nK))
        x_local = w_gate.shape[0]
        local_nK = experts_nK - jax.lax.axis_index(expert_axes) * x_local
        mine_nK = (local_nK >= 0) & (local_nK < x_local)
        out_nE = dropless_experts(x_nE, weights_nK, jnp.where(mine_nK, local_nK, x_local),
                                  w, dtype, grouped, act, bias)
        if replicated:  # other experts' (or hidden shards') contributions to the same tokens
            out_nE = jax.lax.psum(out_nE, replicated)
        if group:  # each token's contributions summed back on its own device
            out_nE = jax.lax.psum_scatter(out_nE, group, tiled=True)
        return out_nE.reshape(b, t, E)

    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, k_spec, k_spec, *w_specs, *b_specs),
                         out_specs=x_spec, check_vma=False)(
        x_BTE.astype(dtype), weights_BTK, experts_BTK, *w, *bias)
