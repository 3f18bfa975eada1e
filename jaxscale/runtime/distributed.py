"""Process set-up shared by the entry points: simulated CPU devices and multi-host init.

These must run before JAX initialises its backends (the first `jax.devices()` call), which is
why entry points call `setup()` first thing in `main`. Multi-host runs join with
`jax.distributed.initialize`: from explicit flags (local multi-process, any cluster), or by
JAX's own detection on TPU pods, under SLURM and under Open MPI.

A host that does not join must not leave the others hanging or dying with a C++ abort: when
JAX's join deadline passes, its runtime terminates the process from C++ (`LOG(FATAL)`), which
Python cannot catch. So a watchdog thread (`_JoinWatchdog`) fires a little before that
deadline, names the process(es) that did not come, and exits with status 2 like every other
user-facing error.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
from typing import Any

from absl import flags

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.runtime import jax_platform

FLAGS = flags.FLAGS

# JAX's own join deadline is set this much later than ours, so that our clear message (not
# the runtime's abort) is what a user sees when a host is missing.
_JAX_DEADLINE_MARGIN_S = 60
# Exit status of a run stopped by a user-facing error (as `errors.exit_on_user_error`).
_ERROR_EXIT = 2


class DistributedError(JaxscaleError):
    """The processes of a multi-host run did not come together as expected."""


def define_flags() -> None:
    flags.DEFINE_integer("cpu_devices", None, "Simulate N CPU devices (testing meshes on CPU).")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
    flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-host run.")
    flags.DEFINE_integer("process_id", None, "This process's index in [0, num_processes).")
    flags.DEFINE_integer("initialization_timeout", 300, "Seconds to wait for all hosts to join.")


def set_cpu_devices(n: int | None) -> None:
    """Makes the CPU backend expose `n` devices; a no-op for None. Zero or fewer is refused
    (it used to be ignored silently, leaving a run on devices the user did not ask for)."""
    if n is None:
        return
    if n < 1:
        raise DistributedError(paragraph(
            f"--cpu_devices={n}: the number of simulated CPU devices must be at least 1 (e.g.",
            "--cpu_devices=8 to test an 8-device mesh); leave the flag out to use the real",
            "devices.",
        ))
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(n))


def worker_environment() -> dict[str, str]:
    """The environment for a process that this one starts with its own `--cpu_devices`
    (`launch.local_multihost`, a Lo-Fi job's workers): this one's, with XLA_FLAGS passed on
    (a user's dump or tuning flags reach every worker, and a test suite's compile options
    keep the workers' numbers equal to its own) but for a simulated device count, which is
    each worker's own to set."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kept = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.pop("XLA_FLAGS", ""))
    if kept.strip():  # the rest as the user wrote it (XLA reads its own quoting)
        env["XLA_FLAGS"] = " ".join(kept.split())
    return env


def detected_num_processes() -> int | None:
    """The process count of a cluster whose JAX detection finds its peers (SLURM, Open MPI,
    TPU pod), from its environment; None outside one. Used to refuse a lone process there."""
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len(hosts.split(",")) if hosts else None


def detected_cluster() -> bool:
    """True on environments where `jax.distributed.initialize()` finds its peers by itself."""
    return (detected_num_processes() or 1) > 1


def coordinator_reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at `host:port` (`[v6]:port` too)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def join_timeout_message(coordinator: str | None, num_processes: int | None,
                         process_id: int | None, timeout_s: float,
                         reachable: bool | None) -> str:
    """One paragraph naming who did not join. `reachable` is the result of probing the
    coordinator's port (None where not probed: on process 0, or with no address known)."""
    n, me = num_processes, process_id
    where = f"{socket.gethostname()}, process {'?' if me is None else me} of {n or '?'}"
    others = [i for i in range(1, n or 0) if i != me]  # process 0 is judged by the probe
    if len(others) == 1:
        missing = f"process {others[0]} never joined."
    elif others:
        missing = (f"one or more of processes {others} never joined (the coordinator does not"
                   " report which).")
    else:
        missing = "the other processes never joined."
    if reachable is False:
        what = (f"This host ({where}) could not reach the coordinator, process 0, at"
                f" {coordinator} within {timeout_s:g}s: process 0 was not started, has exited,"
                " or the address or port is wrong or blocked.")
    elif me == 0:
        what = f"The coordinator ({where}) waited {timeout_s:g}s at {coordinator}, but {missing}"
    elif reachable:
        what = (f"This host ({where}) reached the coordinator at {coordinator}, but after"
                f" {timeout_s:g}s {missing}")
    else:
        what = f"This host ({where}) did not join the run within {timeout_s:g}s."
    return paragraph(
        what, "Refusing to train alone. Start every host with the same --coordinator_address",
        "and --num_processes and a distinct --process_id in [0, num_processes), or raise",
        "--initialization_timeout if hosts start slowly.",
    )


class _JoinWatchdog:
    """Exits the process with a clear message if the join has not finished in `timeout_s`.

    `jax.distributed.initialize` blocks with the GIL released, so this thread can run while it
    waits; `os._exit` is used because the main thread is inside C++ and cannot be interrupted.
    """

    def __init__(self, coordinator: str | None, num_processes: int | None,
                 process_id: int | None, timeout_s: float):
        self.args = (coordinator, num_processes, process_id, timeout_s)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="join-watchdog", daemon=True)

    def __enter__(self) -> "_JoinWatchdog":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()

    def _watch(self) -> None:
        coordinator, n, me, timeout_s = self.args
        if self.done.wait(timeout_s):
            return
        coordinator, n, me = _fill_from_jax(coordinator, n, me)
        reachable = None if me == 0 or not coordinator else coordinator_reachable(coordinator)
        if self.done.is_set():  # joined while we probed
            return
        print(f"jaxscale: error: {join_timeout_message(coordinator, n, me, timeout_s, reachable)}",
              file=sys.stderr, flush=True)
        os._exit(_ERROR_EXIT)


def jax_state() -> Any | None:
    """JAX's distributed state: its coordination-service client, process index and count, and
    coordinator address (None where this JAX has no such object). The public API has no handle
    on it, so this is the one place that reads JAX's private `global_state`; reading it does not
    start the backends, which a run's own set-up may still be configuring."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(distributed, "global_state", None)


def coordination_client() -> Any | None:
    """The coordination-service client once `jax.distributed.initialize` has run (it also
    starts the pre-emption sync service), else None. Raises if this JAX keeps its state
    elsewhere: a multi-process run taken for a single process would save and stop out of step."""
    state = jax_state()
    if state is None:
        import jax
        raise DistributedError(paragraph(
            f"This JAX ({jax.__version__}) has no `jax._src.distributed.global_state`, which",
            "jaxscale reads to find the coordination service (pre-emption sync, multi-process",
            "saves). Install a JAX in the range pyproject.toml supports.",
        ))
    return state.client


def _fill_from_jax(coordinator: str | None, num_processes: int | None,
                   process_id: int | None) -> tuple[str | None, int | None, int | None]:
    """Under cluster auto-detection the flags are unset; JAX's partly initialised state then
    holds the detected values."""
    state = jax_state()
    if getattr(state, "coordinator_address", None) is None:
        return coordinator, num_processes, process_id  # detection itself did not finish
    return (coordinator or state.coordinator_address,
            num_processes or getattr(state, "num_processes", None),
            process_id if process_id is not None else getattr(state, "process_id", None))


def _check_flags(coordinator: str | None, num_processes: int | None,
                 process_id: int | None) -> None:
    """Explicit multi-host flags must be complete, or JAX fails with a confusing message."""
    if detected_cluster():
        return  # JAX fills in whatever is unset
    if (coordinator is None or num_processes is None or process_id is None
            or not 0 <= process_id < num_processes):
        raise DistributedError(paragraph(
            f"Incomplete multi-host flags: --coordinator_address={coordinator}",
            f"--num_processes={num_processes} --process_id={process_id}. Outside SLURM, Open",
            "MPI and TPU pods every process needs all three: the same host:port of process 0",
            "and process count everywhere, and a distinct id in [0, num_processes).",
        ))


def joins(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Whether these flags (or the cluster's environment) make this a multi-host run."""
    explicit = coordinator is not None or (num_processes or 1) > 1 or process_id is not None
    return explicit or detected_cluster()


def multi_host() -> bool:
    """`joins` for this command's flags (readable before `setup`: nothing is started)."""
    return joins(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)


def init_distributed(coordinator: str | None, num_processes: int | None,
                     process_id: int | None, timeout_s: int = 300) -> None:
    """Joins the multi-host run, or explains clearly which host did not come."""
    import jax
    if not joins(coordinator, num_processes, process_id):
        return
    _check_flags(coordinator, num_processes, process_id)
    if jax.config.jax_platforms == "cpu" or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    with _JoinWatchdog(coordinator, num_processes, process_id, timeout_s):
        try:
            jax.distributed.initialize(
                coordinator, num_processes, process_id,
                initialization_timeout=timeout_s + _JAX_DEADLINE_MARGIN_S)
        except Exception as e:  # bad arguments, backends already initialised, ...
            raise DistributedError(paragraph(
                f"Process {process_id} of {num_processes} could not join the run coordinated",
                f"at {coordinator} ({type(e).__name__}: {str(e)[:300]}).",
                "Check that every host was started with the same --coordinator_address and",
                "--num_processes, a distinct --process_id, and that the port is reachable.",
            )) from None
    expected = num_processes or detected_num_processes() or jax.process_count()
    if jax.process_count() != expected:
        raise DistributedError(paragraph(
            f"Expected {expected} processes but the run has {jax.process_count()}. Refusing to",
            "train independent copies; start every host, or drop --num_processes.",
        ))


def check_not_alone(num_processes: int | None) -> None:
    """A run told (by flag or cluster environment) to expect several hosts must not silently
    train alone: that would produce N independent copies, each logging as process 0."""
    import jax
    expected = num_processes or detected_num_processes() or 1
    if expected > 1 and jax.process_count() == 1:
        raise DistributedError(paragraph(
            f"{expected} processes were expected but this process is alone (process_count=1):",
            "the other hosts never joined. Refusing to train an independent copy; start all",
            "hosts with the same --coordinator_address.",
        ))


def setup() -> None:
    # absl INFO lines from orbax/grain would drown the progress bar; warnings still show.
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    jax_platform.cpu_when_no_accelerator()  # no libtpu start-up noise where no TPU is attached
    set_cpu_devices(FLAGS.cpu_devices)
    init_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                     FLAGS.initialization_timeout)
    check_not_alone(FLAGS.num_processes)
