"""The Lo-Fi push codec: 8-bit block-wise absmax quantization (Dettmers et al., "8-bit
optimizers") of flat arrays, what compressed pushes (`lofi.compress`) store.

Not int8 training (`models/adapters/int8.py`, qwix): this only encodes values to store them.

Each block of `block_size` consecutive values shares one float32 scale = max |x| / 127, so the
error per value is at most scale / 2. Works on numpy and jax arrays alike. The snapshot format's
`q8delta` encoding (`snapshot.py`: compressed Lo-Fi pushes, 8-bit deltas from an average)
stores its values this way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK = 256


def _xp(x: Any):
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np
    import jax.numpy as jnp
    return jnp


def quantize_blockwise(x: Any, block_size: int = BLOCK) -> tuple[Any, Any]:
    """Returns (q int8 of x.size padded to whole blocks, scale float32 per block)."""
    xp = _xp(x)
    flat = xp.ravel(x).astype(xp.float32)
    pad = (-flat.shape[0]) % block_size
    blocks = xp.pad(flat, (0, pad)).reshape(-1, block_size)
    scale = xp.max(xp.abs(blocks), axis=1) / 127.0
    safe = xp.where(scale > 0, scale, 1.0)
    q = xp.clip(xp.round(blocks / safe[:, None]), -127, 127).astype(xp.int8)
    return q.reshape(-1), scale.astype(xp.float32)


def dequantize_blockwise(q: Any, scale: Any, shape: tuple[int, ...], dtype: Any = np.float32,
                         block_size: int = BLOCK) -> Any:
    """Inverse of `quantize_blockwise` up to scale / 2 per value."""
    xp = _xp(q)
    values = q.reshape(-1, block_size).astype(xp.float32) * scale[:, None]
    n = int(np.prod(shape)) if shape else 1
    return values.reshape(-1)[:n].reshape(shape).astype(dtype)
