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
from jax.custom_batching import custom_vmap
from jax.sharding import PartitionSpec as P

from jaxscale.rules import AxisRules, active_rules, as_tuple

Weights = tuple[jax.Array, jax.Array, jax.Array]  # gate (X, E, F), up (X, E, F), down (X, F, E)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def _flatten(x_bME: jax.Array, w_bXEF: jax.Array, sizes_bX: jax.Array
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A batch of grouped matmuls as one: rows (b*M), groups (b*(X+1)); group X of each batch
    element is a zero-weight group holding its rows past its last group."""
    b, M = x_bME.shape[:2]
    trash_b = M - jnp.sum(sizes_bX, axis=1)
    sizes = jnp.concatenate([sizes_bX, trash_b[:, None]], axis=1).reshape(-1)
    w = jnp.concatenate([w_bXEF, jnp.zeros_like(w_bXEF[:, :1])], axis=1)
    return x_bME.reshape(b * M, -1), w.reshape((-1,) + w.shape[2:]), sizes.astype(sizes_bX.dtype)


def _batched(args: tuple, batched: Any, n: int) -> list[jax.Array]:
    return [a if bt else jnp.broadcast_to(a, (n,) + a.shape) for a, bt in zip(args, batched)]


@custom_vmap
def _gmm(x_ME: jax.Array, w_XEF: jax.Array, sizes_X: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x_ME, w_XEF, sizes_X)


@_gmm.def_vmap
def _gmm_batched(n, batched, x, w, sizes):
    x, w, sizes = _batched((x, w, sizes), batched, n)
    out = _gmm(*_flatten(x, w, sizes))
    return out.reshape(x.shape[:2] + out.shape[1:]), True


@custom_vmap
def _gmm_vjp(x_ME: jax.Array, w_XEF: jax.Array, sizes_X: jax.Array, g_MF: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    _, pull = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes_X), x_ME, w_XEF)
    return tuple(pull(g_MF))


@_gmm_vjp.def_vmap
def _gmm_vjp_batched(n, batched, x, w, sizes, g):
    x, w, sizes, g = _batched((x, w, sizes, g), batched, n)
    X = w.shape[1]
    fx, fw, fs = _flatten(x, w, sizes)
    dx, dw = _gmm_vjp(fx, fw, fs, g.reshape((-1,) + g.shape[2:]))
    dw = dw.reshape((n, X + 1) + dw.shape[1:])[:, :X]
    return (dx.reshape(x.shape), dw), (True, True)


@jax.custom_vjp
def ragged_dot(x_ME: jax.Array, w_XEF: jax.Array, sizes_X: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot` that vmaps on TPU: there its lowering takes no batch dimensions
    ("group_sizes with rank > 1 are not yet supported"), so under vmap (pipeline stages,
    per-replica accumulation) the batch is folded into the groups (`_flatten`) and the
    backward pass is batched the same way (custom_vmap has no autodiff of its own, hence
    this custom_vjp)."""
    return _gmm(x_ME, w_XEF, sizes_X)


def _ragged_dot_fwd(x_ME, w_XEF, sizes_X):
    return _gmm(x_ME, w_XEF, sizes_X), (x_ME, w_XEF, sizes_X)


def _ragged_dot_bwd(res, g_MF):
    dx, dw = _gmm_vjp(*res, g_MF)
    return dx, dw, None


ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


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

    `native`: `ragged_dot` (jax's, batched by folding the batch into the groups). Otherwise the
    dense form: every row times every expert, the row's own group selected. Off TPU jax lowers
    ragged_dot to that same dense form (the same FLOPs), but that lowering fails under two
    nested vmaps (pipeline stages inside per-replica accumulation); the dense form has no such
    limit. Both are exact: the selection multiplies by one and adds zeros."""
    if native:
        return ragged_dot(x_ME, w_XEF, sizes_X)
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
    w_gate_XEF, w_up_XEF, w_down_XFE = (a.astype(dtype) for a in w)
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
