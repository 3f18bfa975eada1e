"""`jaxscale plan --topology=GEN`: a generation's slices walked fewest chips first, those whose
weights and optimizer state cannot fit even split over every chip ruled out without a compile,
and the smallest slice that fits named (`aot.topology.slice_names`, `aot.guess.state_floor_bytes`)."""

import re

import pytest

from aot_common import libtpu_test, run_module
from jaxscale.aot.topology import parse_topology


def test_a_generation_is_walked_smallest_slice_first_past_those_below_the_floor():
    # `--topology=v5p`: every v5p slice, fewest chips first. DeepSeek-V3's 671B parameters
    # with float32 weights and Adam's two moments are 12 bytes each: over 64 chips that is
    # 117 GiB a chip whatever the sharding, over the 86 GiB budget (10% of libtpu's 95.7 kept
    # free), so v5p:4x4x4 is ruled out without a compile; over 128 chips 59 GiB is not.
    from jaxscale.aot.guess import dims_of, state_floor_bytes
    from jaxscale.aot.topology import slice_names
    from jaxscale.configs import deepseek
    from jaxscale.hardware import hbm_budget

    names = slice_names("v5p")
    chips = [parse_topology(n).num_chips for n in names]
    assert names[0] == "v5p:2x2x1" and chips == sorted(chips) and len(names) == 12
    assert slice_names("v5p:4x4x8") == ["v5p:4x4x8"]
    c = deepseek.get_config("v3")
    dims = dims_of(c)
    budget = hbm_budget(parse_topology("v5p:4x4x4").chip.hbm_limit_bytes, 0.1)
    assert state_floor_bytes(c, dims, 64) == dims.num_params * 12 / 64 > budget
    assert state_floor_bytes(c, dims, 128) < budget
    c.lora.rank = 16  # the frozen base alone, in bf16
    assert state_floor_bytes(c, dims, 64) == dims.num_params * 2 / 64


@libtpu_test
@pytest.mark.exhaustive  # two 1B compiles (~2 min); the walk's ruling-out is tested without them
def test_plan_over_a_generation_names_its_smallest_slice_that_fits(tmp_path):
    # 1B on v5e: one 16 GB chip refuses it (its state alone is 13 GB), so the walk goes on to
    # v5e:2x2, where FSDP over 4 chips fits, and names it.
    proc = run_module(["launch.plan", "--topology=v5e", "--config=configs/llama.py:1b",
                       "--config.data.batch_size=4", "--max_candidates=1",
                       f"--cache_dir={tmp_path}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "candidates compiled for v5e:1x1: 0 fit" in proc.stdout
    assert re.search(r"candidates compiled for v5e:2x2: [1-9]\d* fit", proc.stdout)
    assert ("Smallest v5e slice that fits with a 10% HBM margin: v5e:2x2 (4 chips)."
            in proc.stdout)
    assert "v5e:2x4" not in proc.stdout
