"""The construct of issue 40 alone, in plain jax: does this libtpu still fail on it?

A loop (`lax.scan`, as gradient accumulation) adds to a float32 carry a bf16 reduce-scatter
converted to float32. libtpu 0.0.52's `while-loop-all-reduce-code-motion` accepts the convert
when it checks whether it may move the reduce-scatter out of the loop, then fails on it when it
rewrites the loop (`RET_CHECK ... user->opcode() == HloOpcode::kAdd`). jaxscale puts an
optimization barrier between the reduce-scatter and the convert (`models/nn/shard_sums.settle`).
Prints one line per variant; when the first compiles too, a libtpu upgrade has fixed the pass
and the barrier may go (bench/RESULTS.md, "Gradient accumulation on every TPU generation").

    python bench/accum_construct.py [--topology=v5e:2x2]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxscale.aot.topology import compile_only_env, parse_topology, topology_devices

compile_only_env()

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def compiles(mesh: Mesh, carry_dtype, barrier: bool) -> str:
    """'compiles' or the compiler's first line, for 4 micro-batches of a (256, 64) gradient."""
    def reduce(g):
        g = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=0, tiled=True)
        return jax.lax.optimization_barrier(g) if barrier else g

    def step(x):
        def body(carry, mb):
            g = jax.shard_map(reduce, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))(
                mb.reshape(-1, 64).astype(jnp.bfloat16))
            return carry + g.astype(carry_dtype), None
        return jax.lax.scan(body, jnp.zeros((256, 64), carry_dtype), x)[0]

    shards = mesh.shape["fsdp"]
    x = jax.ShapeDtypeStruct((4, shards, 256, 64), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "fsdp")))
    try:
        jax.jit(step, out_shardings=NamedSharding(mesh, P("fsdp"))).lower(x).compile()
        return "compiles"
    except Exception as e:  # the compiler's verdict is the measurement
        return "FAILS: " + str(e).strip().splitlines()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5e:2x2")
    devices = topology_devices(parse_topology(p.parse_args().topology))
    mesh = Mesh(devices, ("fsdp",))
    for name, dtype, barrier in (("bf16 reduce-scatter -> f32 carry", jnp.float32, False),
                                 ("the same behind an optimization barrier", jnp.float32, True),
                                 ("bf16 reduce-scatter -> bf16 carry (no convert)",
                                  jnp.bfloat16, False)):
        print(f"{name}: {compiles(mesh, dtype, barrier)}")


if __name__ == "__main__":
    main()
