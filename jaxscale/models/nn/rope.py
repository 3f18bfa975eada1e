"""Rotary position embeddings and their context-extension scalings (one definition for all).

`Rope` holds what decides the rotation frequencies: the base `theta` and an optional scaling,
as Hugging Face checkpoints declare it in `rope_scaling`:

    none     the plain frequencies theta^(-2i/d).
    linear   every frequency divided by `factor` (position interpolation: positions / factor).
    llama3   Llama 3.1 / 3.2: wavelengths longer than original_max_len / low_freq_factor are
             stretched by `factor`, those shorter than original_max_len / high_freq_factor are
             kept, and the band between is interpolated smoothly between the two.
    yarn     YaRN (GPT-OSS, DeepSeek-V2/V3, Qwen's long-context variants): frequencies that turn
             fewer than `beta_slow` times over original_max_len are divided by `factor`, those
             that turn more than `beta_fast` times are kept, and a linear ramp over the
             dimensions between blends the two; the correction range's ends are rounded to
             whole dimensions unless `truncate` is off (GPT-OSS). The rotation also scales q and
             k by `attention_factor` (each; the scores by its square): explicit, or
             0.1 ln(factor) + 1, or with DeepSeek's `mscale` / `mscale_all_dim` the ratio of
             those terms. DeepSeek's attention further multiplies its softmax scale by
             `score_scale` (the mscale_all_dim term squared), which is the attention's to apply.

Every number is transformers' (`modeling_rope_utils`: `_compute_llama3_parameters`,
`_compute_yarn_parameters`), so converted checkpoints compute the frequencies they were
trained with; tests compare against those functions.

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

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


def check_rope(m: Mapping[str, Any]) -> None:
    """The `model.rope_*` fields: a bad scaling name or factor would silently compute another
    model, so it is refused in one paragraph before anything is built."""
    kind = m.get("rope_scaling", "none")
    if kind not in ROPE_SCALINGS:
        raise ConfigError(paragraph(
            f"model.rope_scaling={kind!r} is not a supported rotary scaling; use one of",
            f"{', '.join(ROPE_SCALINGS)} (Llama 3.1 / 3.2 checkpoints use 'llama3', with",
            "rope_factor, rope_low_freq_factor, rope_high_freq_factor and",
            "rope_original_max_len; GPT-OSS and DeepSeek 'yarn', with rope_factor,",
            "rope_original_max_len, rope_beta_fast, rope_beta_slow and the mscale fields)."))
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
    if kind == "yarn":
        check_yarn(m)


def check_yarn(m: Mapping[str, Any]) -> None:
    """YaRN's fields: a ramp from beta_slow up to beta_fast rotations over a positive
    pre-extension length, and non-negative attention-scale terms."""
    fast, slow = m.get("rope_beta_fast", 32.0), m.get("rope_beta_slow", 1.0)
    original = m["rope_original_max_len"]
    scales = {k: m.get(k, 0.0) for k in ("rope_mscale", "rope_mscale_all_dim",
                                         "rope_attention_factor")}
    if not (0 < slow < fast and original > 0) or min(scales.values()) < 0:
        raise ConfigError(paragraph(
            f"model.rope_scaling='yarn' needs 0 < rope_beta_slow ({slow}) < rope_beta_fast",
            f"({fast}), a positive rope_original_max_len ({original}) and non-negative",
            f"{', '.join(f'{k} ({v})' for k, v in scales.items())} (0: derived from",
            "rope_factor as transformers does). Copy them from the checkpoint's rope_scaling."))


@dataclass(frozen=True)
class Rope:
    """Rotary frequency settings (the `config.model.rope_*` fields of a Llama)."""

    theta: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192
    # yarn only (transformers' names without `rope_`); 0 for the attention terms: not given.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    explicit_attention_factor: float = 0.0

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
        if self.scaling == "yarn":
            return self._yarn(inv_freq, head_dim)
        return inv_freq

    @property
    def attention_factor(self) -> float:
        """What the rotation multiplies q and k by (transformers' `attention_scaling` on cos and
        sin): 1 except for YaRN, where longer contexts sharpen the softmax by this squared."""
        if self.scaling != "yarn":
            return 1.0
        if self.explicit_attention_factor:
            return self.explicit_attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    @property
    def score_scale(self) -> float:
        """The factor DeepSeek-V2/V3's attention multiplies its softmax scale by under YaRN
        (transformers' `yarn_apply_mscale`: the mscale_all_dim term squared); 1 otherwise.
        Not applied by `rotary`: an attention component that follows DeepSeek applies it."""
        if self.scaling != "yarn" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    def _yarn(self, inv_freq: jax.Array, dim: int) -> jax.Array:
        """YaRN's blend: dimension i keeps its frequency (extrapolates) where the ramp is 0,
        is divided by `factor` (interpolates) where it is 1, linearly between."""
        def correction(rotations: float) -> float:
            return (dim * math.log(self.original_max_len / (rotations * 2 * math.pi))
                    / (2 * math.log(self.theta)))

        low, high = correction(self.beta_fast), correction(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return inv_freq / self.factor * (1 - extrapolation) + inv_freq * extrapolation

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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-scale term: 0.1 mscale ln(factor) + 1, 1 without extension."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary(x_BTHD: jax.Array, positions_BT: jax.Array, rope: Rope | float) -> jax.Array:
    """Rotary embedding in the "rotate half" layout (the Hugging Face Llama convention).

    `rope` may be a bare theta (plain frequencies) for callers without a scaling. YaRN's
    `attention_factor` multiplies cos and sin, as transformers does.
    """
    rope = rope if isinstance(rope, Rope) else Rope(theta=float(rope))
    inv_freq_d = rope.inv_frequencies(x_BTHD.shape[-1])
    angles_BTd = positions_BT[..., None].astype(jnp.float32) * inv_freq_d[None, None, :]
    angles_BTD = jnp.concatenate([angles_BTd, angles_BTd], axis=-1)[:, :, None, :]
    x = x_BTHD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos_BTD, sin_BTD = jnp.cos(angles_BTD), jnp.sin(angles_BTD)
    if (scale := rope.attention_factor) != 1.0:
        cos_BTD, sin_BTD = cos_BTD * scale, sin_BTD * scale
    return (x * cos_BTD + rotated * sin_BTD).astype(x_BTHD.dtype)
