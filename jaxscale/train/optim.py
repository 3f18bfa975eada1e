"""Optimizers by name (optax), the learning-rate schedule and gradient clipping.

`OPTIMIZERS` is the registry: a config name maps to one function building the optax
transformation from `config.optim`. Every optimizer is wrapped with global-norm clipping and
uses a linear-warmup + cosine-decay schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from jaxscale.errors import ConfigError, paragraph


def schedule(optim_cfg: Any, total_steps: int) -> optax.Schedule:
    warmup = min(optim_cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim_cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=optim_cfg.lr * optim_cfg.min_lr_ratio)


def _adamw(c: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.adamw(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay)


def _lamb(c: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.lamb(lr, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay)


def _adafactor(c: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.adafactor(lr, weight_decay_rate=c.weight_decay or None)


def _sgd(c: Any, lr: optax.Schedule) -> optax.GradientTransformation:
    return optax.sgd(lr, momentum=c.momentum or None, nesterov=bool(c.momentum))


OPTIMIZERS: dict[str, Callable[[Any, optax.Schedule], optax.GradientTransformation]] = {
    "adamw": _adamw, "lamb": _lamb, "adafactor": _adafactor, "sgd": _sgd,
}


def make_optimizer(optim_cfg: Any, total_steps: int) -> tuple[optax.GradientTransformation,
                                                             optax.Schedule]:
    """Returns (clipped optimizer, its learning-rate schedule) for `config.optim`."""
    if optim_cfg.name not in OPTIMIZERS:
        raise ConfigError(paragraph(
            f"Unknown optimizer optim.name={optim_cfg.name!r}.",
            f"Valid names: {', '.join(OPTIMIZERS)}.",
        ))
    lr = schedule(optim_cfg, total_steps)
    chain = [optax.clip_by_global_norm(optim_cfg.clip_norm)] if optim_cfg.clip_norm else []
    return optax.chain(*chain, OPTIMIZERS[optim_cfg.name](optim_cfg, lr)), lr
