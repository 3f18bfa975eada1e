"""The rollout sampler: batched, ragged prompts, n samples each, temperature / top-k / top-p,
stop ids per row, per-token log-probabilities, one compiled program per shape.

    sampler = Sampler(model_def, Sampling(temperature=1.0, top_p=0.9, n=4, stop_ids=(eos,)))
    out = sampler(params, [[1, 5, 9], [2, 3]], jax.random.key(0), max_new_tokens=64)
    out.tokens, out.mask, out.lengths, out.logprobs, out.stopped   # rows: prompt r // n

Why a sampler object, not a function per call: RL alternates sampling with training, calling
the sampler thousands of times with prompts of varying lengths. `jaxscale generate` used to
build a fresh jitted function per call (a compile each time); here prompts are left-padded to a
power-of-two bucket and the compiled program is kept per (rows, bucket, max new tokens), so a
new call with known shapes runs straight away (`Sampler.compiles()` counts them). The parameters
are used where they are, and the KV cache, made by the model in its own layout, is sharded by
the rules of the mesh it is given, as in training.

The weights are read where they are, and the layers scanned over the stacked (L, ...) KV
cache. `copy_weights=True` is a CPU speed knob that trades memory for CPU time: each layer's
weights are sliced out of the stacks once per call, before the decoding loop (a transient second
copy of the layer weights), and a model of at most `unroll_layers` layers (default 16) then
decodes on one cache array per layer with its layers unrolled; XLA:CPU copies a slice that
feeds a dot, so without the copies every step would copy every layer's weights. It takes less
CPU time a token and more compile time (bench/RESULTS.md has both).

Decoding replicas: on a mesh where the rows are split (the rules' `batch` axes) and the weights
are not (every parameter replicated, every other mesh axis of size 1: pure data parallelism),
each device decodes its own rows with the one-device program under `jax.shard_map`, its own
loop ending when its own rows stop. The sharded program would agree on "every row done" with a
collective every step, and then the devices would wait for the slowest. The rows, the sampling
noise (each row draws what it draws on one device) and so the rollout are those of one device;
on CPU it is how decoding uses more than one core (XLA:CPU runs these small dots on one thread:
bench/RESULTS.md).

Decoding runs in a `lax.while_loop` that ends when every row has emitted one of `stop_ids`
(EOS, end-of-turn) or `max_new_tokens` are out: a row's stop token is kept and counted in its
length, the tokens after it are `pad_id` with `mask` false and log-prob 0. `logprobs` are the
model's own log-softmax at temperature 1 of the chosen token, unfiltered: the quantity a policy
gradient's ratio and KL compare with the training forward (which knows no temperature or top-p).
Sampling applies temperature, then top-k, then top-p, as transformers' warpers do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.models.nn.scan import copy_layer_weights, layer_caches
from jaxscale.rules import AxisRules, as_tuple, use_rules

MIN_BUCKET = 16  # the shortest prompt bucket: tiny prompts share one program
UNROLL_LAYERS = 16  # copy_weights: models up to this deep unroll their layers (compile grows)


class GenerateError(JaxscaleError):
    """A generation request the model cannot serve (bad prompt, length or temperature)."""


def forward_cached(model: nnx.Module, tokens_BT: jax.Array, start: jax.Array,
                   cache: Any, **rows: jax.Array) -> tuple[jax.Array, Any]:
    """Logits of `tokens_BT` placed at cache slots start.. (by default also their positions;
    `rows` may give `positions_BT` and `segments_BT`) given the cache; the updated cache."""
    return model(tokens_BT, cache=cache, cache_index=start, **rows)


def left_padded_rows(lengths_B: jax.Array, width: int) -> dict[str, jax.Array]:
    """Positions and segment ids of prompts of `lengths_B` tokens left-padded to `width`:
    segment 0 on padding, 1 on the prompt, positions counted from each prompt's first token."""
    pad_B1 = (width - lengths_B)[:, None]
    slots_BT = jnp.arange(width, dtype=jnp.int32)[None]
    return dict(positions_BT=jnp.maximum(slots_BT - pad_B1, 0),
                segments_BT=(slots_BT >= pad_B1).astype(jnp.int32))


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen. temperature 0 is greedy (top-k / top-p then do nothing); top_k 0
    and top_p 1.0 switch those filters off; n samples per prompt; stop_ids end a row."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def check(self) -> None:
        """One paragraph per setting out of range (before anything compiles)."""
        problems = []
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature={self.temperature} (0 is greedy, >0 samples)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} (0 is off, k >= 1 keeps the k likeliest)")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p} (in (0, 1]; 1.0 is off)")
        if self.n < 1:
            problems.append(f"n={self.n} (samples per prompt, at least 1)")
        if problems:
            raise GenerateError(paragraph(
                f"Sampling settings out of range: {'; '.join(problems)}. Fix them; e.g.",
                "temperature=1.0, top_k=50, top_p=0.9, n=4."))


