"""Streams one averaging round: every leaf, block by block, through an aggregator, in bounded
memory. (The three Lo-Fi averaging modules: `aggregate.py` is the pure math on one block,
`stream.py` moves a round's data through it, `averager.py` decides what a round uses and
publishes it.)

Each block holds at most `chunk_budget_bytes` of float32 working data whatever the model size.
Worker data is verified (each chunk's crc32c, by tensorstore as it reads) and checked for
non-finite values as it streams; a failing worker raises `Drop` so the round restarts without
it. `centered_clip` needs whole-model norms,
so it runs in passes: the coordinate-wise median, then `iters` clip updates, keeping the centre
`v` in float32 scratch arrays in the store (not in memory) next to the output.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxscale.errors import paragraph
from jaxscale.lofi import aggregate
from jaxscale.lofi.fallback import BaseDamaged
from jaxscale.lofi.trust import worker_weights
from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import CHUNK, StoreError
from jaxscale.weights.snapshot import Snapshot, read_many, read_range, read_values, start_reads

log = logging.getLogger("jaxscale.lofi")


class Drop(Exception):
    """A worker's data turned out corrupt or non-finite while streaming."""

    def __init__(self, worker: int, reason: str):
        super().__init__(reason)
        self.worker, self.reason = worker, reason


class Abort(Exception):
    """The round cannot be published (e.g. its output would be non-finite)."""


@dataclass
class RoundInputs:
    store: Store
    base: Snapshot
    workers: dict[int, Snapshot]
    cfg: Any                        # averager.AveragerConfig
    data: str                       # output arrays go under DATA/arrays, DATA/momentum
    scratch: dict = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return sorted(self.workers)

    @property
    def weights(self) -> np.ndarray:
        """Samples seen per worker, bounded (`trust.worker_weights`); equal weights if every
        worker reports zero."""
        w = worker_weights([self.workers[i] for i in self.ids], self.cfg.batch_size)
        return aggregate.check_weights(w)

    def size(self, leaf: str) -> int:
        return int(np.prod(self.base.leaves[leaf]["shape"]))


