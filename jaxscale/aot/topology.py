"""TPU topologies by name -> compile-only devices, with libtpu and no TPU attached.

`topology_devices('v5p:4x4x8')` returns the 128 devices of a v5p-128 slice on any machine where
the optional `libtpu` package is installed (`pip install 'jaxscale[tpu]'`): jax builds them from
libtpu's topology description, and programs can be compiled for them but never run.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.hardware import TPUS, Chip

# Slice shapes by generation, named `GEN:AxBxC` as libtpu takes them (the common single-slice
# shapes of each generation's documentation page); each generation's chip is `hardware.TPUS`.
TOPOLOGIES: dict[str, tuple[str, ...]] = {
    "v4": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16"),
    "v5e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16",
            "8x16x16", "16x16x16", "16x16x24"),
    "v6e": ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
}


def known_topologies() -> list[str]:
    return [f"{gen}:{shape}" for gen, shapes in TOPOLOGIES.items() for shape in shapes]


class TopologyError(JaxscaleError):
    """An unknown topology name, or libtpu missing."""


@dataclass(frozen=True)
class Topology:
    name: str          # 'v5p:4x4x8'
    chip: Chip
    shape: tuple[int, ...]
    num_slices: int = 1

    @property
    def chips_per_slice(self) -> int:
        return math.prod(self.shape)

    @property
    def num_chips(self) -> int:
        return self.chips_per_slice * self.num_slices

    def label(self) -> str:
        return self.name + (f" x {self.num_slices} slices" if self.num_slices > 1 else "")


def parse_topology(name: str, num_slices: int = 1) -> Topology:
    """'v5p:4x4x8' -> Topology; an unknown name raises with the list of known ones."""
    gen, _, shape = name.partition(":")
    if gen not in TPUS or shape not in TOPOLOGIES.get(gen, ()):
        raise TopologyError(paragraph(
            f"Unknown TPU topology {name!r}. Known topologies (GENERATION:SHAPE, chips = the",
            f"product of the shape): {', '.join(known_topologies())}.",
        ))
    if num_slices < 1:
        raise TopologyError(f"--num_slices={num_slices} must be at least 1.")
    return Topology(name, TPUS[gen], tuple(int(x) for x in shape.split("x")), num_slices)


def slice_names(name: str) -> list[str]:
    """`--topology` of the planner: one slice ('v5p:4x4x8'), or a generation alone ('v5p'):
    each of its slices, fewest chips first (the walk for the smallest slice that fits)."""
    if name in TOPOLOGIES:
        return sorted((f"{name}:{shape}" for shape in TOPOLOGIES[name]),
                      key=lambda n: parse_topology(n).num_chips)
    return [name]


def has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def require_libtpu() -> None:
    if not has_libtpu():
        raise TopologyError(paragraph(
            "Compiling for a TPU topology needs the TPU compiler, which ships in the `libtpu`",
            "package; it is not installed here. Install it with `pip install 'jaxscale[tpu]'`",
            "(no TPU needed: programs are compiled for the topology, not run), then retry.",
        ))


# libtpu would otherwise query the GCE metadata server for the attached TPU (there is none);
# jax, unless limited to the CPU backend, would open a TPU backend, which takes libtpu's
# process lock (/tmp/libtpu_lockfile) and so refuses the planner's second compiling process.
# ALLOW_MULTIPLE_LIBTPU_LOAD lifts that lock: compiling for a topology never opens a TPU, so
# two compiling processes (the planner's, a test's, a user's second shell) cannot collide.
_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "JAX_PLATFORMS": "cpu",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def compile_only_env() -> None:
    """Sets the environment for compile-only use; call before jax initialises its backends."""
    for key, value in _ENV.items():
        os.environ.setdefault(key, value)
    if "jax" in sys.modules:  # imported already: its platforms flag was read from the env
        sys.modules["jax"].config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


def topology_devices(topology: Topology) -> list[Any]:
    """The compile-only devices of the topology, one per chip, slices in order."""
    require_libtpu()
    compile_only_env()
    from jax.experimental import topologies

    kwargs: dict[str, Any] = {}
    if topology.chip.chip_config:
        kwargs["chip_config_name"] = topology.chip.chip_config
    if topology.num_slices > 1:
        kwargs["num_slices"] = topology.num_slices
    try:
        desc = topologies.get_topology_desc(topology_name=topology.name, platform="tpu",
                                            **kwargs)
    except RuntimeError as e:
        if "lockfile" not in str(e):
            raise
        raise TopologyError(paragraph(
            "libtpu refused to load: another process on this machine holds its lock",
            "(/tmp/libtpu_lockfile). jaxscale lifts that lock for compile-only use",
            "(ALLOW_MULTIPLE_LIBTPU_LOAD=1), so either that variable was set to something",
            "else here, or a process is using a real TPU: unset the variable, or wait for",
            "that process to finish, and retry.",
        )) from None
    devices = list(desc.devices)
    if len(devices) != topology.num_chips:  # guards the one-device-per-chip assumption
        raise TopologyError(paragraph(
            f"libtpu returned {len(devices)} devices for {topology.label()}, expected one per",
            f"chip ({topology.num_chips}). This libtpu version may name topologies differently.",
        ))
    return devices


def usable_hbm_bytes(devices: list[Any], chip: Chip) -> float | None:
    """The HBM one program may use on these devices: the runtime's own limit where the device
    reports one (`memory_stats()['bytes_limit']` of a live TPU), else the table's
    (`Chip.hbm_limit_bytes`: libtpu's limit as its out-of-HBM error prints it, else the
    documented capacity). Compile-only devices report no memory stats."""
    try:
        stats = devices[0].memory_stats() if devices else None
    except Exception:  # compile-only topology devices: no runtime behind them
        stats = None
    limit = (stats or {}).get("bytes_limit")
    return float(limit) if limit else chip.hbm_limit_bytes
