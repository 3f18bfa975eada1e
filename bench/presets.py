"""Every TPU preset of `configs/llama.py`, sized by the TPU compiler (libtpu, nothing runs).

For each SIZE and TPU TARGET, compiles `llama.build(SIZE, TARGET, micro)` for the target's
topology at each power-of-two micro-batch (sequences per chip at once; gradient accumulation
keeps the global batch), largest first, and keeps the first that fits (`aot.plan.fits`: `hardware.HBM_MARGIN` of the HBM libtpu lets a
program use left free, as the planner judges): fewer micro-batches mean fewer FSDP weight gathers
per step.
Prints a markdown table (the presets table of bench/RESULTS.md) and the `COMPILED` entries for
`configs/llama.py`. Results are cached like the planner's (`--cache_dir`), so a rerun is quick.
With `--check`, compiles each preset as `configs/llama.py` now sets it (one compile each; how
long the 21 take is in bench/RESULTS.md) and exits 1 naming any that no longer fits or needs
other memory than `COMPILED` records; `--json` writes the results.

    python bench/presets.py [--sizes=tiny,125m,1b,7b] [--targets=v5e-16,...] [--workers=1]
    python bench/presets.py --check [--variants="1b,v5e-8;7b,v5e-16"] [--json=presets.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxscale.aot.topology import compile_only_env
from jaxscale.compat import memory_drifted

compile_only_env()

from configs import llama


def choose(size: str, target: str, cache_dir: str) -> dict:
    """In a worker process: the largest micro-batch that fits with the margin, and its result
    (micro 0 and the result at 1 when none fits)."""
    from jaxscale.aot.plan import fits
    from jaxscale.aot.search import compile_cached
    from jaxscale.aot.topology import parse_topology

    topology = parse_topology(llama.TARGETS[target].topology)
    per_chip = _per_chip(size, target)
    micros = [m for m in (1 << k for k in range(per_chip.bit_length() - 1, -1, -1))
              if per_chip % m == 0]
    tried = []
    for micro in micros:
        config = llama.build(size, target, micro)
        r = compile_cached(json.dumps(config.to_dict(), default=list), topology, cache_dir)
        tried.append((micro, r))
        if "error" in r or fits(r):
            return {"size": size, "target": target, "micro": micro, "result": r, "tried": tried}
    return {"size": size, "target": target, "micro": 0, "result": tried[-1][1], "tried": tried}


def _per_chip(size: str, target: str) -> int:
    """Sequences per chip and step: the accumulation the preset needs at micro-batch 1."""
    return llama.build(size, target, 1).train.grad_accum


def check(variant: str, cache_dir: str) -> dict:
    """In a worker process: the preset as configured, compiled for its target's topology."""
    from jaxscale.aot.search import compile_cached
    from jaxscale.aot.topology import parse_topology

    size, target = llama.parse_arg(variant)
    config = llama.get_config(variant)
    topology = parse_topology(llama.TARGETS[target].topology)
    r = compile_cached(json.dumps(config.to_dict(), default=list), topology, cache_dir)
    micro = llama.micro_batch(size, target)
    return {"size": size, "target": target, "micro": micro, "result": r, "tried": [(micro, r)]}


def row(found: dict) -> str:
    """One markdown row: the preset, its slice, micro-batch x accumulation, compiled memory,
    the step-time estimate and the compiles it took."""
    size, target, micro, r = found["size"], found["target"], found["micro"], found["result"]
    t = llama.TARGETS[target]
    gib = lambda n: f"{n / 2**30:.2f}"
    if "error" in r:
        return f"| `{size},{target}` | {t.topology} | - | - | failed: {r['error']} | | | |"
    accum = _per_chip(size, target) // micro if micro else "-"
    mesh = ("data" if llama.SIZES[size].strategy == "dp" else "fsdp") + f"={t.devices}"
    e = r.get("estimate")
    step = f"{_ms(e['full_overlap_s'])}..{_ms(e['no_overlap_s'])}" if e and micro else "-"
    mfu = f"{e['mfu_full_overlap']:.0%}" if e and micro and e["mfu_full_overlap"] else "-"
    total = gib(r["total_bytes"]) + ("" if micro else " at 1: does not fit") + (
        " (libtpu refused: temporaries alone)" if "over_hbm" in r else "")
    compile_s = sum(x.get("compile_s", 0.0) for _, x in found["tried"])
    return (f"| `{size},{target}` | {t.topology} | {mesh} | {micro or '-'} x {accum} | {total} |"
            f" {gib(r['hbm_bytes'])} | {step} | {mfu} | {len(found['tried'])}, "
            f"{compile_s:.0f} s |")


