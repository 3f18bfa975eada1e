"""Splash blocks: attention across sequence shards with the Pallas splash kernel per block
(`model.attention=splash` with `mesh.context` > 1; `context.py` routes here).

Why: the einsum blocks (`attention/blockwise.py`) write every tile's float32 scores to HBM; the
splash kernel (`attention/splash.py`) keeps them in VMEM and skips the (128..512)^2 tiles its mask
hides. Here a shard's queries meet each key block (rotated by the ring, or all-gathered) as
splash calls, and the per-call outputs are merged by the log-sum-exp rule.

Masks: a splash mask is static (numpy, known when the kernel is built), but which slots a
block holds depends on the shard and the ring step, so is traced. The sequence's declared
order (natural, or the zigzag of `context.zigzag_order`) is static, though: it is cut into
`Layout.chunk`-slot chunks of consecutive slots, shard i holding chunks `Layout.table[i]`
(natural: chunk i of n; zigzag: chunks i and 2n - 1 - i of 2n). The slots travel with the
keys (as in the einsum ring), so a chunk's number is its first slot // chunk, whichever shard
or ring step it comes from. A (query chunk a, key chunk b) pair then has one of a few masks, by
d = a - b alone (`pair_kind`): hidden (d < 0, or a window that ends before the chunk; skipped
by `lax.switch`, as the einsum blocks skip hidden tiles), full, causal (d = 0), or the splash
`LocalMask` with the pair's offset d x chunk (a sliding window). The kernels for these few
masks are built once per trace; a traced d picks one (`lax.switch`). Segment ids travel with
their keys and are the kernel's `SegmentIds(q, kv)`. Grouped-query heads run natively (the
kernel's MHA form reads kv head h // G), the soft-cap is the kernel's own.

Gradients: the kernel's residual-saving forward (`save_residuals=True`, which yields the
log-sum-exp needed to merge) is not differentiable in jax (its VJP refuses it), so the whole
shard body has a custom VJP, as `ring_vjp.py`: the forward keeps the shard's q, k, v,
merged output and log-sum-exp; the backward runs splash's own backward kernels
(`_splash_attention_bwd`: dK/dV and dQ) per pair, given the merged output and log-sum-exp.
That is exact: the flash backward of a pair with the global (O, lse) is that pair's share of
the global gradient (P = exp(S - lse), dS = P (dP - rowsum(dO O))). `ring` and `ring_vjp` both
rotate the blocks again in the backward pass, their dK/dV travelling home with them;
`allgather` gathers K/V again and reduce-scatters dK/dV (the transpose of its gather).

Attention sinks (GPT-OSS, `sinks` (H,)) are the merge's starting point: output 0 and
log-sum-exp the sink, as if the sink were a key with a zero value; the backward pass is then
unchanged given the merged (O, lse), and d sink = -sum over rows of exp(sink - lse) rowsum(dO O).

Per-pair outputs (and dQ, dK, dV shares) come back in the inputs' dtype (the kernel's), and are
merged (summed) in float32.
Not on TPU the kernels run in Pallas interpret mode (tests). A layout off the kernel's
128-lane grid (chunk not a multiple of 128) falls back to the einsum blocks (warned once).
Shape suffixes: B batch, H heads, K kv heads, T local queries, S keys in hand, D head dim,
C chunk, n sequence shards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

from jaxscale.models.attention import splash

NEG = -1e30  # the log-sum-exp of a row that saw nothing (finite: merges never meet inf - inf)


class Layout(NamedTuple):
    """The static order cut into chunks of consecutive slots: `table[i]` the chunk numbers
    shard i holds, in order; a chunk k holds slots k x chunk .. (k + 1) x chunk - 1."""

    chunk: int
    table: tuple[tuple[int, ...], ...]


def layout(order: np.ndarray, n: int) -> Layout | None:
    """The coarsest chunking of `order` over `n` shards, or None when no chunk of at least
    `splash.LANES` slots fits (the kernel could not run)."""
    local = len(order) // n
    for parts in range(1, local + 1):
        chunk = local // parts
        if local % parts or chunk % splash.LANES:
            continue
        runs = np.asarray(order).reshape(-1, chunk)
        if (runs[:, 0] % chunk == 0).all() and (runs == runs[:, :1] + np.arange(chunk)).all():
            return Layout(chunk, tuple(map(tuple, (runs[:, 0] // chunk).reshape(n, parts))))
    return None


def pair_kind(d: int, chunk: int, causal: bool, window: int) -> tuple[str, int]:
    """The mask of query chunk a against key chunk b = a - d: ("hidden"|"full"|"causal", 0) or
    ("local", offset). A causal query at slot i sees keys j with i - window < j <= i."""
    if not causal:
        return ("full", 0)
    if d < 0:
        return ("hidden", 0)
    if d == 0:
        return ("local", 0) if 0 < window < chunk else ("causal", 0)
    if not window or (d + 1) * chunk - 1 < window:  # the farthest pair is still in the window
        return ("full", 0)
    if (d - 1) * chunk + 1 >= window:  # the nearest pair is already out of it
        return ("hidden", 0)
    return ("local", d * chunk)


@dataclass(frozen=True)
class Plan:
    """What a shard's splash blocks need, all static (the custom VJP's nondiff argument)."""

    axes: tuple[str, ...]
    n: int
    gather: bool  # allgather (K/V gathered once) rather than the ring
    layout: Layout
    causal: bool
    window: int
    softcap: float
    interpret: bool

    @property
    def chunks(self) -> int:
        return len(self.layout.table) * len(self.layout.table[0])

    @functools.cached_property
    def kinds(self) -> tuple[tuple[str, int], ...]:
        """The distinct visible pair masks (branch i + 1 of `lax.switch`; 0 is hidden)."""
        found = {pair_kind(d, self.layout.chunk, self.causal, self.window)
                 for d in range(-self.chunks + 1, self.chunks)}
        return tuple(sorted(found - {("hidden", 0)}))

    @functools.cached_property
    def branch_of_d(self) -> np.ndarray:
        """The switch branch of each d = a - b, indexed by d + chunks - 1."""
        kind = lambda d: pair_kind(d, self.layout.chunk, self.causal, self.window)
        index = {k: i + 1 for i, k in enumerate(self.kinds)}
        return np.array([index.get(kind(d), 0) for d in range(-self.chunks + 1, self.chunks)],
                        np.int32)

    def kernels(self, heads: int) -> list[kernel_lib.SplashAttentionKernel]:
        return [_kernel(kind, self.layout.chunk, self.window, heads, self.softcap,
                        self.interpret) for kind in self.kinds]


def _kernel(kind: tuple[str, int], chunk: int, window: int, heads: int, softcap: float,
            interpret: bool) -> kernel_lib.SplashAttentionKernel:
    """The residual-saving splash kernel of one (chunk, chunk) pair mask (built per trace: it
    holds its mask's block tables as arrays of that trace)."""
    shape = (chunk, chunk)
    name, offset = kind
    one = {"full": lambda: mask_lib.FullMask(shape),
           "causal": lambda: mask_lib.CausalMask(shape),
           "local": lambda: mask_lib.LocalMask(shape, (window - 1, 0), offset)}[name]()
    block = splash.block_size(chunk)
    blocks = kernel_lib.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    return kernel_lib.make_splash_mha(
        mask_lib.MultiHeadMask([one] * heads), block_sizes=blocks, head_shards=1,
        q_seq_shards=1, interpret=interpret, attn_logits_soft_cap=softcap or None,
        save_residuals=True)


def _ids(q_seg: jax.Array | None, kv_seg: jax.Array | None) -> kernel_lib.SegmentIds | None:
    return None if q_seg is None else kernel_lib.SegmentIds(q_seg, kv_seg)


def _pair_forward(kernel: kernel_lib.SplashAttentionKernel, q: jax.Array, k: jax.Array,
                  v: jax.Array, q_seg: jax.Array | None, kv_seg: jax.Array | None
                  ) -> tuple[jax.Array, jax.Array]:
    """One pair's normalised output (B, H, C, D) f32 and log-sum-exp (B, H, C); a row that
    saw no key (its kernel output is 0/0 or a mean under the mask value) gets 0 and `NEG`."""
    run = lambda q, k, v, qs, ks: kernel(q, k, v, _ids(qs, ks))
    out, (lse,) = jax.vmap(run)(q, k, v, q_seg, kv_seg)
    seen = jnp.isfinite(lse) & (lse > kernel_lib.DEFAULT_MASK_VALUE / 2)
    return jnp.where(seen[..., None], out.astype(jnp.float32), 0.0), jnp.where(seen, lse, NEG)


def _pair_backward(kernel: kernel_lib.SplashAttentionKernel, q: jax.Array, k: jax.Array,
                   v: jax.Array, q_seg: jax.Array | None, kv_seg: jax.Array | None,
                   out: jax.Array, lse: jax.Array, d_out: jax.Array) -> tuple[jax.Array, ...]:
    """One pair's share of dQ, dK, dV (f32): splash's backward kernels given the merged output
    and log-sum-exp of the queries (so P = exp(S - lse) is the global softmax's)."""
    kw = kernel.kwargs
    collapse = lambda info: info._replace(partial_mask_blocks=None if info.partial_mask_blocks
                                          is None else info.partial_mask_blocks.reshape(
                                              -1, *info.partial_mask_blocks.shape[-2:]))
    dq_info, dkv_info = collapse(kernel.dq_mask_info), collapse(kernel.dkv_mask_info)

    def one(q, k, v, qs, ks, o, l, do):
        res = (q, k, v, _ids(qs, ks), None, o, l, dq_info, dkv_info)
        grads = kernel_lib._splash_attention_bwd(  # the kernel's own backward (private)
            False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None,
            kw["mask_function"], kw["attn_logits_soft_cap"], kw["interpret"], res, do)
        return grads[3:6]

    grads = jax.vmap(one)(q, k, v, q_seg, kv_seg, out, lse, d_out)
    return tuple(g.astype(jnp.float32) for g in grads)


def _chunk(x: jax.Array | None, index: jax.Array, size: int, axis: int) -> jax.Array | None:
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)


