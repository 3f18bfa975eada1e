"""`Mask`: which keys each query may see, described (slots, segments, causal), not materialised.

Its own module so that every kernel can read it (`kernels.py` for einsum and the fused kernel,
`splash.py` for the Pallas TPU kernel) without importing the module that tables the kernels.
A kernel uses its own structured masking where it has one (the fused kernel's built-in causal
mask, splash's causal mask and segment ids); the others build the dense boolean mask with
`Mask.dense`.

A sliding window (`window` > 0, Mistral's `sliding_window`) further limits a causal query at
slot i to the keys at slots j with i - window < j <= i, as transformers' sliding-window overlay
does (`kv_idx > q_idx - sliding_window`): `window` keys, itself included. Slots, not rotary
positions, are compared, as transformers compares cache positions: a packed document or a
left-padded prompt occupies consecutive slots, so within one segment the window counts
positions within the document.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Mask:
    """Which keys each query sees: same segment (when given) and, if causal, key slot <= query
    slot. Slots shared by every row have a leading 1 (1, T) so no (B, T, S) mask is built.
    `aligned`: the queries are exactly the keys (one whole sequence, no cache), which lets a
    fused kernel use its built-in causal mask."""

    q_slots_BT: jax.Array
    k_slots_BS: jax.Array
    q_segments_BT: jax.Array | None = None
    k_segments_BS: jax.Array | None = None
    causal: bool = True
    aligned: bool = False
    # > 0: a causal query sees only the `window` latest slots (itself included). A traced int
    # (a per-layer window scanned with the layers, Gemma's local/global pattern): 0 is full.
    window: int | jax.Array = 0
    # With a traced `window`: the static window it takes on a local layer, so a kernel whose
    # masks are static (splash) can choose its local or its global kernel on `window > 0`.
    local_window: int = 0

    @classmethod
    def sequence(cls, length: int, segments_BT: jax.Array | None = None,
                 causal: bool = True, window: int | jax.Array = 0,
                 local_window: int = 0) -> "Mask":
        """Self-attention over one whole sequence per row (training, evaluation, a prefill
        without cache); `segments_BT` (B, T) ids keep packed documents apart."""
        slots_1T = jnp.arange(length, dtype=jnp.int32)[None]
        return cls(slots_1T, slots_1T, segments_BT, segments_BT, causal, aligned=True,
                   window=window, local_window=local_window)

    @classmethod
    def cached(cls, length: int, index: jax.Array, cache_len: int,
               q_segments_BT: jax.Array | None = None,
               k_segments_BS: jax.Array | None = None, window: int | jax.Array = 0) -> "Mask":
        """`length` new queries at slots index.. over a cache of `cache_len` slots: a slot not
        yet written lies after every query, so the causal test also hides it. With segment
        ids, a query sees only the cached slots of its own segment (never padding)."""
        q_1T = (index + jnp.arange(length, dtype=jnp.int32))[None]
        return cls(q_1T, jnp.arange(cache_len, dtype=jnp.int32)[None], q_segments_BT,
                   None if q_segments_BT is None else k_segments_BS, window=window)

    def dense(self) -> jax.Array | None:
        """Boolean (B or 1, T, S), True where the query may see the key; None: all visible."""
        visible = None
        if self.causal:
            visible = self.k_slots_BS[:, None, :] <= self.q_slots_BT[:, :, None]
        if isinstance(self.window, jax.Array) or self.window:
            recent = self.k_slots_BS[:, None, :] > self.q_slots_BT[:, :, None] - self.window
            if isinstance(self.window, jax.Array):
                recent = recent | (self.window <= 0)
            visible = recent if visible is None else visible & recent
        if self.q_segments_BT is not None:
            same = self.q_segments_BT[:, :, None] == self.k_segments_BS[:, None, :]
            visible = same if visible is None else visible & same
        return visible