def _ms(seconds: float) -> str:
    """Milliseconds with the digits that matter, from 0.005 to 23,739."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.3f}"


def compiled_entry(found: dict) -> str:
    """The `COMPILED` line of configs/llama.py for one SIZE,TARGET."""
    r, micro = found["result"], found["micro"]
    e = r.get("estimate") or {"full_overlap_s": 0.0, "no_overlap_s": 0.0}
    ms = lambda s: f"{s * 1e3:.0f}" if s >= 1 else f"{s * 1e3:.4g}"
    step = f"({ms(e['full_overlap_s'])}, {ms(e['no_overlap_s'])})" if micro else "(0, 0)"
    return (f"    ({found['size']!r}, {found['target']!r}): "
            f"Compiled({micro}, {r['total_bytes'] / 2**30:.2f}, {step}),")


def tpu_variants(sizes: list[str], targets: list[str], existing: bool
                 ) -> list[tuple[str, str]]:
    """(size, target) pairs: the presets that exist (`--check`), else every pair whose FSDP
    shards divide the embed dimension, to ask the compiler which fit."""
    if existing:
        return [llama.parse_arg(v) for v in llama.VARIANTS
                if "," in v and v.split(",")[0] in sizes and v.split(",")[1] in targets]
    return [(s, t) for s in sizes for t in targets
            if not (llama.SIZES[s].strategy == "fsdp"
                    and llama.SIZES[s].model["embed"] % llama.TARGETS[t].devices)]


def problems(found: list[dict]) -> list[str]:
    """--check: each preset that failed to compile, leaves less than the margin of HBM free,
    or needs other memory than `COMPILED` records (0.02 GiB either way under the jax it was
    recorded with; under another jax only the fit counts: `compat.memory_drifted`)."""
    from jaxscale.aot.plan import fits, usable
    from jaxscale.hardware import HBM_MARGIN, hbm_budget

    out = []
    for x in found:
        name, r = f"{x['size']},{x['target']}", x["result"]
        recorded = llama.COMPILED[(x["size"], x["target"])].gib
        if "error" in r:
            out.append(f"{name}: {r['error']}")
        elif not fits(r):
            out.append(f"{name}: {r['total_bytes'] / 2**30:.2f} GiB per chip is over the "
                       f"{hbm_budget(usable(r)) / 2**30:.2f} GiB budget ({HBM_MARGIN:.0%} of "
                       f"{usable(r) / 2**30:.2f} GiB free)")
        elif memory_drifted(r["total_bytes"] / 2**30, recorded):
            out.append(f"{name}: the compiler now needs {r['total_bytes'] / 2**30:.2f} GiB per "
                       f"chip, COMPILED records {recorded:.2f}")
    return out


def main() -> None:
    """Prints the table (and `COMPILED`, unless --check); --json writes every result. With
    --check, exits 1 naming each preset that no longer fits as recorded."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(llama.SIZES))
    tpu = [name for name, t in llama.TARGETS.items() if t.topology]
    parser.add_argument("--targets", default=",".join(tpu))
    parser.add_argument("--variants", default=None, help="SIZE,TARGET;... instead of sizes x "
                        "targets")
    parser.add_argument("--check", action="store_true", help="compile the presets as set")
    parser.add_argument("--json", default=None, help="write {variant: result} here")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cache_dir", default=os.path.expanduser("~/.cache/jaxscale/plan"))
    args = parser.parse_args()
    jobs = ([llama.parse_arg(v) for v in args.variants.split(";")] if args.variants else
            tpu_variants(args.sizes.split(","), args.targets.split(","), args.check))
    print("| preset | topology | mesh | micro-batch x accumulation | compiled GiB/chip | "
          "HBM GiB | step ms ESTIMATE | MFU (est.) | compiles, s |")
    print("|---|---|---|---|---:|---:|---|---:|---|")
    found = []
    ctx = multiprocessing.get_context("spawn")  # libtpu and jax are not fork-safe
    with cf.ProcessPoolExecutor(args.workers, mp_context=ctx,
                                initializer=compile_only_env) as pool:
        tasks = ([pool.submit(check, f"{s},{t}", args.cache_dir) for s, t in jobs] if args.check
                 else [pool.submit(choose, s, t, args.cache_dir) for s, t in jobs])
        for task in tasks:
            found.append(task.result())
            print(row(found[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{x['size']},{x['target']}": x["result"] for x in found}, f)
    if args.check:
        wrong = problems(found)
        print("\n".join(["", *wrong]) if wrong else f"\nall {len(found)} presets fit as recorded")
        sys.exit(1 if wrong else 0)
    print("\nCOMPILED = {")
    print("\n".join(compiled_entry(f) for f in found if "error" not in f["result"]))
    print("}")


if __name__ == "__main__":
    main()
