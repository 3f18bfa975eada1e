"""Mesh construction: -1 fill, sizes of one, hybrid ICI x DCN layout, and bad configs."""

from dataclasses import dataclass

import jax
import numpy as np
import pytest

from jaxscale.errors import MeshError
from jaxscale.mesh import MESH_AXES, device_grid, make_mesh, resolve_mesh_shape


def test_fill_and_axis_order():
    mesh = make_mesh({"data": -1, "tensor": 2})
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == {"data": 4, "pipeline": 1, "fsdp": 1, "tensor": 2, "context": 1,
                                "expert": 1}
    assert make_mesh({"data": 1, "fsdp": -1}).shape["fsdp"] == 8


@pytest.mark.parametrize("cfg, match", [
    ({"data": 3}, "has 3 devices but 8"),
    ({"data": -1, "fsdp": -1}, "more than one axis"),
    ({"data": -1, "fsdp": 3}, "not divisible"),
    ({"data": 0}, "positive integer"),
    ({"dataa": 8}, "Unknown mesh field"),
    ({"data": -1, "dcn_data": 3}, "split evenly"),
])
def test_bad_mesh_configs(cfg, match):
    with pytest.raises(MeshError, match=match):
        make_mesh(cfg)


@dataclass(frozen=True)
class FakeDevice:
    id: int
    slice_index: int
    process_index: int = 0
    platform: str = "tpu"
    device_kind: str = "fake"


def test_hybrid_layout_keeps_slices_in_dcn_blocks():
    # 2 slices x 4 devices; data crosses slices (DCN), fsdp stays inside a slice (ICI).
    devices = [FakeDevice(i, i // 4) for i in range(8)]
    ici, dcn = resolve_mesh_shape({"data": 1, "fsdp": 4, "dcn_data": 2}, 8)
    assert ici["fsdp"] == 4 and dcn["data"] == 2
    grid = device_grid(ici, dcn, devices)
    assert grid.shape == (2, 1, 4, 1, 1, 1)
    for d in range(2):  # each data row is exactly one slice
        assert {dev.slice_index for dev in grid[d].flat} == {d}
    assert sorted(dev.id for dev in grid.flat) == list(range(8))


def test_hybrid_on_simulated_cpu_slices():
    mesh = make_mesh({"data": 1, "tensor": 2, "fsdp": 2, "dcn_data": 2})
    assert dict(mesh.shape)["data"] == 2
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # Simulated slices are contiguous device blocks: slice 0 = devices 0-3.
    assert set(ids[0].flat) == {0, 1, 2, 3} and set(ids[1].flat) == {4, 5, 6, 7}


def test_explicit_device_subset():
    mesh = make_mesh({"data": -1}, jax.devices()[:1])
    assert mesh.devices.size == 1
