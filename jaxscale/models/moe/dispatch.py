"""The dropless MoE's ragged all-to-all dispatch (`model.moe.dispatch=ragged_all_to_all`): each
token-expert assignment travels only to the device holding its expert, and its output back.

`moe/dropless.expert_parallel`'s all-gather moves every token of the expert group to
every device of it (expert-axis x N tokens a device, of which only the assignments routed to
its experts are used); this sends each device's N x k assignments, sorted by expert, with
`jax.lax.ragged_all_to_all` (sizes known only at run time), runs the local experts' grouped
matmuls on what arrived, and sends the outputs back the same way (its transpose). Each device:

1. sorts its assignments by expert and counts them per expert; an all-gather of the counts
   (D x X int32s over the D devices of the expert axes) lets every device derive every
   offset (`plan`);
2. sends device j the rows of j's experts (consecutive: experts are numbered device by device)
   into a receive buffer, ordered by source device, then expert;
3. sorts the buffer by local expert (when a device holds several), runs `gmm.expert_mlp`
   (rows past the received ones are zero and, under megablox, cost nothing), unsorts;
4. sends each source its rows back to where they left, and combines them per token.

The receive buffer has a static shape: the worst case, D x N x min(k, local experts) rows (a
token picks distinct experts, so at most min(k, local) of its assignments reach one device).
XLA:CPU has no ragged-all-to-all: off TPU/GPU the all-gather path runs, and tests swap
`ragged_all_to_all` for `emulated_ragged_all_to_all`, the same semantics from an all-gather.
Shape suffixes: n tokens of a device, K choices, D devices of the expert axes, X experts,
L local experts, R receive-buffer rows, E embed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.moe.gmm import PLAIN, Biases, SwiGLU, Weights, expert_mlp, resolve_kernel


class Plan(NamedTuple):
    """A device's ragged all-to-all arguments (offsets and sizes, one per device, int32):
    `send` carries its sorted assignments to the experts' devices, `back` returns the outputs;
    `local_DL` counts the received rows per source device and local expert."""

    send: tuple[jax.Array, jax.Array, jax.Array, jax.Array]
    back: tuple[jax.Array, jax.Array, jax.Array, jax.Array]
    local_DL: jax.Array


def _exclusive(x: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def plan(counts_DX: jax.Array, me: jax.Array | int, local: int) -> Plan:
    """Device `me`'s offsets and sizes from every device's assignment counts per expert
    (`counts_DX[d, e]`: device d's assignments to expert e; device j holds experts
    j*local .. (j+1)*local - 1). Pure: the bookkeeping, testable without devices.

    rows_DD[d, j] (d's rows for j) give: sent = rows[me], received = rows[:, me]; device j
    writes its chunk for me after the chunks of devices before it; me's chunk for j lands after
    those of devices before me."""
    D = counts_DX.shape[0]
    counts_DX = counts_DX.astype(jnp.int32)
    rows_DD = counts_DX.reshape(D, D, local).sum(-1)
    sent_D, received_D = rows_DD[me], rows_DD[:, me]
    left_DD = _exclusive(rows_DD, axis=1)    # [d, j]: where d's rows for j start in d's sort
    landed_DD = _exclusive(rows_DD, axis=0)  # [d, j]: where d's rows land in j's buffer
    send = (left_DD[me], sent_D, landed_DD[me], received_D)
    back = (landed_DD[:, me], received_D, left_DD[:, me], sent_D)
    local_DL = jax.lax.dynamic_slice_in_dim(counts_DX, me * local, local, axis=1)
    return Plan(send, back, local_DL)


def buffer_rows(n: int, k: int, devices: int, local: int) -> int:
    """The receive buffer's static rows: every device's tokens could pick this device's experts,
    each at most min(k, local) times."""
    return devices * n * min(k, local)


def emulated_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                               send_sizes: jax.Array, output_offsets: jax.Array,
                               recv_sizes: jax.Array, *, axis_name: Any) -> jax.Array:
    """`jax.lax.ragged_all_to_all`'s semantics from an all-gather, for backends without it
    (tests on CPU): every source's operand and offsets gathered, each output row taken from the
    source chunk that covers it (the rest of `output` kept). Differentiable through the
    gathers."""
    del recv_sizes  # implied by the sources' send sizes
    me = jax.lax.axis_index(axis_name)
    ops, starts, sizes, lands = (jax.lax.all_gather(a, axis_name) for a in
                                 (operand, input_offsets, send_sizes, output_offsets))
    start_D, size_D, land_D = starts[:, me], sizes[:, me], lands[:, me]
    r_R = jnp.arange(output.shape[0])
    inside_DR = (r_R[None] >= land_D[:, None]) & (r_R[None] < (land_D + size_D)[:, None])
    src_R = jnp.argmax(inside_DR, axis=0)
    row_R = jnp.clip(start_D[src_R] + r_R - land_D[src_R], 0, operand.shape[0] - 1)
    hit_R = jnp.any(inside_DR, axis=0)
    return jnp.where(hit_R[:, None], ops[src_R, row_R], output)


ragged_all_to_all = jax.lax.ragged_all_to_all  # tests on CPU put the emulation here


def _local_order(local_DL: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """The buffer (chunks by source device, each sorted by local expert) sorted by local expert:
    the permutation, and the rows per local expert (rows past the received ones last)."""
    D, L = local_DL.shape
    ends = jnp.cumsum(local_DL.reshape(-1))
    slot_R = jnp.searchsorted(ends, jnp.arange(rows), side="right")  # past the end: D * L
    expert_R = jnp.where(slot_R < D * L, slot_R % L, L)
    return jnp.argsort(expert_R, stable=True), jnp.sum(local_DL, axis=0).astype(jnp.int32)


def ragged_dispatch(x_nE: jax.Array, weights_nK: jax.Array, experts_nK: jax.Array, w: Weights,
                    dtype: Any, axes: tuple[str, ...], devices: int, grouped: str = "auto",
                    act: SwiGLU = PLAIN, bias: Biases = None) -> jax.Array:
    """The experts' combined output (n, E) for this device's tokens, inside a shard_map whose
    `axes` (`devices` in all) split the experts (`w`: this device's L experts) and the
    tokens."""
    w = tuple(a.astype(dtype) for a in w)
    L, E, F = w[0].shape
    n, k = experts_nK.shape
    kernel = resolve_kernel(grouped, E, F, dtype)
    flat_M = experts_nK.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)
    x_ME = x_nE.astype(dtype)[order_M // k]
    counts_DX = jax.lax.all_gather(jnp.bincount(flat_M, length=devices * L), axes)
    p = plan(counts_DX, jax.lax.axis_index(axes), L)
    rows = buffer_rows(n, k, devices, L)
    got_RE = ragged_all_to_all(x_ME, jnp.zeros((rows, E), dtype), *p.send, axis_name=axes)
    perm_R, sizes_L = _local_order(p.local_DL, rows)
    out_RE = expert_mlp(got_RE[perm_R], sizes_L, w, kernel, act, bias)
    out_RE = jnp.zeros_like(out_RE).at[perm_R].set(out_RE)
    back_ME = ragged_all_to_all(out_RE, jnp.zeros_like(x_ME), *p.back, axis_name=axes)
    out_NKE = jnp.zeros_like(back_ME).at[order_M].set(back_ME).reshape(n, k, E)
    return jnp.einsum("nke,nk->ne", out_NKE, weights_nK.astype(dtype))


def resolve_dispatch(choice: str, platform: str, group: tuple[str, ...],
                     expert_axes: tuple[str, ...]) -> str:
    """`model.moe.dispatch` here: auto is ragged_all_to_all on TPU and GPU where the expert axes
    all split the tokens (else there is nothing to send: the all-gather path, which then
    gathers nothing), allgather elsewhere. An explicit ragged_all_to_all that cannot run is a
    ConfigError."""
    native = platform in ("tpu", "gpu") or ragged_all_to_all is not jax.lax.ragged_all_to_all
    possible = bool(group) and group == expert_axes
    if choice == "auto":
        return "ragged_all_to_all" if native and possible else "allgather"
    if choice == "ragged_all_to_all" and not (native and possible):
        why = (f"XLA on {platform} has no ragged-all-to-all" if not native else
               f"the expert axes {expert_axes} do not all split the tokens (the rules shard "
               "batch/length over them), so no token has another device to travel to")
        raise ConfigError(paragraph(
            f"model.moe.dispatch='ragged_all_to_all' cannot run here: {why}. Use",
            "model.moe.dispatch=auto (ragged all-to-all on TPU and GPU where it applies) or",
            "allgather (every backend: the expert group's tokens gathered, outputs",
            "reduce-scattered)."))
    return choice
