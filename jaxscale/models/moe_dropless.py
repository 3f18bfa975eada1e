"""The dropless MoE compute (`model.moe.capacity_factor=0`): grouped matmuls on one device, and
expert parallelism over the mesh axes that the rules give the `expert` dimension.

`dropless_experts` sorts the token-expert assignments by expert and runs the three SwiGLU
matmuls as grouped matmuls (`jax.lax.ragged_dot` on TPU: no token dropped, no FLOP on padding;
elsewhere its dense form, `grouped_matmul` says why).

`expert_parallel` runs it with the experts split over devices (`mesh.expert` > 1 under the
presets), inside a `jax.shard_map` whose specs come from the active rules (as in
`models/splash.py` and `models/context.py`): tokens as the rules shard `batch` and `length`,
expert weights as they shard (`expert`, `embed`, `mlp`), with `embed` gathered (FSDP's
per-layer gather) and `mlp` kept split (tensor parallelism: a partial down projection, summed).
Each device:
1. all-gathers the tokens (and their router choices) of its expert group, the devices that
   share its other coordinates and hold the other experts;
2. runs its local experts on the assignments routed to them (the others sorted past the last
   group, where `ragged_dot` writes zeros), weighted by the router;
3. reduce-scatters the partial outputs back over the group: every token gets the sum of its
   experts' contributions on its own device.

Why an all-gather and reduce-scatter rather than an all-to-all of the assignments: the exact
all-to-all sends each device only what its experts need (N x k tokens in all), but its sizes
depend on the routing. `jax.lax.ragged_all_to_all` carries such sizes on TPU and GPU but has no
CPU lowering, and a fixed-size `all_to_all` must reserve the worst case (every assignment to one
device: expert-axis x N x k slots per device, k times the all-gather). The all-gather moves
expert-axis x N tokens, runs on every backend, is exact (the same grouped matmuls, only the
summation order of a token's k contributions differs), and costs (expert-axis / k) x the
all-to-all's traffic: the same at expert=2 with top-2, more on wider expert axes, where the
ragged all-to-all is the next step.
Shape suffixes: N tokens, K choices per token, X experts (x local), M assignments, E embed,
F expert hidden width.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxscale.rules import AxisRules, active_rules

Weights = tuple[jax.Array, jax.Array, jax.Array]  # gate (X, E, F), up (X, E, F), down (X, F, E)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def native_grouped_matmul() -> bool:
    """Whether `grouped_matmul` runs `jax.lax.ragged_dot` (on TPU, where it lowers to a grouped
    matmul kernel) rather than its dense form (elsewhere)."""
    active = active_rules()
    platform = (active[1].devices.flat[0].platform if active is not None
                else jax.default_backend())
    return platform == "tpu"


def grouped_matmul(x_ME: jax.Array, w_XEF: jax.Array, sizes_X: jax.Array, native: bool
                   ) -> jax.Array:
    """Rows of `x_ME` in consecutive groups of `sizes_X` rows, group g times `w_XEF[g]`; rows
    past the last group come out zero.

    `native`: `jax.lax.ragged_dot`. Otherwise the dense form: every row times every expert,
    the row's own group selected. Off TPU jax lowers ragged_dot to that same dense form (the
    same FLOPs), but its lowering fails under two nested vmaps (pipeline stages inside
    per-replica accumulation), and its batching rule wants the weights batched too; the dense
    form has neither limit. Both are exact: the selection multiplies by one and adds zeros."""
    if native:
        return jax.lax.ragged_dot(x_ME, w_XEF, sizes_X)
    ends_X = jnp.cumsum(sizes_X)
    group_M = jnp.searchsorted(ends_X, jnp.arange(x_ME.shape[0]), side="right")
    onehot_MX = jax.nn.one_hot(group_M, w_XEF.shape[0], dtype=x_ME.dtype)  # past the end: 0
    return jnp.einsum("mx,mxf->mf", onehot_MX, jnp.einsum("me,xef->mxf", x_ME, w_XEF))


def dropless_experts(x_NE: jax.Array, weights_NK: jax.Array, experts_NK: jax.Array,
                     w: Weights, dtype: Any, native: bool | None = None) -> jax.Array:
    """Every assignment computed: sorted by expert, grouped matmuls (`grouped_matmul`),
    unsorted and summed per token with its router weight. An expert id equal to the number of
    experts (X) marks an assignment that is not computed here (its output is zero).
    `native` (default: on TPU) picks `grouped_matmul`'s ragged_dot."""
    native = native_grouped_matmul() if native is None else native
    # Under jax.vmap (per-replica gradient accumulation, pipeline stages) the tokens are
    # batched and the weights may not be, and ragged_dot batches only when both are: a zero
    # that depends on the tokens makes the weights follow their batch (outside vmap, one add
    # fused into the cast).
    tie = jnp.zeros((), dtype) * x_NE[0, 0].astype(dtype) if native else 0
    w_gate_XEF, w_up_XEF, w_down_XFE = (a.astype(dtype) + tie for a in w)
    N, k = experts_NK.shape
    X = w_gate_XEF.shape[0]
    flat_M = experts_NK.reshape(-1)                      # M = N * k assignments
    order_M = jnp.argsort(flat_M, stable=True)
    x_ME = x_NE.astype(dtype)[order_M // k]
    sizes_X = jnp.bincount(flat_M, length=X + 1)[:X].astype(jnp.int32)
    matmul = lambda a, b: grouped_matmul(a, b, sizes_X, native)
    # Named as the dense MLP's gate/up (`models/scan.py` ACTIVATION_NAMES): the same remat
    # policies keep them.
    h_MF = swiglu(*(checkpoint_name(matmul(x_ME, w_XEF), "mlp_gate_up")
                    for w_XEF in (w_gate_XEF, w_up_XEF)))
    out_ME = matmul(h_MF, w_down_XFE)
    out_NKE = jnp.zeros_like(out_ME).at[order_M].set(out_ME).reshape(N, k, -1)
    return jnp.einsum("nke,nk->ne", out_NKE, weights_NK.astype(dtype))


def _axes(spec_dim: Any) -> tuple[str, ...]:
    return () if spec_dim is None else (spec_dim,) if isinstance(spec_dim, str) else tuple(spec_dim)


def expert_parallel(x_BTE: jax.Array, weights_BTK: jax.Array, experts_BTK: jax.Array,
                    w: Weights, dtype: Any) -> jax.Array | None:
    """The dropless output (B, T, E) with the experts split over devices as the active rules
    say, or None when they are not split (no rules active, or the expert dimension's mesh axes
    all of size 1): then `dropless_experts` runs under GSPMD as is."""
    active = active_rules()
    if active is None:
        return None
    rules, mesh = active
    lenient = AxisRules(rules.rules, strict=False, indivisible="replicate")
    spec = lambda logical, x: tuple(lenient.spec(logical, x.shape, mesh, "<moe>", warn=False))
    expert, _, mlp = spec(("expert", "embed", "mlp"), w[0])
    expert_axes = _axes(expert)
    if math.prod(mesh.shape[a] for a in expert_axes) == 1:
        return None
    batch, length, _ = spec(("batch", "length", "embed"), x_BTE)
    token_axes = _axes(batch) + _axes(length)
    # A hidden dimension split over an axis that also splits the tokens cannot be summed over
    # it (different devices hold different tokens there): gather it instead.
    mlp = tuple(a for a in _axes(mlp) if a not in token_axes) or None
    group = tuple(a for a in expert_axes if a in token_axes)      # tokens gathered over these
    replicated = tuple(a for a in expert_axes if a not in token_axes) + _axes(mlp)
    x_spec, k_spec = P(batch, length, None), P(batch, length, None)
    w_specs = (P(expert, None, mlp), P(expert, None, mlp), P(expert, mlp, None))

    def body(x_bte, weights_btk, experts_btk, w_gate, w_up, w_down):
        b, t, E = x_bte.shape
        x_nE, weights_nK = x_bte.reshape(b * t, E), weights_btk.reshape(b * t, -1)
        experts_nK = experts_btk.reshape(b * t, -1)
        if group:  # every token of the expert group, with its router choices
            x_nE, weights_nK, experts_nK = (jax.lax.all_gather(a, group, tiled=True)
                                            for a in (x_nE, weights_nK, experts_nK))
        x_local = w_gate.shape[0]
        local_nK = experts_nK - jax.lax.axis_index(expert_axes) * x_local
        mine_nK = (local_nK >= 0) & (local_nK < x_local)
        out_nE = dropless_experts(x_nE, weights_nK, jnp.where(mine_nK, local_nK, x_local),
                                  (w_gate, w_up, w_down), dtype)
        if replicated:  # other experts' (or hidden shards') contributions to the same tokens
            out_nE = jax.lax.psum(out_nE, replicated)
        if group:  # each token's contributions summed back on its own device
            out_nE = jax.lax.psum_scatter(out_nE, group, tiled=True)
        return out_nE.reshape(b, t, E)

    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, k_spec, k_spec, *w_specs),
                         out_specs=x_spec, check_vma=False)(
        x_BTE.astype(dtype), weights_BTK, experts_BTK, *w)
