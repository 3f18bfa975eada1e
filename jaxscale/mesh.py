"""Builds the device mesh from `config.mesh`: named axes, -1 fill, ICI x DCN (multi-slice) layout.

The mesh always has the axes of `MESH_AXES`, in that order; an axis of size 1 costs nothing
and keeps every rule valid on every mesh. Within a slice devices are ordered by jax's
topology-aware `mesh_utils.create_device_mesh`; across slices (DCN) each slice is one block, so
that only axes with a `dcn_*` factor > 1 ever cross the slower data-centre network.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from jaxscale.errors import MeshError, paragraph

# Outer to inner: `tensor`, `context` (sequence shards, `models/attention/sequence/context.py`) and
# `expert` (MoE experts, `models/moe/layer.py`) are innermost so tensor-parallel, ring-attention and
# all-to-all partners are the closest devices. Axes after the first `_CLASSIC` appear in
# `mesh_summary` only when larger than 1.
MESH_AXES: tuple[str, ...] = ("data", "pipeline", "fsdp", "tensor", "context", "expert")
_CLASSIC = 4


def _fill(sizes: dict[str, int], total: int, what: str) -> dict[str, int]:
    """Replaces at most one -1 so that the product of `sizes` equals `total`."""
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v == 0 or v < -1}
    if bad:
        raise MeshError(paragraph(
            f"Invalid {what} mesh sizes {bad}.",
            "Each axis size must be a positive integer, or -1 for at most one axis to absorb",
            "the remaining devices.",
        ))
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise MeshError(paragraph(
            f"The {what} mesh has more than one axis set to -1 ({', '.join(free)}).",
            "Only one axis may absorb the remaining devices; give the others explicit sizes,",
            f"e.g. --config.mesh.{free[1]}=1.",
        ))
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if total % fixed:
            raise MeshError(paragraph(
                f"Cannot fill the {what} mesh axis '{free[0]}': {total} devices are not divisible",
                f"by the product {fixed} of the other axes {sizes}.",
                "Choose axis sizes whose product divides the device count.",
            ))
        sizes = {**sizes, free[0]: total // fixed}
    if math.prod(sizes.values()) != total:
        raise MeshError(paragraph(
            f"The {what} mesh {sizes} has {math.prod(sizes.values())} devices but {total} are",
            "available. Make the product of the axis sizes equal the device count, or set one",
            "axis to -1 to absorb the rest (for example --config.mesh.data=-1). In a multi-host",
            "run the count is global: every process's devices together. To simulate CPU",
            "devices pass --cpu_devices=N (per process).",
        ))
    return sizes


def resolve_mesh_shape(mesh_cfg: Mapping[str, Any], num_devices: int) -> tuple[dict, dict]:
    """Returns (ici, dcn) axis sizes with -1 filled in, validated against `num_devices`."""
    unknown = set(mesh_cfg) - set(MESH_AXES) - {f"dcn_{a}" for a in MESH_AXES}
    if unknown:
        raise MeshError(paragraph(
            f"Unknown mesh field(s) {sorted(unknown)}.",
            f"The mesh axes are {MESH_AXES}, plus dcn_<axis> factors for multi-slice runs.",
        ))
    dcn = {a: mesh_cfg.get(f"dcn_{a}", 1) for a in MESH_AXES}
    if any(not isinstance(v, int) or v < 1 for v in dcn.values()):
        raise MeshError(paragraph(
            "DCN mesh factors must be positive integers (-1 is only allowed on ICI axes);",
            f"got {dcn}. Set each dcn_<axis> to the number of slices along that axis.",
        ))
    num_slices = math.prod(dcn.values())
    if num_devices % num_slices:
        raise MeshError(paragraph(
            f"The DCN factors {dcn} ask for {num_slices} slices, but {num_devices} devices do not",
            "split evenly into that many slices. Set the dcn_* factors so that their product",
            "equals the number of slices (TPU pods) or hosts.",
        ))
    ici = _fill({a: mesh_cfg.get(a, 1) for a in MESH_AXES}, num_devices // num_slices,
                "ICI (per-slice)")
    return ici, dcn


def _slices(devices: Sequence[Any], num_slices: int) -> list[list[Any]]:
    """Groups devices by slice: real `slice_index` where present, else contiguous blocks."""
    if num_slices == 1:
        return [list(devices)]
    if all(getattr(d, "slice_index", None) is not None for d in devices):
        groups: dict[int, list[Any]] = {}
        for d in devices:
            groups.setdefault(d.slice_index, []).append(d)
        if len(groups) != num_slices:
            raise MeshError(paragraph(
                f"The mesh asks for {num_slices} slices (product of the dcn_* factors), but the",
                f"devices report {len(groups)} slices. Set the dcn_* factors to match.",
            ))
        return [groups[k] for k in sorted(groups)]
    # Simulated slices (CPU tests, or GPU hosts): processes first, then device id.
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    per = len(ordered) // num_slices
    return [ordered[i * per:(i + 1) * per] for i in range(num_slices)]


def device_grid(ici: Mapping[str, int], dcn: Mapping[str, int],
                devices: Sequence[Any]) -> np.ndarray:
    """Arranges `devices` into an array of shape ici*dcn per axis (in MESH_AXES order)."""
    ici_shape = tuple(ici[a] for a in MESH_AXES)
    dcn_shape = tuple(dcn[a] for a in MESH_AXES)
    slice_grids = []
    for slice_devices in _slices(devices, math.prod(dcn_shape)):
        try:
            grid = mesh_utils.create_device_mesh(ici_shape, slice_devices,
                                                 allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError, AttributeError):
            # Devices without a known physical topology (CPU, simulated): keep given order.
            grid = np.asarray(slice_devices, dtype=object).reshape(ici_shape)
        slice_grids.append(grid)
    # Slice s sits at block index unravel(s, dcn_shape); within it, the ICI grid.
    blocks = np.empty(dcn_shape, dtype=object)
    for s, grid in enumerate(slice_grids):
        blocks[np.unravel_index(s, dcn_shape)] = grid
    return np.block(blocks.tolist()) if blocks.ndim else slice_grids[0]


def make_mesh(mesh_cfg: Mapping[str, Any], devices: Sequence[Any] | None = None) -> Mesh:
    """Builds the jax Mesh for `config.mesh` over `devices` (default: all global devices)."""
    devices = list(jax.devices() if devices is None else devices)
    ici, dcn = resolve_mesh_shape(mesh_cfg, len(devices))
    return Mesh(device_grid(ici, dcn, devices), MESH_AXES)


def mesh_summary(mesh: Mesh) -> str:
    """One line such as `data=2 pipeline=1 fsdp=2 tensor=2 (8 cpu devices)` (`context=N` and
    `expert=N` too when > 1)."""
    sizes = " ".join(f"{k}={v}" for i, (k, v) in enumerate(mesh.shape.items())
                     if i < _CLASSIC or v > 1)
    return f"{sizes} ({mesh.devices.size} {mesh.devices.flat[0].platform} devices)"