def _put(x: jax.Array, part: jax.Array, index: jax.Array, size: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, part, index * size, axis)


def _pairs(plan: Plan) -> tuple[jax.Array, jax.Array]:
    """Every (local query chunk u, held key chunk w), as two index vectors to scan over."""
    r = len(plan.layout.table[0])
    u, w = np.meshgrid(np.arange(r), np.arange(r), indexing="ij")
    return jnp.asarray(u.ravel()), jnp.asarray(w.ravel())


def _branch(plan: Plan, q_slots: jax.Array, k_slots: jax.Array, u: jax.Array, w: jax.Array
            ) -> jax.Array:
    """The switch branch of query chunk u against held key chunk w: their chunk numbers come
    from the slots that travel with them, so no shard index is assumed."""
    c = plan.layout.chunk
    d = q_slots[0, u * c] // c - k_slots[0, w * c] // c
    return jnp.asarray(plan.branch_of_d)[d + plan.chunks - 1]


Acc = tuple[jax.Array, jax.Array]  # merged output (B, H, T, D) f32, log-sum-exp (B, H, T) f32


def _attend(plan: Plan, kernels: list, q: jax.Array, slots: jax.Array, seg: jax.Array | None,
            acc: Acc, held: dict) -> Acc:
    """`acc` with the block in hand attended: every (query chunk, key chunk) pair by its
    kernel (hidden pairs skipped), merged by the log-sum-exp rule."""
    c = plan.layout.chunk
    b, h, _, d = q.shape
    hidden = lambda *_: (jnp.zeros((b, h, c, d), jnp.float32), jnp.full((b, h, c), NEG))
    branches = [hidden] + [functools.partial(_pair_forward, kernel) for kernel in kernels]

    def pair(acc: Acc, uw: tuple[jax.Array, jax.Array]) -> tuple[Acc, None]:
        (out, lse), (u, w) = acc, uw
        args = (_chunk(q, u, c, 2), _chunk(held["k"], w, c, 2), _chunk(held["v"], w, c, 2),
                _chunk(seg, u, c, 1), _chunk(held.get("segments"), w, c, 1))
        branch = _branch(plan, slots, held["slots"], u, w)
        out_p, lse_p = jax.lax.switch(branch, branches, *args)
        out_u, lse_u = _chunk(out, u, c, 2), _chunk(lse, u, c, 2)
        lse_n = jnp.logaddexp(lse_u, lse_p)
        out_u = (out_u * jnp.exp(lse_u - lse_n)[..., None]
                 + out_p * jnp.exp(lse_p - lse_n)[..., None])
        return (_put(out, out_u, u, c, 2), _put(lse, lse_n, u, c, 2)), None

    return jax.lax.scan(pair, acc, _pairs(plan))[0]


