"""A run's checkpoints: the resume from the newest step (the local tier's if it is at least as
new as the persistent tier's) and the hooks that save to both tiers.

Why one function: the order matters. The tiers are opened (the local tier's directory checked
and its leftovers removed) before anything is restored, the restore comes before any hook
saves, and the persistent save hook runs first among the hooks (`train.hooks.ORDER`).
`train.loop.prepare` calls `attach_checkpoints` once the run holds its workdir's lock.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from jaxscale.data.registry import check_resize
from jaxscale.train.hooks import CheckpointHook, Interval


def attach_checkpoints(trainer: Any) -> None:
    """Resumes from the newest checkpoint, local tier first (`_resume`), and saves
    periodically: every `checkpoint.every` steps / `every_minutes` to the workdir, and at the
    end (both 0: only when pre-empted, never at the end), and to the local tier if
    `checkpoint.local_dir` is set."""
    from jaxscale.train.checkpoint import Checkpointer

    c, lora = trainer.config.checkpoint, trainer.config.get("lora")
    checkpointer = Checkpointer(trainer.workdir, c.every, c.keep)
    tier = None
    if c.get("local_dir"):
        from jaxscale.train.local_tier import LocalTier, LocalTierHook
        tier = LocalTier(c.local_dir, c.local_every, c.local_keep, trainer.workdir)
        trainer.hooks.append(LocalTierHook(
            tier, Interval(c.local_every, c.get("local_every_minutes", 0.0)),
            trainer.config.train.skip_nonfinite, trainer.events, c.every))
    _resume(trainer, checkpointer, tier)
    adapters_only = bool(lora and lora.rank and lora.get("save_adapters_only", False))
    trainer.hooks.insert(0, CheckpointHook(checkpointer, trainer.config.train.skip_nonfinite,
                                           adapters_only, c.get("every_minutes", 0.0),
                                           events=trainer.events))


def _resume(trainer: Any, checkpointer: Any, tier: Any) -> None:
    """Restores the newest step complete on every process's local tier if it is at least as
    new as the persistent one, else the newest persistent step (a broken newer one is
    skipped); one line names the step and the tier."""
    persistent = checkpointer.latest_step()
    began, why, restored = time.monotonic(), "", None
    if tier is not None:
        from jaxscale.train.local_tier import restore_newest
        restored, why = restore_newest(tier, persistent, trainer.state, trainer.shardings)
    if restored is not None:
        step, trainer.state, trainer.data_state, note = restored
        where, name = f"step {step} of the local tier {tier.directory}", "local"
        where += f" ({note})" if note else ""
    elif persistent is not None:
        trainer.state, trainer.data_state = checkpointer.restore(trainer.state, trainer.shardings)
        step = int(jax.device_get(trainer.state.step))
        saved = checkpointer.saved_processes
        if saved and not check_resize(trainer.config, saved, jax.process_count()):
            trainer.data_state = None  # accepted: the source restarts from its beginning
        where, name = f"{checkpointer.directory}/{step} (persistent tier", "persistent"
        where += f"; the local tier {why})" if tier is not None else ")"
    else:
        if tier is not None:
            tier.drop_after(0)
        return
    if tier is not None:
        tier.drop_after(step)
    trainer.events.record("restore", step=step, tier=name,
                          seconds=round(time.monotonic() - began, 6))
    if trainer.is_primary:
        print(f"jaxscale: resumed from {where}", flush=True)