def block_size(n_workers: int, budget: int, unit: int = CHUNK) -> int:
    """Values per block: within `budget`, a multiple of `unit` (every input's and the output's
    chunk size: each chunk is read and written whole), and at least one unit (then over budget: warned)."""
    # f32 values held per block position: this block's inputs and the next block's (being
    # prefetched), deltas, base, centre, output, momentum. (Deltas now live in cache-sized
    # pieces, so this over-counts by one value per worker: blocks stay within the budget.)
    per_value = 4 * (3 * n_workers + 6)
    if per_value * unit > budget and budget >= 1 << 20:  # (tiny test budgets mean "one unit")
        need = -(-(per_value * unit) // 2**20)
        log.warning("chunk budget %d MiB is below one block of %d workers x %d-value chunks, "
                    "so blocks will take %d MiB: raise --chunk_budget_mb to at least %d",
                    budget >> 20, n_workers, unit, need, need)
    return max(unit, (budget // per_value) // unit * unit)


def _blocks(inp: RoundInputs) -> Iterator[tuple[str, int, int]]:
    unit = max([inp.store.chunk] + [c.chunk for c in _inputs(inp)])  # powers of two: the lcm
    step = block_size(len(inp.workers), inp.cfg.chunk_budget_bytes, unit)
    for leaf in sorted(inp.base.leaves):
        size = inp.size(leaf)
        for a in range(0, max(size, 1), step):
            yield leaf, a, min(a + step, size)


def _inputs(inp: RoundInputs) -> list[Snapshot]:
    return [inp.base] + [inp.workers[w] for w in inp.ids]


def _prefetched(inp: RoundInputs) -> Iterator[tuple[str, int, int, list[Any]]]:
    """`_blocks` plus each block's started reads, the next block's always in flight while the
    caller reduces this one (I/O overlaps compute; one extra block of memory)."""
    ahead = None
    for leaf, a, b in _blocks(inp):
        started = start_reads(inp.store, _inputs(inp), leaf, a, b)
        if ahead is not None:
            yield ahead
        ahead = (leaf, a, b, started)
    if ahead is not None:
        yield ahead


PIECE_BYTES = 1 << 20  # every worker's deltas for one piece: about a CPU's L2 cache


def piece_size(n_workers: int) -> int:
    """Values per piece: a power of two (at least 4096) whose deltas for `n_workers` fit in
    PIECE_BYTES, so subtraction, the finiteness check and the reducer work on cached data
    instead of streaming whole blocks through memory once per step (half the CPU time)."""
    return max(4096, 1 << ((PIECE_BYTES // (4 * max(n_workers, 1))).bit_length() - 1))


def delta_pieces(inp: RoundInputs, leaf: str, a: int, b: int, started: list[Any] | None = None
                 ) -> tuple[np.ndarray, Iterator[tuple[slice, np.ndarray]]]:
    """(base block, pieces). Every input of values [a, b) is read and verified first; the
    pieces then yield (slice of the block, (workers, piece) float32 deltas checked finite).
    The deltas buffer is reused: use each piece before asking for the next. (Spreading pieces
    over two threads gained nothing measurable on 2 cores: the loop is memory-bound.)"""
    got = read_many(inp.store, _inputs(inp), leaf, a, b, started)
    if isinstance(got[0], StoreError):  # the base average is damaged: build on an older one
        raise BaseDamaged(str(got[0])) from None
    for w, values in zip(inp.ids, got[1:]):
        if isinstance(values, StoreError):
            raise Drop(w, str(values))
    return got[0], _pieces(inp.ids, leaf, a, got[0], got[1:])


def _pieces(ids: list[int], leaf: str, a: int, base_blk: np.ndarray,
            values: list[np.ndarray]) -> Iterator[tuple[slice, np.ndarray]]:
    step = piece_size(len(ids))
    buf = np.empty((len(ids), min(step, base_blk.size)), np.float32)
    for s in range(0, base_blk.size, step):
        e = min(s + step, base_blk.size)
        deltas = buf[:, :e - s]
        for i, v in enumerate(values):
            np.subtract(v[s:e], base_blk[s:e], out=deltas[i])
        bad = ~aggregate.finite_rows(deltas)
        if bad.any():
            raise Drop(ids[int(np.argmax(bad))], f"non-finite values in leaf {leaf} "
                       f"(values {a + s}..{a + e}); rejected before any reducer")
        yield slice(s, e), deltas


def _scratch(inp: RoundInputs, leaf: str):
    if leaf not in inp.scratch:
        inp.scratch[leaf] = inp.store.array(f"{inp.data}/scratch/{leaf}", inp.size(leaf),
                                            "float32")
    return inp.scratch[leaf]


def _read_scratch(inp: RoundInputs, leaf: str, a: int, b: int) -> np.ndarray:
    scratch = _scratch(inp, leaf)
    v = np.asarray(inp.store.started(f"reading scratch of {leaf}",
                                     lambda: scratch[a:b].read(), 4 * (b - a)).result(),
                   np.float32)
    inp.store.bytes_read += v.nbytes
    return v


def _clip_pass(inp: RoundInputs, scales: np.ndarray | None) -> np.ndarray:
    """One streamed pass: v = median (scales None) or a clip update; returns ||d_i - v||^2."""
    sq = np.zeros(len(inp.workers), np.float64)
    weights = inp.weights
    for leaf, a, b, started in _prefetched(inp):
        _, pieces = delta_pieces(inp, leaf, a, b, started)
        if scales is None:
            v = np.empty(b - a, np.float32)
        else:
            v = _read_scratch(inp, leaf, a, b)
        for part, deltas in pieces:
            v[part] = (aggregate.median(deltas, weights) if scales is None
                       else aggregate.clip_update(v[part], deltas, weights, scales))
            sq += aggregate.sq_dist(v[part], deltas)
        _write_block(inp.store, _scratch(inp, leaf), a, v).result()
    return sq


def centered_clip_passes(inp: RoundInputs) -> None:
    """Leaves the whole-model centered-clip centre in the scratch arrays."""
    sq = _clip_pass(inp, None)
    for _ in range(inp.cfg.clip_iters):
        sq = _clip_pass(inp, aggregate.clip_scales(sq, inp.cfg.tau))


def _block_delta(inp: RoundInputs, leaf: str, a: int, b: int,
                 started: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    if inp.cfg.aggregator == "centered_clip":
        base_blk = read_range(inp.store, inp.base, leaf, a, b)
        return base_blk, _read_scratch(inp, leaf, a, b)
    base_blk, pieces = delta_pieces(inp, leaf, a, b, started)
    reducer, weights = aggregate.get_aggregator(inp.cfg.aggregator), inp.weights
    delta = np.empty(base_blk.size, np.float32)  # becomes the output
    for part, deltas in pieces:
        delta[part] = reducer(deltas, weights, trim=inp.cfg.trim, tau=inp.cfg.tau)
    return base_blk, delta


def previous_momentum(store: Store, base: Snapshot, leaf: str, a: int, b: int) -> np.ndarray:
    """The outer momentum persisted with the base average, crc32c-verified (zeros at first)."""
    if not base.leaves[leaf].get("momentum"):
        return np.zeros(b - a, np.float32)
    try:
        return read_values(store, base, "momentum", leaf, a, b)
    except StoreError as e:
        raise Abort(paragraph(
            f"{e} (momentum of {leaf}) The outer-optimizer momentum of the previous average is",
            "damaged, so a DiLoCo round cannot continue from it. Restore the store from a",
            "backup, or start the averager with --outer=none.",
        )) from None


def _as_output(new: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`new` in the output's dtype (a mean's float32 block already is: no copy)."""
    return new if new.dtype == dtype else new.astype(dtype)


def stream_round(inp: RoundInputs) -> dict[str, dict]:
    """Writes every output leaf (and DiLoCo momentum); returns the manifest's leaf entries."""
    if inp.cfg.aggregator == "centered_clip":
        centered_clip_passes(inp)
    outer = (aggregate.OuterSGD(inp.cfg.outer_lr, inp.cfg.outer_momentum)
             if inp.cfg.outer == "diloco" else None)
    store, leaves, arrays, pending = inp.store, {}, {}, collections.deque()
    try:
        blocks = (((leaf, a, b, None) for leaf, a, b in _blocks(inp))
                  if inp.cfg.aggregator == "centered_clip" else _prefetched(inp))
        for leaf, a, b, started in blocks:
            dtype = inp.base.leaves[leaf]["dtype"]
            if leaf not in arrays:
                momentum = (store.array(f"{inp.data}/momentum/{leaf}", inp.size(leaf),
                                        "float32") if outer else None)
                arrays[leaf] = (store.array(f"{inp.data}/arrays/{leaf}", inp.size(leaf), dtype),
                                momentum)
                leaves[leaf] = {"shape": inp.base.leaves[leaf]["shape"], "dtype": dtype,
                                "encoding": "raw", **({"momentum": True} if outer else {})}
            out, mom_out = arrays[leaf]
            base_blk, delta = _block_delta(inp, leaf, a, b, started)
            if outer:
                new, m = outer.step(base_blk, delta, previous_momentum(store, inp.base, leaf, a, b))
                pending.append(_write_block(store, mom_out, a, m))
            else:
                new = np.add(base_blk, delta, out=delta)
            values = _as_output(new, out.dtype.numpy_dtype)
            if not np.isfinite(values.astype(np.float32, copy=False)).all():
                raise Abort(paragraph(
                    f"The averaged leaf {leaf} (values {a}..{b}) is non-finite in {dtype}",
                    "(huge but finite contributions overflowed), so the round is not published.",
                    "Use a robust aggregator (--aggregator=median, trimmed_mean or",
                    "centered_clip) or exclude the offending worker with --allowed_workers.",
                ))
            pending.append(_write_block(store, out, a, values))  # overlaps the next reads
            while len(pending) > 4:  # bounded: at most a couple of blocks in flight
                pending.popleft().result()
    except BaseException:  # Drop / Abort: let this attempt's writes land before a retry
        for write in pending:    # reuses the directory, so none can land after it
            try:
                write.result()
            except Exception:  # the attempt is abandoned anyway
                pass
        raise
    for write in pending:  # all complete (durable: weights/kv.py) before the caller commits
        write.result()
    return leaves


def _write_block(store: Store, array: Any, a: int, values: np.ndarray) -> Any:
    """Starts writing `values` at [a, a + n) of an output array (tensorstore computes each
    chunk's crc32c as it encodes it): a future."""
    store.bytes_written += values.nbytes
    return store.started(f"writing block {a} of {array.kvstore.path}",
                         lambda: array[a:a + values.size].write(values), values.nbytes)