def _send(plan: Plan) -> Any:
    ring = [(i, (i + 1) % plan.n) for i in range(plan.n)]
    return lambda tree: jax.tree.map(lambda x: jax.lax.ppermute(x, plan.axes, ring), tree)


def _gathered(plan: Plan, held: dict) -> dict:
    """The `n` shards' blocks, (n, ...) each."""
    return {name: jax.lax.all_gather(x, plan.axes, axis=0, tiled=False)
            for name, x in held.items()}


def _own(k: jax.Array, v: jax.Array, slots: jax.Array, seg: jax.Array | None) -> dict:
    """The shard's own key block, as it travels: keys, values, slots (and segment ids)."""
    return {"k": k, "v": v, "slots": slots, **({} if seg is None else {"segments": seg})}


def _forward(plan: Plan, q: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array,
             seg: jax.Array | None, sinks: jax.Array | None = None) -> Acc:
    """The merged output and log-sum-exp of the shard's queries over every key block (and
    the attention sinks, where given: the merge starts from them)."""
    kernels = plan.kernels(q.shape[1])
    b, h, t, _ = q.shape
    start = (jnp.full((b, h, t), NEG) if sinks is None else
             jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (b, h, t)))
    acc = (jnp.zeros((b, h, t, v.shape[-1]), jnp.float32), start)
    attend = lambda acc, held: _attend(plan, kernels, q, slots, seg, acc, held)
    held = _own(k, v, slots, seg)
    if plan.gather:
        return jax.lax.scan(lambda a, x: (attend(a, x), None), acc, _gathered(plan, held))[0]
    send = _send(plan)

    def step(carry: tuple[Acc, dict], _: None) -> tuple[tuple, None]:
        acc, held = carry
        return (attend(acc, held), send(held)), None

    (acc, held), _ = jax.lax.scan(step, (acc, held), length=plan.n - 1)
    return attend(acc, held)


