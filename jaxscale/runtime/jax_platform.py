"""Which JAX platform a command starts, chosen before JAX initialises its backends.

JAX starts every platform it finds installed. libtpu is installed wherever `jaxscale compile`
and `plan` are wanted (they compile for TPU topologies on any machine), and on a machine with no
TPU chip it still starts and prints libtpu's warnings and INVALID_ARGUMENT lines before JAX
falls back to the CPU: a dozen lines of noise above a CPU run's output, which read like a
failure. So a command that runs on whatever the machine has (`train`, `evaluate`, `generate`,
`inspect`) starts the CPU backend alone when nothing else could run: no TPU chip on the PCI bus
(the same scan JAX itself makes before it starts libtpu) and no other accelerator plugin
installed. A platform the user chose (`JAX_PLATFORMS`, `--cpu_devices`) is always kept.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import sys
from importlib.metadata import entry_points


def host_only() -> None:
    """For a command that needs no accelerator (`convert`): JAX runs on the host CPU unless
    the user chose a platform, so libtpu does not start (and print INVALID_ARGUMENT lines on a
    machine that is no TPU VM, or take a TPU another process holds)."""
    if os.environ.get("JAX_PLATFORMS"):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:
        import jax
        jax.config.update("jax_platforms", "cpu")


def cpu_when_no_accelerator() -> None:
    """Runs on the CPU alone when the CPU is all this machine could run on, so an installed
    libtpu does not start on a machine without a TPU (the module docstring says why)."""
    if not _chosen_in_config() and only_cpu_usable():
        host_only()  # which keeps a JAX_PLATFORMS the user set


def only_cpu_usable() -> bool:
    """Whether the CPU is the one platform that could start: libtpu finds no TPU chip and no
    other accelerator plugin (CUDA, ROCm, ...) is installed. False when unsure."""
    return not _tpu_chips_attached() and not _accelerator_plugins()


def _chosen_in_config() -> bool:
    if "jax" not in sys.modules:
        return False
    import jax
    return bool(jax.config.jax_platforms)


def _tpu_chips_attached() -> bool:
    """Whether a TPU chip is on this machine's PCI bus (True where it cannot be told)."""
    if importlib.util.find_spec("libtpu") is None:
        return False
    try:
        from jax._src import hardware_utils  # JAX's own scan, as it runs before libtpu starts
        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except (ImportError, AttributeError, OSError):
        return True


def _accelerator_plugins() -> bool:
    """Whether a PJRT plugin other than libtpu is installed (JAX finds them as entry points
    of the `jax_plugins` group or modules of the `jax_plugins` namespace package)."""
    if list(entry_points(group="jax_plugins")):
        return True
    spec = importlib.util.find_spec("jax_plugins")
    locations = spec.submodule_search_locations if spec else None
    return bool(locations and any(pkgutil.iter_modules(list(locations))))
