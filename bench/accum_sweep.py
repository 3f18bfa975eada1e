"""Gradient accumulation compiled for every TPU generation (libtpu ahead of time, nothing runs).

For each generation in `hardware.TPUS` (a 4-chip slice of it), each mesh (FSDP, data x FSDP,
FSDP x tensor) and each `train.grad_accum`, compiles the step of a small Llama under
`bf16-mixed` (the precision whose vocabulary gradients cross devices in bf16 and are summed into
a float32 carry: the construct of issue 40) and prints one markdown row per compile: fits or
the compiler's error line, memory per chip, and the reduce-scatters and all-reduces per step.
Run it with the PYTHONPATH of another checkout to compare trees (the results of 17d7dfe and of
the fix are in bench/RESULTS.md, "Gradient accumulation on every TPU generation").

    python bench/accum_sweep.py [--models=tiny,1b] [--generations=v4,v5e,v5p,v6e]
        [--accums=2,3,4,8] [--meshes=fsdp,data_fsdp,fsdp_tensor] [--json=FILE]

`1b` is the 1B Llama cut to 2 layers (the construct does not depend on the depth); 2 sequences
a chip per micro-batch. About 5 s a compile for tiny and 20-60 s for 1b on a loaded 2-core VM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, ROOT)  # else the PYTHONPATH's checkout is the one measured

from jaxscale.aot.topology import compile_only_env

compile_only_env()

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
MESHES = {"fsdp": dict(fsdp=4, rules_preset="fsdp"),
          "data_fsdp": dict(data=2, fsdp=2, rules_preset="fsdp"),
          "fsdp_tensor": dict(fsdp=2, tensor=2, rules_preset="fsdp_tp")}
MODELS = {"tiny": ("tiny", {}), "1b": ("1b", {"model.num_layers": 2})}


def config_for(model: str, mesh: str, accum: int):
    """The model's config on `mesh` with `accum` micro-batches of 2 sequences a batch row."""
    from jaxscale.configs import llama

    size, extra = MODELS[model]
    config = llama.get_config(size)
    sizes = dict(MESHES[mesh])
    config.rules_preset = sizes.pop("rules_preset")
    for axis in ("data", "fsdp", "tensor", "pipeline", "context", "expert"):
        config.mesh[axis] = sizes.get(axis, 1)
    rows = sizes.get("data", 1) * sizes.get("fsdp", 1)
    config.data.batch_size = 2 * rows * accum
    config.train.grad_accum = accum
    config.train.eval_every = 0
    config.precision = "bf16-mixed"
    for key, value in extra.items():
        section, leaf = key.split(".")
        config[section][leaf] = value
    return config


def one(model: str, generation: str, mesh: str, accum: int) -> dict:
    from jaxscale.aot.compile import compile_step
    from jaxscale.aot.topology import parse_topology

    row = {"model": model, "generation": generation, "mesh": mesh, "grad_accum": accum}
    start = time.perf_counter()
    try:
        r = compile_step(config_for(model, mesh, accum), parse_topology(TOPOLOGIES[generation]))
    except Exception as e:
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        named = [x for x in lines if "RET_CHECK" in x or "Check failed" in x]
        return {**row, "error": (named or lines or [type(e).__name__])[0][:200],
                "s": round(time.perf_counter() - start, 1)}
    per_step = lambda kind: sum(c["bytes"] * c["executions"] for c in r.collectives
                                if c["kind"] == kind)
    in_loop = sum(c["executions"] for c in r.collectives
                  if c["kind"] == "reduce-scatter" and c["in_loop"])
    return {**row, "GiB": r.total_bytes / 2**30, "fits": r.fits,
            "reduce_scatter_MiB": per_step("reduce-scatter") / 2**20,
            "all_reduce_MiB": per_step("all-reduce") / 2**20,
            "reduce_scatters_in_loop": in_loop, "s": round(time.perf_counter() - start, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,1b")
    p.add_argument("--generations", default=",".join(TOPOLOGIES))
    p.add_argument("--accums", default="2,3,4,8")
    p.add_argument("--meshes", default=",".join(MESHES))
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import jaxscale

    print(f"jaxscale from {os.path.dirname(jaxscale.__file__)}")
    print("| model | generation | mesh | grad_accum | result | GiB/chip | reduce-scatter MiB "
          "(in-loop runs) | all-reduce MiB | compile s |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|")
    rows = []
    for model in a.models.split(","):
        for generation in a.generations.split(","):
            for mesh in a.meshes.split(","):
                for accum in map(int, a.accums.split(",")):
                    r = one(model, generation, mesh, accum)
                    rows.append(r)
                    if "error" in r:
                        print(f"| {model} | {generation} | {mesh} | {accum} | FAILED: "
                              f"`{r['error']}` | - | - | - | {r['s']} |", flush=True)
                    else:
                        print(f"| {model} | {generation} | {mesh} | {accum} | "
                              f"{'fits' if r['fits'] else 'over HBM'} | {r['GiB']:.3f} | "
                              f"{r['reduce_scatter_MiB']:.1f} ({r['reduce_scatters_in_loop']}) "
                              f"| {r['all_reduce_MiB']:.1f} | {r['s']} |", flush=True)
    failed = sum("error" in r for r in rows)
    print(f"{len(rows)} compiles, {failed} failed.")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