def _attend_grads(plan: Plan, kernels: list, res: tuple, d_out: jax.Array, grads: tuple,
                  held: dict) -> tuple:
    """(dQ, dK, dV) f32 plus the shares of the block in hand (dK, dV the block's own)."""
    q, _, _, slots, seg, out, lse = res
    c = plan.layout.chunk
    hidden = lambda q_u, k_w, v_w, *_: (jnp.zeros(q_u.shape, jnp.float32),
                                        jnp.zeros(k_w.shape, jnp.float32),
                                        jnp.zeros(v_w.shape, jnp.float32))
    branches = [hidden] + [functools.partial(_pair_backward, kernel) for kernel in kernels]

    def pair(grads: tuple, uw: tuple[jax.Array, jax.Array]) -> tuple[tuple, None]:
        u, w = uw
        args = (_chunk(q, u, c, 2), _chunk(held["k"], w, c, 2), _chunk(held["v"], w, c, 2),
                _chunk(seg, u, c, 1), _chunk(held.get("segments"), w, c, 1),
                _chunk(out, u, c, 2), _chunk(lse, u, c, 2), _chunk(d_out, u, c, 2))
        shares = jax.lax.switch(_branch(plan, slots, held["slots"], u, w), branches, *args)
        return tuple(_put(g, _chunk(g, i, c, 2) + share, i, c, 2)
                     for g, share, i in zip(grads, shares, (u, w, w))), None

    return jax.lax.scan(pair, grads, _pairs(plan))[0]


