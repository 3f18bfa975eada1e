"""Peak activation memory of the pipeline schedules: GPipe (remat none / full) against 1F1B.

Compiles (does not run) jaxscale's train step on 8 simulated CPU devices, mesh pipeline=4 x
data=2 (`pp` preset), for M = 4, 8, 16, 32 microbatches of a fixed size (the batch grows with
M, as when one raises M to shrink the bubble), and prints the compiled step's per-device
`memory_analysis()` temporaries next to the 1F1B ring buffer's analytic size.

GPipe keeps every microbatch's activations until the backward, so its temporaries grow with M
(remat='full' keeps only each layer's input per microbatch, still O(M)). 1F1B keeps each stage's
input for at most K = 2S-1 microbatches and recomputes the stage in its backward, so its
activations are bounded by S; what still grows with M is the step's batch itself: the
embedding output and its gradient (column h + dh), which the fused loss takes and returns for
the whole batch, as any train step does.

    python bench/pipeline_memory.py [--microbatches 4 8 16 32] [--rows 4] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from configs.tiny_lm import get_config
from jaxscale.train.loop import Trainer

STAGES, DATA = 4, 2
# (schedule, remat): GPipe without / with per-layer remat, 1F1B (which rematerialises each
# stage in its backward anyway: with remat='none' it computes 2F+B per microbatch and stage, as
# GPipe with remat='full' does), and 1F1B with per-layer remat inside the stage too (3F+B).
VARIANTS = (("gpipe", "none"), ("gpipe", "full"), ("1f1b", "none"), ("1f1b", "full"))


def make_config(schedule: str, remat: str, microbatches: int, rows: int, layers: int):
    c = get_config("test")
    c.model.update(embed=64, num_layers=layers, num_heads=4, num_kv_heads=4, head_dim=16,
                   mlp=128, remat=remat)
    c.data.batch_size = rows * microbatches
    c.mesh.update(data=DATA, pipeline=STAGES, fsdp=1, tensor=1)
    c.rules_preset = "pp"
    c.pipeline.update(schedule=schedule, microbatches=microbatches)
    return c


def temp_bytes(c) -> int:
    """Per-device temporaries of the compiled train step (XLA's buffer assignment)."""
    trainer = Trainer.build(c, workdir=None)
    batch = trainer.to_global(next(trainer.batches.iterator()))
    mem = trainer.train_fn.lower(trainer.state, batch).compile().memory_analysis()
    return int(mem.temp_size_in_bytes)


def slice_bytes(c, microbatches: int = 1) -> int:
    """Bytes of `microbatches` microbatches' (rows, T, E) float32 activations on one device."""
    rows = c.data.batch_size // c.pipeline.microbatches // DATA
    return microbatches * rows * c.data.seq_len * c.model.embed * 4


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--rows", type=int, default=4, help="global rows per microbatch")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    start = time.perf_counter()
    table = {}
    for m in args.microbatches:
        for schedule, remat in VARIANTS:
            table[m, schedule, remat] = temp_bytes(
                make_config(schedule, remat, m, args.rows, args.layers))
            print(f"  compiled M={m} {schedule} remat={remat} "
                  f"({time.perf_counter() - start:.0f}s)", file=sys.stderr)
    c = make_config("1f1b", "none", 1, args.rows, args.layers)
    print(f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices, mesh pipeline="
          f"{STAGES} x data={DATA} ('pp' preset); Llama embed=64, {args.layers} layers "
          f"({args.layers // STAGES} per stage), 4 heads, mlp=128, vocab=256, seq "
          f"{c.data.seq_len}, fp32, adamw; {args.rows} rows per microbatch (batch = rows x M).")
    print("Per-device temporaries of the compiled train step, MiB (memory_analysis):\n")
    head = (f"{'M':>3} {'batch':>5} | {'GPipe none':>10} {'GPipe full':>10} {'1F1B none':>9} "
            f"{'1F1B full':>9} | {'stash':>6} {'h + dh':>6} {'1F1B none - (h + dh)':>20} | "
            f"{'GPipe full / 1F1B none':>22}")
    print(head)
    print("-" * len(head))
    for m in args.microbatches:
        g, gf, o, of = (table[m, s, r] for s, r in VARIANTS)
        c = make_config("1f1b", "none", m, args.rows, args.layers)
        stash, batch = slice_bytes(c, 2 * STAGES - 1), slice_bytes(c, 2 * m)
        print(f"{m:>3} {args.rows * m:>5} | {mib(g):>10} {mib(gf):>10} {mib(o):>9} {mib(of):>9} "
              f"| {mib(stash):>6} {mib(batch):>6} {mib(o - batch):>20} | {gf / o:>22.2f}")
    print(f"\nstash (analytic): 1F1B's ring of 2S-1 = {2 * STAGES - 1} stage inputs of one "
          "microbatch per device, whatever M.\nh + dh (analytic): the embedding output of the "
          "whole batch and its gradient (the fused loss's input and\ninput gradient), 2 x M "
          "microbatch slices: the only temporaries of 1F1B that grow with M (any train\nstep "
          "holds them, pipelined or not). GPipe full and 1F1B none do the same compute, 2F+B.")
    print(f"(bench ran in {time.perf_counter() - start:.0f}s)")


if __name__ == "__main__":
    main()
