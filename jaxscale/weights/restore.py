"""A training run's orbax checkpoints read as weights: which steps are complete, the newest step
that restores (falling back past broken ones with one warning), a step's parameters on one
device whatever mesh wrote it, and the fingerprint an adapters-only checkpoint keeps of its
frozen base.

Why here and not beside the saver (`jaxscale/train/checkpoint.py`): `open_weights` reads a
run's checkpoint like any other weights (fine-tuning from a workdir, evaluation, conversion),
and the train-state saver builds on these same reads, so they sit below both.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxscale.errors import JaxscaleError, paragraph, short_error
from jaxscale.storage import locations, orbax_paths
from jaxscale.storage.retry import is_outage
from jaxscale.weights.tree import flatten


class CheckpointError(JaxscaleError):
    """A checkpoint directory cannot be restored."""


class BrokenCheckpointWarning(UserWarning):
    """A newer checkpoint did not restore (truncated or corrupt files); an older one is used."""


T = TypeVar("T")


def saved_steps(root: str) -> list[int]:
    """Complete steps under a checkpoints directory (a local path, gs:// or s3://), newest
    first. Locally orbax renames a step's temporary directory to its number only once the save
    is complete; on object stores a step is complete once its commit file exists."""
    path = orbax_paths.path(root)
    if not path.is_dir():
        return []
    remote = locations.is_remote(root)
    return sorted((int(p.name) for p in path.iterdir()
                   if p.name.isdigit() and orbax_paths.is_complete(p, remote)), reverse=True)


def newest_restorable(root: str, restore: Callable[[int], T],
                      none_restores: Callable[[int, Exception], Exception] | None = None,
                      on_fallback: Callable[[list[int]], str] | None = None
                      ) -> tuple[int, T]:
    """(step, restore(step)) for the newest step that restores. Steps that fail (a torn copy,
    a disk error) are skipped with one `BrokenCheckpointWarning` naming them (plus what
    `on_fallback(broken steps)` did with them); when none restores, raises
    `none_restores(newest step, its error)` (default: a CheckpointError)."""
    # Installed before the first read, not after a failure: the echoes of a broken step's
    # abandoned reads may come from tensorstore's threads before the failure reaches us.
    orbax_paths.drop_orphaned_echoes()
    steps = saved_steps(root)
    if not steps:
        raise CheckpointError(f"No complete checkpoint under {root}; train with "
                              "--config.checkpoint.every=N to write one.")
    broken: list[tuple[int, Exception]] = []
    for step in steps:
        try:
            value = restore(step)
        except JaxscaleError:
            raise
        except Exception as e:  # any failure to read a step makes it unusable, but an outage
            if is_outage(e):    # says nothing about the step
                raise
            broken.append((step, e))
            continue
        if broken:
            names = ", ".join(f"step {s} ({short_error(e)})" for s, e in broken)
            done = on_fallback([s for s, _ in broken]) if on_fallback else (
                "Delete the broken step directory to silence this warning.")
            warnings.warn(BrokenCheckpointWarning(paragraph(
                f"Checkpoint {names} under {root} does not restore (truncated or corrupt",
                f"files); using step {step}, the newest that does.", done,
            )), stacklevel=2)
        return step, value
    step, error = broken[0]
    if none_restores is not None:
        raise none_restores(step, error) from None
    raise CheckpointError(paragraph(
        f"No checkpoint under {root} restores: step {step} fails with {short_error(error)}, and",
        "every older step fails too. The files are truncated or corrupt; restore them from a",
        "copy, or start a fresh workdir.",
    )) from None


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    from absl import logging
    level = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        yield
    finally:
        logging.set_verbosity(level)


def restore_params(root: str, step: int) -> dict:
    """The saved state of `step` (parameters, frozen base or its fingerprint, ...) as host
    arrays on one device, whatever mesh wrote it: the target is built from the checkpoint's own
    metadata (orbax refuses a target-less restore across topologies)."""
    path = orbax_paths.path(root) / str(step) / "state"
    # Closed even when the restore fails (a broken step the caller falls back past): an open
    # checkpointer's background threads would print a traceback at interpreter exit.
    with ocp.StandardCheckpointer() as checkpointer:
        with _quiet_absl():  # orbax warns that the per-item metadata file is absent: harmless
            meta = checkpointer.metadata(path).item_metadata
        if meta is None:  # orbax answers None, not an error, for a missing or empty state/
            raise FileNotFoundError(f"{path} holds no checkpoint metadata (_METADATA): the "
                                    "directory is missing or was not copied whole")
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                              dict(meta.tree if hasattr(meta, "tree") else meta))
        with _quiet_absl():
            restored = checkpointer.restore(path, target)
    return jax.device_get(restored)


@jax.jit
def base_fingerprint(frozen: Any) -> jax.Array:
    """(leaves, 3) float32 per frozen leaf (sorted by path): sum, sum of squares and a
    position-weighted sum. Identical weights agree up to reduction-order rounding on any mesh;
    independently drawn or different weights differ by about sqrt(sum of squares) per leaf."""
    rows = []
    for _, x in sorted(flatten(frozen).items()):
        x = x.astype(jnp.float32)
        ramp = sum((k + 1) * jax.lax.broadcasted_iota(jnp.float32, x.shape, k)
                   for k in range(x.ndim)) if x.ndim else jnp.ones((), jnp.float32)
        rows.append(jnp.stack([jnp.sum(x), jnp.sum(x * x), jnp.sum(x * jnp.cos(ramp))]))
    return jnp.stack(rows) if rows else jnp.zeros((0, 3), jnp.float32)


def fingerprints_match(saved: np.ndarray, current: np.ndarray) -> bool:
    """Sums within 1% of sqrt(sum of squares), sums of squares within 1e-4 relative."""
    if saved.shape != current.shape:
        return False
    norm = np.sqrt(np.maximum(saved[:, 1], 0.0)) + 1e-12
    close = lambda i: np.abs(saved[:, i] - current[:, i]) <= 1e-2 * norm
    squares = np.abs(saved[:, 1] - current[:, 1]) <= 1e-4 * np.abs(saved[:, 1]) + 1e-12
    return bool(np.all(close(0)) and np.all(close(2)) and np.all(squares))
