"""Process set-up shared by the entry points: simulated CPU devices and multi-host init.

These must run before JAX initialises its backends (the first `jax.devices()` call), which is
why entry points call `setup()` first thing in `main`. Multi-host runs join with
`jax.distributed.initialize`: from explicit flags (local multi-process, any cluster), or by
JAX's own detection on TPU pods and under SLURM.
"""

from __future__ import annotations

import os

from absl import flags

from jaxscale.errors import JaxscaleError, paragraph

FLAGS = flags.FLAGS


class DistributedError(JaxscaleError):
    """The processes of a multi-host run did not come together as expected."""


def define_flags() -> None:
    flags.DEFINE_integer("cpu_devices", None, "Simulate N CPU devices (testing meshes on CPU).")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
    flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-host run.")
    flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
    flags.DEFINE_integer("initialization_timeout", 300, "Seconds to wait for all hosts to join.")


def set_cpu_devices(n: int | None) -> None:
    """Makes the CPU backend expose `n` devices; a no-op for None."""
    if not n:
        return
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(n))


def detected_cluster() -> bool:
    """True on environments where `jax.distributed.initialize()` finds its peers by itself."""
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
    tpu_pod = "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return slurm or tpu_pod


def init_distributed(coordinator: str | None, num_processes: int | None,
                     process_id: int | None, timeout_s: int = 300) -> None:
    """Joins the multi-host run, or explains clearly which host did not come."""
    import jax
    explicit = coordinator is not None or (num_processes or 1) > 1
    if not explicit and not detected_cluster():
        return
    if jax.config.jax_platforms == "cpu" or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   initialization_timeout=timeout_s)
    except Exception as e:  # the runtime raises bare XlaRuntimeErrors / RuntimeErrors
        raise DistributedError(paragraph(
            f"Process {process_id} of {num_processes} could not join the run coordinated at",
            f"{coordinator} within {timeout_s}s ({type(e).__name__}: {str(e)[:300]}).",
            "Check that every host was started with the same --coordinator_address and",
            "--num_processes, a distinct --process_id, and that the port is reachable.",
        )) from None
    expected = num_processes or jax.process_count()
    if jax.process_count() != expected:
        raise DistributedError(paragraph(
            f"Expected {expected} processes but the run has {jax.process_count()}. Refusing to",
            "train independent copies; start every host, or drop --num_processes.",
        ))


def check_not_alone(num_processes: int | None) -> None:
    """A run told to expect several hosts must not silently train alone."""
    import jax
    if num_processes and num_processes > 1 and jax.process_count() == 1:
        raise DistributedError(paragraph(
            f"--num_processes={num_processes} but this process is alone (process_count=1):",
            "the other hosts never joined. Refusing to train an independent copy; start all",
            "hosts with the same --coordinator_address.",
        ))


def setup() -> None:
    # absl INFO lines from orbax/grain would drown the progress bar; warnings still show.
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    set_cpu_devices(FLAGS.cpu_devices)
    init_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                     FLAGS.initialization_timeout)
    check_not_alone(FLAGS.num_processes)
