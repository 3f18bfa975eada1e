"""Checkpoints with orbax: async, sharded, multi-host safe; restore onto any mesh; no pickle.

`WORKDIR/checkpoints/<step>/` holds the train state (parameters, frozen parameters, optimizer
state, step, RNG key data, policy state) as orbax arrays and the grain data-iterator state as
JSON. Orbax writes each step into a temporary directory and renames it only when complete, so
an interrupted save is never listed. Restoring uses the *current* run's shardings as the
target, which re-shards a checkpoint saved on another mesh.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.train.state import TrainState, flatten


class CheckpointError(JaxscaleError):
    """A checkpoint directory cannot be restored."""


def _to_saveable(state: TrainState) -> dict:
    """Typed PRNG keys are stored as their raw key data (plain uint32 arrays)."""
    return {"step": state.step, "params": state.params, "frozen": state.frozen,
            "opt_state": state.opt_state, "rng": jax.random.key_data(state.rng),
            "extra": state.extra}


def _target(state: TrainState, shardings: TrainState) -> dict:
    """Abstract arrays carrying the current run's shardings: the restore target."""
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, shardings)
    rng = jax.eval_shape(jax.random.key_data, state.rng)
    out = _to_saveable(abstract.replace(rng=state.rng))
    out["rng"] = jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=shardings.rng)
    return out


class Checkpointer:
    """Saves every `every` steps (keeping `keep`) and restores the newest complete step."""

    def __init__(self, workdir: str, every: int, keep: int):
        self.every = every
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: TrainState, data_state: dict | None) -> None:
        args = ocp.args.Composite(state=ocp.args.StandardSave(_to_saveable(state)),
                                  data=ocp.args.JsonSave(data_state or {}))
        self.manager.save(step, args=args, force=True)

    def restore(self, state: TrainState, shardings: TrainState,
                step: int | None = None) -> tuple[TrainState, dict]:
        step = self.latest_step() if step is None else step
        args = ocp.args.Composite(state=ocp.args.StandardRestore(_target(state, shardings)),
                                  data=ocp.args.JsonRestore())
        try:
            restored = self.manager.restore(step, args=args)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(paragraph(
                f"Cannot restore checkpoint step {step} from {self.directory}: {e}.",
                "The saved state does not match this run's model/optimizer config; resume with",
                "the same config, or start a fresh workdir (use config.init_from for weights).",
            )) from None
        s = restored["state"]
        new = state.replace(step=s["step"], params=s["params"], frozen=s["frozen"],
                            opt_state=s["opt_state"], rng=jax.random.wrap_key_data(s["rng"]),
                            extra=s["extra"])
        return new, dict(restored["data"] or {}) or None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class CheckpointHook:
    """Loop hook: checks finiteness (never overwrite good checkpoints with NaNs), then saves."""

    def __init__(self, checkpointer: Checkpointer):
        self.checkpointer = checkpointer

    def after_step(self, trainer: Any, state: TrainState, step: int) -> None:
        if self.checkpointer.every and step % self.checkpointer.every == 0:
            trainer.check_finite(state)
            self.checkpointer.save(step, state, trainer.data_state)

    def at_end(self, trainer: Any, state: TrainState) -> None:
        step = int(jax.device_get(state.step))
        if self.checkpointer.every and self.checkpointer.latest_step() != step:
            trainer.check_finite(state)
            self.checkpointer.save(step, state, trainer.data_state)
        self.checkpointer.close()


def load_flat_params(workdir_or_checkpoints: str) -> dict:
    """Parameters of the newest checkpoint, as host arrays (for `config.init_from`)."""
    path = workdir_or_checkpoints
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    manager = ocp.CheckpointManager(os.path.abspath(path),
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    step = manager.latest_step()
    if step is None:
        raise CheckpointError(f"No complete checkpoint under {path}.")
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return {k: jax.device_get(v) for k, v in flatten(restored["state"]["params"]).items()}
