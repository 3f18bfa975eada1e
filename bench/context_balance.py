"""Per-shard attention work of context parallelism, natural order against zigzag.

Why: under a causal mask, sequence shard i of n (natural order) has queries that see i + 1 of
the n key blocks, so the last shard does the most and sets the step time. The zigzag order
(`context.zigzag_order`, `model.context_order`) gives every shard an early and a late chunk,
and the ring (`context.ring_work`) skips the half-by-half pairs the mask hides. This runs the
real ring in a `shard_map` on host CPU devices (tiny heads, the sequence length and shard count
given) and prints, per shard, the score entries (query x key pairs, per row and head) that the
ring computed and the ones the causal mask leaves visible (`context.causal_work`); the balance
is max / mean over shards (1.00: perfect; the step waits for the max).

    python bench/context_balance.py [--length=4096] [--shards=4,8]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

jax.config.update("jax_num_cpu_devices", 8)

from jaxscale.mesh import make_mesh
from jaxscale.models.attention.sequence import context


def ring_work(length: int, shards: int, order: np.ndarray) -> np.ndarray:
    """Score entries each shard's ring computed, the sequence laid in `order`."""
    mesh = make_mesh({"context": shards, "data": 8 // shards})
    q = jnp.zeros((1, length, 1, 8), jnp.float32)
    slots = jnp.asarray(order, jnp.int32)[None]

    def body(q, slots):
        _, work = context.ring_work(q, q, q, slots, None, axes=("context",), n=shards,
                                    causal=True, window=0, softmax_dtype=jnp.float32)
        return work[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "context"), P(None, "context")),
                               out_specs=P("context"), check_vma=False))
    return np.asarray(fn(q, slots))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--shards", default="4,8")
    args = parser.parse_args()
    print("| shards | order | computed per shard (M entries) | balance | visible per shard "
          "(M) | balance |")
    print("|---|---|---|---|---|---|")
    for n in map(int, args.shards.split(",")):
        for name, order in (("natural", np.arange(args.length)),
                            ("zigzag", context.zigzag_order(args.length, n))):
            done, seen = ring_work(args.length, n, order), context.causal_work(order, n)
            fmt = lambda xs: " / ".join(f"{x / 1e6:.2f}" for x in xs)
            print(f"| {n} | {name} | {fmt(done)} | {done.max() / done.mean():.2f} | "
                  f"{fmt(seen)} | {seen.max() / seen.mean():.2f} |")
    full = args.length ** 2 / 1e6
    print(f"(length {args.length}: the full square is {full:.2f} M entries, its causal half "
          f"{full / 2:.2f} M; without skipping, every shard computes {full:.2f} M / shards)")


if __name__ == "__main__":
    main()
