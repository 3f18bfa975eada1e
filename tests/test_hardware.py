"""The one hardware table (`jaxscale.hardware`): every chip sourced, and every reader (MFU, the
Llama presets, ahead-of-time compilation and its estimate) reading the same numbers.

The libtpu test asks the installed TPU compiler for the device kind of each generation's
compile-only devices and for the HBM it lets a program use, so that the table cannot drift from
the compiler (run in a subprocess: libtpu is never loaded in the test process).
"""

import json
import math

import pytest

from aot_common import libtpu_test, run
from configs import llama
from jaxscale import hardware
from jaxscale.aot.roofline import estimate
from jaxscale.aot.topology import TOPOLOGIES, parse_topology
from jaxscale.hardware import CHIPS, TPUS, GiB, chip_of, peak_flops
from jaxscale.observe.metrics import mfu


def test_every_chip_has_its_numbers_and_their_source():
    for key, chip in CHIPS.items():
        assert chip.device_kinds and chip.source and math.isfinite(chip.peak_bf16_flops), key
        assert chip_of(f"maker {chip.name} 80GB") is chip, key  # found inside vendor strings
    for gen, chip in TPUS.items():
        assert chip.source.startswith("https://cloud.google.com/tpu/docs/"), gen
        assert gen in TOPOLOGIES and chip.generation == gen
        assert chip.hbm_bytes and chip.usable_hbm_bytes and chip.ring_bandwidth > 0, gen
        assert chip.dcn_bytes_s and chip.torus_dims in (2, 3) and chip.max_chips, gen
        # libtpu's usable HBM differs from the documented capacity by a few percent, not more.
        assert 0.9 < chip.usable_hbm_bytes / chip.hbm_bytes < 1.1, gen
    assert set(TOPOLOGIES) == set(TPUS)
    # The peak views are the table's numbers, one per device kind.
    assert hardware.PEAK_FLOPS == {
        "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
        "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12, "A100": 312e12,
        "H100": 989e12, "H100 PCIe": 756e12, "H200": 989e12}
    assert chip_of("TPU v5 lite") is TPUS["v5e"] and chip_of("TPU v5") is TPUS["v5p"]
    assert chip_of("NVIDIA H100 PCIe") is CHIPS["h100-pcie"] and chip_of("cpu") is None
    with pytest.raises(ValueError, match="H100"):
        _ = CHIPS["h100"].ring_bandwidth  # a GPU has no TPU ring


def test_mfu_the_planner_and_the_presets_read_the_same_chip():
    for gen, chip in TPUS.items():
        topology = parse_topology(f"{gen}:{TOPOLOGIES[gen][0]}")
        assert topology.chip is chip
        # A step at the chip's peak for one second: MFU 1 as logged, and as estimated.
        assert mfu(chip.peak_bf16_flops, 1.0, 1, chip.name) == pytest.approx(1.0)
        est = estimate(topology.chip, chip.peak_bf16_flops, [], chip.peak_bf16_flops)
        assert est.compute_s == pytest.approx(1.0) and est.mfu_full_overlap == pytest.approx(1.0)
        assert peak_flops(chip.name) == topology.chip.peak_bf16_flops
    # A preset's target reads its chip's HBM: the documented capacity (v5e's 16 GB is 14.90
    # GiB), and what a compiled step may fill, libtpu's limit less the 10% margin (v4: 0.9 x
    # 30.75 GiB; an H100 has no compiler limit in the table: 0.9 x its 80 GiB).
    gib = {name: (t.hbm_gib, t.budget_gib) for name, t in llama.TARGETS.items()}
    assert gib["v4-8"] == pytest.approx((32.0, 27.675))
    assert gib["v5e-16"] == pytest.approx((14.9012, 14.175), abs=1e-4)
    assert gib["h100x8"] == pytest.approx((80.0, 72.0))
    for name, target in llama.TARGETS.items():
        assert target.gpu == (target.topology is None), name
        if target.topology:
            assert parse_topology(target.topology).chip is CHIPS[target.chip], name


_PROBE = """
import json, re
from jaxscale.aot.topology import TOPOLOGIES, parse_topology, topology_devices
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

def too_big(x):  # 64 GiB of float32 temporaries that no fusion removes (a sort)
    n = jnp.arange(1 << 17, dtype=x.dtype)
    return jnp.sort(x[0] * n[:, None] - n[None, :] * n[:, None], axis=-1)[::1024, ::1024]

found = {}
for gen, shapes in TOPOLOGIES.items():
    devices = topology_devices(parse_topology(f"{gen}:{shapes[0]}"))
    x = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=NamedSharding(Mesh(devices[:1], "x"), P()))
    try:
        jax.jit(too_big).lower(x).compile()
        available = None
    except Exception as e:
        available = re.search(r"available HBM \\(([\\d.]+)G\\)", str(e)).group(1)
    found[gen] = [devices[0].device_kind, available]
print(json.dumps(found))
"""


@libtpu_test
def test_the_table_is_what_libtpu_reports(tmp_path):
    proc = run(["-c", _PROBE], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for gen, (device_kind, available) in found.items():
        assert chip_of(device_kind) is TPUS[gen], (gen, device_kind)
        assert float(available) * GiB == TPUS[gen].usable_hbm_bytes, (gen, available)


def test_usable_hbm_is_the_compilers_limit_where_reported_else_the_table():
    """A live device's runtime limit wins; compile-only devices (no stats, or an error) fall
    back to the table's libtpu limit; the planner judges fit against the compiler's limit
    (v6e: 31.24 GiB usable where the documented 32 GB is 29.8 GiB)."""
    from jaxscale.aot.plan import fits
    from jaxscale.aot.topology import usable_hbm_bytes

    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats

    v6e = TPUS["v6e"]
    assert usable_hbm_bytes([Device({"bytes_limit": 30 * GiB})], v6e) == 30 * GiB
    for stats in (None, {}, RuntimeError("compile-only")):
        assert usable_hbm_bytes([Device(stats)], v6e) == 31.24 * GiB
    step = {"total_bytes": 30 * GiB, "hbm_bytes": v6e.hbm_bytes}
    assert not fits(step, 0.0) and fits({**step, "hbm_limit_bytes": 31.24 * GiB}, 0.0)
    # With the default 10% margin: 28.116 GiB of v6e's 31.24 may be filled.
    assert not fits({**step, "hbm_limit_bytes": 31.24 * GiB})
    assert fits({**step, "total_bytes": 28.1 * GiB, "hbm_limit_bytes": 31.24 * GiB})


def test_one_definition_of_fits_with_one_margin():
    from jaxscale.hardware import HBM_MARGIN, fits, hbm_budget
    assert HBM_MARGIN == 0.1 and hbm_budget(100.0) == pytest.approx(90.0)
    assert fits(90.0, 100.0) and not fits(90.5, 100.0) and fits(100.0, 100.0, margin=0.0)
