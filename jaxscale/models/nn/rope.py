"""Rotary position embeddings and their context-extension scalings (one definition for all).

`Rope` holds what decides the rotation frequencies: the base `theta` and an optional scaling,
as Hugging Face checkpoints declare it in `rope_scaling`:

    none     the plain frequencies theta^(-2i/d).
    linear   every frequency divided by `factor` (position interpolation: positions / factor).
    llama3   Llama 3.1 / 3.2: wavelengths longer than original_max_len / low_freq_factor are
             stretched by `factor`, those shorter than original_max_len / high_freq_factor are
             kept, and the band between is interpolated smoothly between the two.

Training, evaluation and KV-cache decoding all call `rotary` with the same `Rope`, so a model
converted with a scaling decodes with the frequencies it was trained with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxscale.errors import ConfigError, paragraph

ROPE_SCALINGS = ("none", "linear", "llama3")


def check_rope(m: Mapping[str, Any]) -> None:
    """The `model.rope_*` fields: a bad scaling name or factor would silently compute another
    model, so it is refused in one paragraph before anything is built."""
    kind = m.get("rope_scaling", "none")
    if kind not in ROPE_SCALINGS:
        raise ConfigError(paragraph(
            f"model.rope_scaling={kind!r} is not a supported rotary scaling; use one of",
            f"{', '.join(ROPE_SCALINGS)} (Llama 3.1 / 3.2 checkpoints use 'llama3', with",
            "rope_factor, rope_low_freq_factor, rope_high_freq_factor and",
            "rope_original_max_len)."))
    if kind == "none":
        return
    if m["rope_factor"] <= 0:
        raise ConfigError(f"model.rope_factor={m['rope_factor']} must be positive.")
    low, high = m["rope_low_freq_factor"], m["rope_high_freq_factor"]
    if kind == "llama3" and not (0 < low < high and m["rope_original_max_len"] > 0):
        raise ConfigError(paragraph(
            f"model.rope_scaling='llama3' needs 0 < rope_low_freq_factor ({low}) <",
            f"rope_high_freq_factor ({high}) and a positive rope_original_max_len",
            f"({m['rope_original_max_len']})."))


@dataclass(frozen=True)
class Rope:
    """Rotary frequency settings (the `config.model.rope_*` fields of a Llama)."""

    theta: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self) -> None:
        if self.scaling not in ROPE_SCALINGS:
            raise ValueError(f"Unknown rope scaling {self.scaling!r}; use one of "
                             f"{list(ROPE_SCALINGS)}.")

    def inv_frequencies(self, head_dim: int) -> jax.Array:
        """The head_dim/2 rotation frequencies (radians per position), float32."""
        exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        if self.scaling == "linear":
            return inv_freq / self.factor
        if self.scaling == "llama3":
            return self._llama3(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: jax.Array) -> jax.Array:
        """Llama 3's band-wise scaling: stretch low frequencies, keep high ones, blend between
        (smooth = 0 at the low-frequency edge, 1 at the high-frequency edge)."""
        wavelen = 2 * math.pi / inv_freq
        long_edge = self.original_max_len / self.low_freq_factor
        short_edge = self.original_max_len / self.high_freq_factor
        smooth = ((self.original_max_len / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = jnp.where(wavelen > long_edge, inv_freq / self.factor, inv_freq)
        in_band = (wavelen >= short_edge) & (wavelen <= long_edge)
        return jnp.where(in_band, blended, scaled)


def rotary(x_BTHD: jax.Array, positions_BT: jax.Array, rope: Rope | float) -> jax.Array:
    """Rotary embedding in the "rotate half" layout (the Hugging Face Llama convention).

    `rope` may be a bare theta (plain frequencies) for callers without a scaling.
    """
    rope = rope if isinstance(rope, Rope) else Rope(theta=float(rope))
    inv_freq_d = rope.inv_frequencies(x_BTHD.shape[-1])
    angles_BTd = positions_BT[..., None].astype(jnp.float32) * inv_freq_d[None, None, :]
    angles_BTD = jnp.concatenate([angles_BTd, angles_BTd], axis=-1)[:, :, None, :]
    x = x_BTHD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * jnp.cos(angles_BTD) + rotated * jnp.sin(angles_BTD)).astype(x_BTHD.dtype)