def _backward(plan: Plan, res: tuple, d_out: jax.Array) -> tuple:
    q, k, v, slots, seg, out, lse, sinks = res
    res = res[:-1]
    kernels = plan.kernels(q.shape[1])
    grads = lambda dq, held, dk, dv: _attend_grads(plan, kernels, res, d_out, (dq, dk, dv),
                                                   held)
    zero = lambda x: jnp.zeros(x.shape, jnp.float32)
    held = _own(k, v, slots, seg)
    if plan.gather:  # gather again; the blocks' dK, dV reduce-scatter home
        def block(dq: jax.Array, held: dict) -> tuple[jax.Array, tuple]:
            dq, dk, dv = grads(dq, held, zero(k), zero(v))
            return dq, (dk, dv)

        dq, (dk, dv) = jax.lax.scan(block, zero(q), _gathered(plan, held))
        dk, dv = (jax.lax.psum_scatter(x, plan.axes, scatter_dimension=0, tiled=False)
                  for x in (dk, dv))
    else:  # the ring again, each block's dK, dV riding with it: home after n hops
        send = _send(plan)

        def step(carry: tuple, _: None) -> tuple[tuple, None]:
            dq, held = carry
            dq, dk, dv = grads(dq, held, held["dk"], held["dv"])
            return (dq, send(dict(held, dk=dk, dv=dv))), None

        (dq, held), _ = jax.lax.scan(step, (zero(q), dict(held, dk=zero(k), dv=zero(v))),
                                     length=plan.n)
        dk, dv = held["dk"], held["dv"]
    d_sinks = None
    if sinks is not None:  # the sink's share of each row's softmax, times -rowsum(dO O)
        p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
        rows = jnp.einsum("bhtd,bhtd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
        d_sinks = (-jnp.sum(p_sink * rows, axis=(0, 2))).astype(sinks.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocks(plan: Plan, q: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array,
            seg: jax.Array | None, sinks: jax.Array | None) -> jax.Array:
    return _forward(plan, q, k, v, slots, seg, sinks)[0].astype(q.dtype)


def _blocks_fwd(plan: Plan, q: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array,
                seg: jax.Array | None, sinks: jax.Array | None) -> tuple[jax.Array, tuple]:
    out, lse = _forward(plan, q, k, v, slots, seg, sinks)
    out = out.astype(q.dtype)
    return out, (q, k, v, slots, seg, out, lse, sinks)


_blocks.defvjp(_blocks_fwd, _backward)


def attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, slots_1T: jax.Array,
              segments_BT: jax.Array | None, *, plan: Plan,
              sinks_H: jax.Array | None = None) -> jax.Array:
    """One shard's attention to every key block by splash kernels (see the module docstring);
    `slots_1T` the global slots of the shard's tokens (whole chunks of `plan.layout`);
    `sinks_H` the shard's heads' attention sinks; out (B, T, H, D) like the queries."""
    scale = 1.0 / np.sqrt(q_BTHD.shape[-1])  # the kernel takes queries already scaled
    q_BHTD = (q_BTHD * scale).astype(q_BTHD.dtype).swapaxes(1, 2)
    out_BHTD = _blocks(plan, q_BHTD, k_BSKD.swapaxes(1, 2), v_BSKD.swapaxes(1, 2), slots_1T,
                       segments_BT, sinks_H)
    return out_BHTD.swapaxes(1, 2)
