"""The compiler's stand-in for test_plan's search with a compiling process that dies. A module
of its own that imports next to nothing: the search's compiling processes are spawned, and
each imports the module of the function it runs (test_plan's imports take a spawned process
about 2 s; this module's, none)."""

import json
import os
import time

DYING = ("none", "dots_no_batch")  # the second and fourth in the tiny search order


def dies(config_json: str) -> bool:
    return json.loads(config_json)["model"]["remat"] in DYING


def compile_or_die(config_json: str, topology, cache_dir: str) -> dict:
    """A stand-in for the compiler, to test the search's handling of its processes: the worker
    dies at once on the candidates with a `DYING` remat (the second and fourth in search order),
    and elsewhere answers after a second (so that it is still compiling when its
    neighbour dies) with a result over HBM, so that the search compiles its candidates in order
    (what one that fits rules out is not under test here)."""
    if dies(config_json):
        os._exit(1)  # a compile killed mid-way (out of memory, a libtpu crash)
    time.sleep(1.0)
    fsdp = json.loads(config_json)["mesh"]["fsdp"]
    return {"total_bytes": 2.0**31, "hbm_bytes": 2.0**30,
            "estimate": {"full_overlap_s": 1.0 / fsdp, "no_overlap_s": 1.0,
                         "mfu_full_overlap": None}}