class Rollout(NamedTuple):
    """Sampled continuations, one row per (prompt, sample): row r continues prompt r // n."""

    tokens: jax.Array    # (R, N) int32: new tokens, pad_id after a row's stop
    mask: jax.Array      # (R, N) bool: true on the tokens a row generated (its stop included)
    lengths: jax.Array   # (R,) int32: generated tokens per row (= mask.sum(1))
    logprobs: jax.Array  # (R, N) float32: the model's log-prob of each token, 0 off the mask
    stopped: jax.Array   # (R,) bool: the row ended on a stop id (else it ran out of tokens)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values `x` (-inf lowest, -0 below +0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    bits = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # negatives: flip magnitude
    return jax.lax.bitcast_convert_type(bits, jnp.uint32) ^ jnp.uint32(0x80000000)


def _lowest_key(done: Any, shape: tuple[int, ...]) -> jax.Array:
    """Per row, the smallest uint32 key t with `done(t)` ((B, 1) keys -> (B, 1) bools) true,
    for a `done` false below some key and true from it on: a bisection of 32 halvings."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + ((hi - lo) >> 1)
        ok = done(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    bounds = (jnp.zeros(shape, jnp.uint32), jnp.full(shape, 0xFFFFFFFF, jnp.uint32))
    return jax.lax.fori_loop(0, 32, halve, bounds)[0]


def filter_logits(logits_BV: jax.Array, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> jax.Array:
    """`logits / temperature` with the tokens outside top-k, then outside top-p, at -inf (top-p
    keeps the smallest set of likeliest tokens whose probability reaches top_p; ties at either
    threshold are kept). Settings are static: a filter that is off costs nothing.

    Without a sort: a token is in top-k when fewer than k tokens are likelier, in top-p when the
    tokens likelier than it hold less than top_p, and each threshold is found by bisection over
    the logits' bit patterns (32 counting passes over the vocabulary). `lax.top_k` and
    `jnp.sort` are full sorts on XLA:CPU, which took half of a sampled decoding step."""
    x = logits_BV.astype(jnp.float32) / temperature
    keys_BV = _ordered_keys(x)
    rows = (x.shape[0], 1)
    if top_k:
        kth = _lowest_key(lambda t: jnp.sum(keys_BV > t, -1, keepdims=True) < top_k, rows)
        x = jnp.where(keys_BV >= kth, x, -jnp.inf)
    if top_p < 1.0:
        probs_BV = jax.nn.softmax(x, axis=-1)
        mass = lambda t: jnp.sum(jnp.where(keys_BV > t, probs_BV, 0.0), -1, keepdims=True)
        x = jnp.where(keys_BV >= _lowest_key(lambda t: mass(t) < top_p, rows), x, -jnp.inf)
    return x


def first_max(x_BV: jax.Array) -> jax.Array:
    """The first index of each row's largest value, as `jnp.argmax` (a row of NaNs: the last
    index), by two plain reductions: argmax's reduction over value-index pairs took 4x as long
    on XLA:CPU, a tenth of a decoding step."""
    vocab = x_BV.shape[-1]
    ids_1V = jnp.arange(vocab, dtype=jnp.int32)[None]
    top_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x_BV == top_B1, ids_1V, vocab - 1), axis=-1)


def choose(logits_BV: jax.Array, key: jax.Array, s: Sampling,
           share: tuple[jax.Array | int, int] | None = None) -> tuple[jax.Array, jax.Array]:
    """(token, the model's log-prob of it) per row: argmax at temperature 0, else a sample of
    the filtered distribution (the Gumbel-max draw of `jax.random.categorical`). The log-prob
    is the chosen logit less the log-sum-exp: no whole `log_softmax` is built. `share`
    (first, total): these are rows first.. of a batch of `total` (a decoding replica's share),
    and draw that batch's noise for them, so that a rollout does not depend on the split."""
    logits_BV = logits_BV.astype(jnp.float32)
    if s.temperature == 0.0:
        token_B = first_max(logits_BV)
    else:
        x_BV = filter_logits(logits_BV, s.temperature, s.top_k, s.top_p)
        first, total = share or (0, x_BV.shape[0])
        noise_BV = jax.random.gumbel(key, (total, x_BV.shape[1]), jnp.float32)
        if total != x_BV.shape[0]:
            noise_BV = jax.lax.dynamic_slice_in_dim(noise_BV, first, x_BV.shape[0], 0)
        token_B = first_max(x_BV + noise_BV)
    token_B = token_B.astype(jnp.int32)
    max_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    chosen_B = jnp.take_along_axis(logits_BV, token_B[:, None], axis=-1)[:, 0]
    log_sum_B = jnp.log(jnp.sum(jnp.exp(logits_BV - max_B1), axis=-1))
    return token_B, chosen_B - max_B1[:, 0] - log_sum_B


def bucket(length: int, cap: int = 0) -> int:
    """The padded prompt width for prompts up to `length` tokens: the next power of two (at
    least MIN_BUCKET), so varied prompt lengths share a few programs; at most `cap` (if set)."""
    width = max(MIN_BUCKET, 1 << max(int(length) - 1, 0).bit_length())
    return max(int(length), min(width, cap)) if cap else width


def left_pad(prompts: Sequence[Sequence[int]] | np.ndarray, width: int, pad_id: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """(B, width) int32 prompts left-padded with `pad_id`, and their lengths."""
    rows = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    batch = np.full((len(rows), width), pad_id, np.int32)
    for r, p in enumerate(rows):
        if len(p):
            batch[r, width - len(p):] = p
    return batch, np.asarray([len(p) for p in rows], np.int32)


class Sampler:
    """Samples continuations of token-id prompts with `model_def` (see the module docstring).

    `rules` / `mesh`: the training mesh's, so the KV cache is sharded like training's
    activations; params may already be placed there (they are used in place). `max_len`: the
    model's context, which prompt plus new tokens may not exceed (0: unchecked).
    `copy_weights` and `unroll_layers`: the CPU speed knob of the module docstring (off: the
    weights used in place)."""

    def __init__(self, model_def: Any, sampling: Sampling = Sampling(),
                 rules: AxisRules | None = None, mesh: Mesh | None = None, max_len: int = 0,
                 unroll_layers: int = UNROLL_LAYERS, copy_weights: bool = False):
        sampling.check()
        self.model_def, self.sampling, self.rules, self.mesh = model_def, sampling, rules, mesh
        self.max_len, self.unroll_layers = int(max_len), int(unroll_layers)
        self.copy_weights = bool(copy_weights)
        self.shapes: set[tuple[int, int, int]] = set()  # (rows, bucket, new tokens) run
        self._jitted = jax.jit(self._rollout, static_argnames=("steps",))
        self._replicated = jax.jit(self._rollout_replicas, static_argnames=("steps",))
        self._batch_axes = self._data_parallel_axes()

    def _rollout(self, params: Mapping, prompt_BT: jax.Array, lengths_B: jax.Array,
                 rng: jax.Array, steps: int) -> tuple[jax.Array, ...]:
        if self.rules is None or self.mesh is None:
            return self._decode(params, prompt_BT, lengths_B, rng, steps)
        with use_rules(self.rules, self.mesh):
            return self._decode(params, prompt_BT, lengths_B, rng, steps, sharded=True)

    def _rollout_replicas(self, params: Mapping, prompt_BT: jax.Array, lengths_B: jax.Array,
                          rng: jax.Array, steps: int) -> tuple[jax.Array, ...]:
        """`_rollout` as decoding replicas over `_batch_axes` (the module docstring): the rows
        padded with copies of the first to a multiple of the replica count (each real row still
        draws its own noise), the padding cut off the result."""
        axes, rows = self._batch_axes, prompt_BT.shape[0]
        extra = -rows % math.prod(self.mesh.shape[a] for a in axes)
        pad = lambda x: jnp.concatenate([x, jnp.repeat(x[:1], extra, axis=0)])
        total = rows + extra

        def replica(params, prompt_BT, lengths_B, rng):
            first = jax.lax.axis_index(axes) * prompt_BT.shape[0]
            return self._decode(params, prompt_BT, lengths_B, rng, steps, share=(first, total))

        split, whole = PartitionSpec(axes), PartitionSpec()
        out = jax.shard_map(replica, mesh=self.mesh, in_specs=(whole, split, split, whole),
                            out_specs=split, check_vma=False)(params, pad(prompt_BT),
                                                              pad(lengths_B), rng)
        return tuple(x[:rows] for x in out)

    def _data_parallel_axes(self) -> tuple[str, ...] | None:
        """The mesh axes the rules split the rows over, when they are the mesh's only axes of
        size > 1 (pure data parallelism), else None (no mesh, or a mesh of one device)."""
        if self.mesh is None or self.rules is None or self.mesh.size == 1:
            return None
        spec = self.rules.activation_spec(("batch",), (self.mesh.size,), self.mesh)[0]
        axes = tuple(a for a in as_tuple(spec) if self.mesh.shape[a] > 1)
        if not axes or any(size > 1 and a not in axes for a, size in self.mesh.shape.items()):
            return None
        return axes

    def replica_axes(self, params: Mapping) -> tuple[str, ...] | None:
        """The mesh axes the rows decode over as replicas (the module docstring), or None: not
        a data-parallel mesh (`_data_parallel_axes`), or a parameter not replicated."""
        replicated = lambda x: not isinstance(x, jax.Array) or x.sharding.is_fully_replicated
        if self._batch_axes and all(map(replicated, jax.tree.leaves(params))):
            return self._batch_axes
        return None

    def _decode(self, params: Mapping, prompt_BT: jax.Array, lengths_B: jax.Array,
                rng: jax.Array, steps: int, sharded: bool = False,
                share: tuple[jax.Array, int] | None = None) -> tuple[jax.Array, ...]:
        """The decoding program (the module docstring); `sharded`: under the mesh's rules;
        `share`: a replica's (first row, total rows), for `choose`."""
        s = self.sampling
        model = self.model_def.module(params)
        b, t = prompt_BT.shape
        cache = self._buffers(model, model.init_cache(b, t + steps), sharded)
        logits, cache = forward_cached(model, prompt_BT, jnp.int32(0), cache,
                                       **left_padded_rows(lengths_B, t))
        stop = jnp.asarray(s.stop_ids or (-1,), jnp.int32)
        token, logp = choose(logits[:, -1], jax.random.fold_in(rng, 0), s, share)
        tokens = jnp.zeros((b, steps), jnp.int32).at[:, 0].set(token)
        logps = jnp.zeros((b, steps), jnp.float32).at[:, 0].set(logp)
        done = jnp.isin(token, stop)
        count = jnp.ones((b,), jnp.int32)

        def cond(carry):
            i, _, _, done, *_ = carry
            return (i < steps) & ~jnp.all(done)

        def body(carry):
            i, token, cache, done, count, tokens, logps = carry
            rows = dict(positions_BT=(lengths_B + i - 1)[:, None],
                        segments_BT=jnp.ones((b, 1), jnp.int32))
            logits, cache = forward_cached(model, token[:, None], t + i - 1, cache, **rows)
            nxt, lp = choose(logits[:, -1], jax.random.fold_in(rng, i), s, share)
            nxt = jnp.where(done, jnp.int32(s.pad_id), nxt)
            lp = jnp.where(done, 0.0, lp)
            tokens = jax.lax.dynamic_update_slice(tokens, nxt[:, None], (0, i))
            logps = jax.lax.dynamic_update_slice(logps, lp[:, None], (0, i))
            count = count + (~done).astype(jnp.int32)
            return i + 1, nxt, cache, done | jnp.isin(nxt, stop), count, tokens, logps

        carry = (jnp.int32(1), token, cache, done, count, tokens, logps)
        _, _, _, done, count, tokens, logps = jax.lax.while_loop(cond, body, carry)
        mask = jnp.arange(steps)[None] < count[:, None]
        tokens = jnp.where(mask, tokens, jnp.int32(s.pad_id))
        return tokens, mask, count, jnp.where(mask, logps, 0.0), done

    def _buffers(self, model: nnx.Module, cache: Any, sharded: bool) -> Any:
        """The cache the decoding program carries: the model's stacked cache, its layers then
        scanned; with `copy_weights`, for a model of at most `unroll_layers` layers that offers
        it (`LAYER_STACKS`) and whose layers the mesh does not split over pipeline stages, each
        layer's weights sliced here once (before the decoding loop) and one cache buffer per
        layer (`layer_caches`), the layers then unrolled."""
        layers = jax.tree.leaves(cache)[0].shape[0]
        if (not self.copy_weights or not hasattr(model, "LAYER_STACKS")
                or layers > self.unroll_layers):
            return cache
        if sharded and self.rules.spec(("layers",), (layers,), self.mesh,
                                       warn=False)[0] is not None:
            return cache  # layers split over pipeline stages: each stage scans its own
        copy_layer_weights(model, model.LAYER_STACKS)
        return layer_caches(cache)

    def compiles(self) -> int:
        """How many programs jit holds (one per (rows, bucket, new tokens) seen)."""
        return self._jitted._cache_size() + self._replicated._cache_size()

    def __call__(self, params: Mapping, prompts: Sequence[Sequence[int]] | np.ndarray,
                 rng: jax.Array, max_new_tokens: int) -> Rollout:
        """`n` continuations of each prompt (token-id lists of any lengths, or a (B, T) array
        of whole prompts); rows are grouped by prompt (row r continues prompt r // n)."""
        longest = max((len(p) for p in prompts), default=0)
        if not len(prompts) or longest == 0 or min(len(p) for p in prompts) == 0:
            raise GenerateError("Every prompt needs at least one token (a BOS, or the chat "
                                "template's generation prompt).")
        if max_new_tokens < 1:
            raise GenerateError(f"max_new_tokens={max_new_tokens}: generate at least one "
                                "token, e.g. max_new_tokens=32.")
        if self.max_len and longest + max_new_tokens > self.max_len:
            raise GenerateError(paragraph(
                f"The longest prompt ({longest} tokens) plus {max_new_tokens} new tokens exceeds",
                f"model.max_len={self.max_len}. Generate at most",
                f"{max(self.max_len - longest, 0)} tokens or shorten the prompt."))
        cap = self.max_len - max_new_tokens if self.max_len else 0
        width = bucket(longest, cap)
        batch, lengths = left_pad(prompts, width, self.sampling.pad_id)
        n = self.sampling.n
        batch, lengths = np.repeat(batch, n, axis=0), np.repeat(lengths, n)
        if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)  # a raw uint32 key (jax.random.PRNGKey)
        self.shapes.add((len(batch), width, int(max_new_tokens)))
        run = self._replicated if self.replica_axes(params) else self._jitted
        return Rollout(*run(params, jnp.asarray(batch), jnp.asarray(lengths), rng,
                            steps=int(max_new_tokens)))
