"""Process set-up shared by the entry points: simulated CPU devices and multi-host init.

These must run before JAX initialises its backends (the first `jax.devices()` call), which is
why entry points call `setup()` first thing in `main`.
"""

from __future__ import annotations

import os

from absl import flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_integer("cpu_devices", None, "Simulate N CPU devices (testing meshes on CPU).")


def set_cpu_devices(n: int | None) -> None:
    """Makes the CPU backend expose `n` devices; a no-op for None."""
    if not n:
        return
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(n))


def setup() -> None:
    # absl INFO lines from orbax/grain would drown the progress bar; warnings still show.
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    set_cpu_devices(FLAGS.cpu_devices)
