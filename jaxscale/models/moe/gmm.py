"""Grouped matmuls for the dropless MoE (`dropless.py`): rows sorted by expert, each
group of rows times its expert's weights, rows past the last group zero.

Three kernels (`model.moe.grouped_matmul`, resolved by `resolve_kernel`):
- `ragged_dot`: `jax.lax.ragged_dot`, which lowers to a grouped matmul on TPU;
- `megablox`: the Pallas TPU kernel `jax.experimental.pallas.ops.tpu.megablox.gmm` (its backward
  `gmm` + `tgmm`), which visits only the row tiles that hold assignments, so rows past the last
  group cost no FLOPs (interpreted off TPU: for tests);
- `dense`: every row times every expert, the row's group selected (off TPU).
The first two take no batch dimensions on TPU: `_folding` folds a vmapped batch into the groups.
Shape suffixes: M rows (assignments), X experts, E embed, F expert hidden width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap

from jaxscale.errors import ConfigError, paragraph
from jaxscale.rules import active_rules

Weights = tuple[jax.Array, jax.Array, jax.Array]  # gate (X, E, F), up (X, E, F), down (X, F, E)
Biases = tuple[jax.Array, jax.Array] | None  # gate (X, F), up (X, F) (GPT-OSS); None: none


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


@dataclass(frozen=True)
class SwiGLU:
    """The experts' gated activation. `limit` 0: the plain SwiGLU, silu(gate) * up. `limit` > 0
    (GPT-OSS's `swiglu_limit`): gate clamped from above and up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1): the clamp keeps a few huge activations from
    dominating in low precision, and up + 1 lets an expert pass its gate through when up is 0.
    Static (hashable): it is part of what is traced, not a traced value."""

    limit: float = 0.0
    alpha: float = 1.702

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if not self.limit:
            return swiglu(gate, up)
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return gate * jax.nn.sigmoid(self.alpha * gate) * (up + 1)


PLAIN = SwiGLU()  # the default activation: silu(gate) * up


def row_bias(bias_XF: jax.Array, sizes_X: jax.Array, rows: int) -> jax.Array:
    """Each of `rows` rows sorted by expert (`sizes_X` each) gets its expert's bias; rows past
    the last group get zero (they stay zero through the activation)."""
    group_M = jnp.searchsorted(jnp.cumsum(sizes_X), jnp.arange(rows), side="right")
    padded = jnp.concatenate([bias_XF, jnp.zeros_like(bias_XF[:1])])
    return padded[group_M]


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


def _folding(kernel: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]) -> Callable:
    """`kernel` (a grouped matmul taking no batch dimensions, rows past the last group zero) as
    a function that vmaps and differentiates: under vmap (pipeline stages, per-replica
    accumulation) the batch is folded into the groups (`_flatten`) and the backward pass is
    batched the same way. TPU's ragged_dot lowering takes no batch dimensions ("group_sizes
    with rank > 1 are not yet supported") and megablox's Pallas call none either; custom_vmap
    has no autodiff of its own, hence the custom_vjp around it."""

    @custom_vmap
    def gmm(x_ME, w_XEF, sizes_X):
        return kernel(x_ME, w_XEF, sizes_X)

    @gmm.def_vmap
    def gmm_batched(n, batched, x, w, sizes):
        x, w, sizes = _batched((x, w, sizes), batched, n)
        out = gmm(*_flatten(x, w, sizes))
        return out.reshape(x.shape[:2] + out.shape[1:]), True

    @custom_vmap
    def gmm_vjp(x_ME, w_XEF, sizes_X, g_MF):
        _, pull = jax.vjp(lambda x, w: kernel(x, w, sizes_X), x_ME, w_XEF)
        return tuple(pull(g_MF))

    @gmm_vjp.def_vmap
    def gmm_vjp_batched(n, batched, x, w, sizes, g):
        x, w, sizes, g = _batched((x, w, sizes, g), batched, n)
        X = w.shape[1]
        fx, fw, fs = _flatten(x, w, sizes)
        dx, dw = gmm_vjp(fx, fw, fs, g.reshape((-1,) + g.shape[2:]))
        dw = dw.reshape((n, X + 1) + dw.shape[1:])[:, :X]
        return (dx.reshape(x.shape), dw), (True, True)

    @jax.custom_vjp
    def folded(x_ME, w_XEF, sizes_X):
        return gmm(x_ME, w_XEF, sizes_X)

    def fwd(x_ME, w_XEF, sizes_X):
        return gmm(x_ME, w_XEF, sizes_X), (x_ME, w_XEF, sizes_X)

    def bwd(res, g_MF):
        dx, dw = gmm_vjp(*res, g_MF)
        return dx, dw, None

    folded.defvjp(fwd, bwd)
    return folded


def megablox(x_ME: jax.Array, w_XEF: jax.Array, sizes_X: jax.Array) -> jax.Array:
    """The Pallas megablox grouped matmul (`jax.experimental.pallas.ops.tpu.megablox.gmm`, with
    its gmm/tgmm backward), rows past the last group zero: their rows, padded to a whole row
    tile, form one more group that has no weights (megablox's sharded-groups form computes the
    first X groups and zeroes the rest). Off TPU it runs in Pallas's interpret mode (slow: for
    tests). Tiles: `megablox_tiling`."""
    from jax.experimental.pallas.ops.tpu.megablox import ops  # lazy: Pallas

    M, k = x_ME.shape
    tiling = megablox_tiling(M, k, w_XEF.shape[2])
    rows = -(-M // tiling[0]) * tiling[0]
    x_ME = jnp.pad(x_ME, ((0, rows - M), (0, 0)))
    sizes = jnp.concatenate([sizes_X, (rows - jnp.sum(sizes_X))[None]]).astype(jnp.int32)
    interpret = _platform() != "tpu"
    out = ops.gmm(x_ME, w_XEF.astype(x_ME.dtype), sizes, x_ME.dtype, tiling, None, None, False,
                  interpret)
    return out[:M]


def megablox_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """Megablox's (rows, contracted, output) tile: 512 rows (fewer for a short input, a multiple
    of 8), and one width for k and n, since the backward pass swaps them (its `gmm` with the
    weights transposed): the largest of 512, 256, 128 dividing both (TPU blocks' last dimension
    is a multiple of 128 or the whole array's). Dimensions that are not multiples of 128 get
    whole-dimension tiles, which only interpret mode runs (`resolve_kernel` refuses them on
    TPU)."""
    rows = min(512, -(-m // 8) * 8)
    if k % 128 or n % 128:
        return (rows, k, n)
    width = next(t for t in (512, 256, 128) if k % t == 0 and n % t == 0)
    return (rows, width, width)


FOLDED = {"ragged_dot": _folding(jax.lax.ragged_dot), "megablox": _folding(megablox)}
KERNELS = ("ragged_dot", "megablox", "dense")


def ragged_dot(x_ME: jax.Array, w_XEF: jax.Array, sizes_X: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot` that vmaps on TPU (`_folding`)."""
    return FOLDED["ragged_dot"](x_ME, w_XEF, sizes_X)


def _platform() -> str:
    active = active_rules()
    return (active[1].devices.flat[0].platform if active is not None
            else jax.default_backend())


def resolve_kernel(choice: str, embed: int, width: int, dtype: Any) -> str:
    """`model.moe.grouped_matmul` on this platform: auto is megablox on TPU where the shapes
    fill its tiles (embed and the local expert width multiples of 128, bf16 or f32), else
    ragged_dot; off TPU the dense form (`grouped_matmul`). An explicit megablox that cannot run
    is a ConfigError."""
    platform = _platform()
    fits = embed % 128 == 0 and width % 128 == 0
    supported = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
    if choice == "auto":
        if platform != "tpu":
            return "dense"
        return "megablox" if fits and supported else "ragged_dot"
    if choice == "megablox" and (platform not in ("tpu", "cpu") or not supported
                                 or (platform == "tpu" and not fits)):
        raise ConfigError(paragraph(
            f"model.moe.grouped_matmul='megablox' cannot run here (platform {platform}, compute",
            f"dtype {jnp.dtype(dtype).name}, embed {embed}, expert width {width} a device):",
            "megablox is a Pallas TPU kernel on bfloat16 or float32 operands whose tiles need",
            "the embed and the per-device expert width (model.moe.mlp over mesh.tensor) to be",
            "multiples of 128 (on CPU it runs interpreted, for tests). Use",
            "model.moe.grouped_matmul=auto or ragged_dot, or a bf16/f32 precision policy."))
    return choice


def grouped_matmul(x_ME: jax.Array, w_XEF: jax.Array, sizes_X: jax.Array, kernel: str
                   ) -> jax.Array:
    """Rows of `x_ME` in consecutive groups of `sizes_X` rows, group g times `w_XEF[g]`; rows
    past the last group come out zero.

    `kernel`: `ragged_dot` (jax's) or `megablox` (the Pallas kernel), both batched by folding
    the batch into the groups (`_folding`); or `dense`: every row times every expert, the row's
    own group selected. Off TPU jax lowers ragged_dot to that same dense form (the same FLOPs),
    but that lowering fails under two nested vmaps (pipeline stages inside per-replica
    accumulation); the dense form has no such limit. All are exact: the selection multiplies
    by one and adds zeros."""
    if kernel in FOLDED:
        return FOLDED[kernel](x_ME, w_XEF, sizes_X)
    ends_X = jnp.cumsum(sizes_X)
    group_M = jnp.searchsorted(ends_X, jnp.arange(x_ME.shape[0]), side="right")
    onehot_MX = jax.nn.one_hot(group_M, w_XEF.shape[0], dtype=x_ME.dtype)  # past the end: 0
    return jnp.einsum("mx,mxf->mf", onehot_MX, jnp.einsum("me,xef->mxf", x_ME, w_XEF))


def expert_mlp(x_ME: jax.Array, sizes_X: jax.Array, w: Weights, kernel: str,
               act: SwiGLU = PLAIN, bias: Biases = None) -> jax.Array:
    """The experts' SwiGLU on rows sorted by expert (`sizes_X` rows each, rows past the last
    group zero): three grouped matmuls, the gate and up biases (GPT-OSS) added per row's expert
    (`row_bias`); the down projection's bias is the caller's (`MoE`: it must be added once
    even where the hidden dimension is split). The gate and up outputs are named as the dense
    MLP's (`nn/scan.py` ACTIVATION_NAMES): the same remat policies keep them."""
    w_gate_XEF, w_up_XEF, w_down_XFE = w
    matmul = lambda a, b: grouped_matmul(a, b, sizes_X, kernel)
    gate_MF, up_MF = (matmul(x_ME, w_XEF) for w_XEF in (w_gate_XEF, w_up_XEF))
    if bias is not None:
        gate_MF, up_MF = (h + row_bias(b.astype(h.dtype), sizes_X, h.shape[0])
                          for h, b in zip((gate_MF, up_MF), bias))
    h_MF = act(checkpoint_name(gate_MF, "mlp_gate_up"), checkpoint_name(up_MF, "mlp_gate_up"))
    return matmul(h_MF, w_down_XFE)
