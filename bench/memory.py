"""Per-device bytes of parameters + optimizer state for precision / LoRA / 8-bit Adam variants.

The ~1.1B-parameter Llama of `configs/llama.py:1b` on an 8-device CPU mesh with fsdp=8,
evaluated abstractly: the state's shapes and shardings come from `jax.eval_shape` (nothing
allocated), the per-device bytes from each leaf's shard shape, and the compiled train step's
`memory_analysis()` from lowering against abstract arguments (compiled, never run). The step is
the one `launch.train` runs (`train.build.build_step`, jitted and lowered as the loop does).
Analytic bytes per parameter are printed next to the measured ones.

    python bench/memory.py [--layers=16]
    python bench/memory.py --topology=v5p:2x2x2,v5e:4x4 [--sizes=1b,7b] [--micro_batch=1]
        [--attention=einsum,splash] [--remat=full]

With `--topology`, the 1B / 7B presets (fsdp over the slice, `--remat` (full), bf16-mixed, seq
2048, `--micro_batch` sequences per chip, each `--attention` implementation) are compiled by
libtpu for each topology ahead of time (`jaxscale.aot.compile`): per-chip arguments,
temporaries and total against the chip's HBM, and the FLOPs (splash's analytic share named).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxscale.config import base_config
from jaxscale.mesh import make_mesh
from jaxscale.models.adapters import lora
from jaxscale.train.build import batch_spec, build_step

# name: (precision, lora rank, optimizer). The analytic bytes per parameter (`analytic`) are
# computed from the shapes alone: AdamW keeps two moments in the parameter dtype; 8-bit Adam two
# int8 moments plus one float32 scale each per block of min(256, last dim) values (head_dim 64:
# 8/64 B for the attention weights); LoRA keeps the frozen base in the parameter dtype and
# (params + two moments) only for the adapters. All per parameter of the model without adapters.
VARIANTS = {
    "32-true adamw": ("32-true", 0, "adamw"),
    "bf16-mixed adamw": ("bf16-mixed", 0, "adamw"),
    "bf16-true adamw": ("bf16-true", 0, "adamw"),
    "16-mixed adamw": ("16-mixed", 0, "adamw"),
    "lora r8 (bf16-true base)": ("bf16-true", 8, "adamw"),
    "32-true adam8bit": ("32-true", 0, "adam8bit"),
}


def analytic_bytes(shapes: dict, optim: str, lora_on: bool) -> int:
    """Total bytes of params + optimizer state from the parameter shapes and dtypes alone."""
    total = 0
    for path, s in shapes.items():
        n, item = math.prod(s.shape), s.dtype.itemsize
        total += n * item
        if lora_on and not lora.is_adapter(path):
            continue  # frozen base: no optimizer state
        if optim == "adam8bit":
            last = s.shape[-1] if s.shape else 1
            blocks = math.prod(s.shape[:-1]) * math.ceil(last / min(256, last))
            total += 2 * n + 2 * 4 * blocks
        else:
            total += 2 * n * item
    return total


def config_1b(layers: int):
    """The model of `configs/llama.py:1b` (remat full) on fsdp=8, with a small batch: the
    bench compares stored state, which the batch does not change."""
    from configs.llama import SIZES
    c = base_config()
    c.model.update(SIZES["1b"].model, num_layers=layers, remat="full")
    c.mesh.update(data=1, fsdp=8)
    c.data.update(batch_size=8, seq_len=512)
    c.lora.targets = ("attn/w[qkvo]$", "mlp/w_")
    return c


def device_bytes(tree) -> tuple[int, int]:
    """(bytes one device holds, of which in fully replicated leaves) of an abstract tree whose
    leaves carry shardings."""
    total = replicated = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        nbytes = math.prod(shard) * leaf.dtype.itemsize
        total += nbytes
        replicated += nbytes if tuple(shard) == tuple(leaf.shape) and leaf.size > 1 else 0
    return total, replicated


def measure(c, precision: str, rank: int, optim: str) -> dict:
    c.precision, c.lora.rank, c.optim.name = precision, rank, optim
    setup = build_step(c, make_mesh(c.mesh))
    abstract, shardings = setup.abstract_state()
    start = time.perf_counter()
    lowered = setup.lower(batch_spec(c), (abstract, shardings))
    memory = lowered.compile().memory_analysis()
    params, params_repl = device_bytes((abstract.params, abstract.frozen))
    opt, opt_repl = device_bytes(abstract.opt_state)
    shapes = setup.ctx.model_def.shapes()
    n = sum(math.prod(s.shape) for p, s in shapes.items() if not lora.is_adapter(p))
    return {"n": n, "params": params, "opt": opt, "repl": params_repl + opt_repl,
            "analytic": analytic_bytes(shapes, optim, bool(rank)) / n,
            "args": memory.argument_size_in_bytes, "temp": memory.temp_size_in_bytes,
            "compile_s": time.perf_counter() - start}


def tpu_table(topologies: str, sizes: str, micro_batch: int, attentions: str = "einsum",
              remat: str = "full") -> None:
    """The presets compiled by the TPU compiler for each topology and attention kernel."""
    from configs import llama
    from jaxscale.aot.compile import compile_step
    from jaxscale.aot.report import step_estimate
    from jaxscale.aot.topology import parse_topology

    gib = lambda b: f"{b / 2**30:7.2f}"
    print(f"| {'preset':5s} | {'attention':9s} | {'topology':10s} | {'mesh':>8s} | "
          f"{'batch':>5s} | {'args':>7s} | {'temp':>7s} | {'total':>7s} | {'HBM':>7s} | fits | "
          f"{'FLOPs/chip':>10s} | {'of which analytic':>17s} | {'step ms (estimate)':>18s} | "
          f"compile s |")
    print("|" + "|".join("-" * w for w in (7, 11, 12, 10, 7, 9, 9, 9, 9, 6, 12, 19, 20, 11))
          + "|")
    for name in topologies.split(","):
        topo = parse_topology(name)
        for size in sizes.split(","):
            for attention in attentions.split(","):
                c = llama.get_config(size)
                c.mesh.update(data=1, fsdp=topo.num_chips)
                c.data.batch_size = micro_batch * topo.num_chips
                c.model.update(attention=attention, remat=remat)
                c.precision = "bf16-mixed"
                r = compile_step(c, topo)
                e = step_estimate(r)
                print(f"| {size:5s} | {attention:9s} | {name:10s} | fsdp={topo.num_chips:<3d} | "
                      f"{c.data.batch_size:>5d} | {gib(r.argument_bytes)} | {gib(r.temp_bytes)} | "
                      f"{gib(r.total_bytes)} | {gib(r.hbm_bytes)} | "
                      f"{'yes' if r.fits else 'NO':4s} | "
                      f"{r.flops:10.3e} | {r.kernel_flops:17.3e} | "
                      f"{e.full_overlap_s * 1e3:8.0f}..{e.no_overlap_s * 1e3:<8.0f} | "
                      f"{r.compile_s:9.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--topology", default=None, help="comma-separated TPU topologies")
    parser.add_argument("--sizes", default="1b,7b")
    parser.add_argument("--micro_batch", type=int, default=1)
    parser.add_argument("--attention", default="einsum", help="comma-separated: einsum,splash")
    parser.add_argument("--remat", default="full", help="model.remat of the --topology table")
    args = parser.parse_args()
    if args.topology:
        tpu_table(args.topology, args.sizes, args.micro_batch, args.attention, args.remat)
        return
    gib = lambda b: f"{b / 2**30:7.3f}"
    devices = jax.device_count()
    print(f"configs/llama.py:1b Llama (embed 2048, {args.layers} layers, mlp 8192, vocab 32000), "
          f"mesh fsdp={devices}; per-device GiB")
    print(f"| {'variant':26s} | {'params':>7s} | {'opt':>7s} | {'p+opt':>7s} | {'B/param':>8s} | "
          f"{'analytic':>8s} | {'replicated':>10s} | {'compiled args':>13s} | {'temp':>7s} |")
    print("|" + "|".join("-" * w for w in (28, 9, 9, 9, 10, 10, 12, 15, 9)) + "|")
    for name, (precision, rank, optim) in VARIANTS.items():
        r = measure(config_1b(args.layers), precision, rank, optim)
        per_param = (r["params"] + r["opt"]) * devices / r["n"]
        print(f"| {name:26s} | {gib(r['params'])} | {gib(r['opt'])} | "
              f"{gib(r['params'] + r['opt'])} | {per_param:8.3f} | {r['analytic']:8.3f} | "
              f"{gib(r['repl']):>10s} | {gib(r['args']):>13s} | {gib(r['temp'])} |", flush=True)
    print(f"\n{r['n']:,} parameters without adapters. B/param = per-device bytes x {devices} "
          "devices / parameters (equals `analytic` when everything is sharded 1/8); "
          "replicated = per-device bytes in leaves every device holds whole; compiled args = "
          "the step's inputs (state + batch) from memory_analysis(); temp = its temporaries.")


if __name__ == "__main__":
    main()
