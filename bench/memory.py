"""Per-device bytes of parameters + optimizer state for precision / LoRA / 8-bit Adam variants.

A ~1.1B-parameter Llama shape on an 8-device CPU mesh with fsdp=8, evaluated abstractly: the
state's shapes and shardings come from `jax.eval_shape` (nothing allocated), the per-device
bytes from each leaf's shard shape, and the compiled train step's `memory_analysis()` from
`jax.jit(...).lower(abstract args).compile()` (compiled, never run). Analytic bytes per
parameter are printed next to the measured ones.

    python bench/memory.py [--layers=16]
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

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from jaxscale.config import base_config  # noqa: E402
from jaxscale.mesh import make_mesh  # noqa: E402
from jaxscale.models import lora  # noqa: E402
from jaxscale.precision import DynamicLossScale, get_policy  # noqa: E402
from jaxscale.rules import AxisRules  # noqa: E402
from jaxscale.train.optim import make_optimizer  # noqa: E402
from jaxscale.train.state import ModelDef, abstract_state  # noqa: E402
from jaxscale.train.step import StepContext, jit_steps  # noqa: E402

# name: (precision, lora rank, optimizer, analytic bytes/param of params + optimizer state)
# AdamW keeps two moments in the parameter dtype; 8-bit Adam two int8 moments plus one f32
# scale per block of min(256, last dim) (head_dim 64 -> 8/64 for the attention weights, about
# 0.05 B/param averaged); LoRA keeps the frozen base in the parameter dtype and (params + two
# moments) only for the adapters.
VARIANTS = {
    "32-true adamw": ("32-true", 0, "adamw", 4 + 8),
    "bf16-mixed adamw": ("bf16-mixed", 0, "adamw", 4 + 8),
    "bf16-true adamw": ("bf16-true", 0, "adamw", 2 + 4),
    "16-mixed adamw": ("16-mixed", 0, "adamw", 4 + 8),
    "lora r8 (bf16-true base)": ("bf16-true", 8, "adamw", 2),
    "32-true adam8bit": ("32-true", 0, "adam8bit", 4 + 2),
}


def config_1b(layers: int):
    c = base_config()
    c.model.update(vocab_size=32000, embed=2048, num_layers=layers, num_heads=32,
                   num_kv_heads=8, head_dim=64, mlp=8192, remat="full")
    c.mesh.update(data=1, fsdp=8)
    c.data.update(batch_size=8, seq_len=512)
    c.lora.targets = ("attn/w[qkvo]$", "mlp/w_")
    return c


def device_bytes(tree) -> int:
    """Bytes one device holds of an abstract tree whose leaves carry shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def measure(c, precision: str, rank: int, optim: str) -> dict:
    c.precision, c.lora.rank, c.optim.name = precision, rank, optim
    mesh, rules, policy = make_mesh(c.mesh), AxisRules.from_config(c), get_policy(precision)
    model_def = lora.with_adapters(ModelDef.build(c.model, policy), c.lora)
    optimizer, lr = make_optimizer(c.optim, 1000)
    scaler = DynamicLossScale.from_config(c.loss_scale) if policy.loss_scaling else None
    abstract, shardings = abstract_state(model_def, optimizer, rules, mesh, lora.trainable(c.lora),
                                         scaler.init if scaler else dict)
    ctx = StepContext(model_def, optimizer, lr, policy, rules, mesh, loss_scale=scaler)
    shapes = {"tokens": (c.data.batch_size, c.data.seq_len + 1)}
    train, _ = jit_steps(ctx, shardings, shapes)
    batch = {"tokens": jax.ShapeDtypeStruct(shapes["tokens"], jax.numpy.int32)}
    start = time.perf_counter()
    memory = train.lower(abstract, batch).compile().memory_analysis()
    return {"n": model_def.num_params(), "params": device_bytes((abstract.params, abstract.frozen)),
            "opt": device_bytes(abstract.opt_state), "args": memory.argument_size_in_bytes,
            "temp": memory.temp_size_in_bytes, "compile_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    gib = lambda b: f"{b / 2**30:7.3f}"
    print(f"~1B Llama (embed 2048, {args.layers} layers, mlp 8192, vocab 32000), mesh fsdp=8; "
          "per-device GiB")
    print(f"{'variant':26s} {'params':>7s} {'opt':>7s} {'p+opt':>7s} {'B/param':>8s} "
          f"{'analytic':>8s} {'compiled args':>13s} {'temp':>7s}")
    for name, (precision, rank, optim, analytic) in VARIANTS.items():
        r = measure(config_1b(args.layers), precision, rank, optim)
        per_param = (r["params"] + r["opt"]) * 8 / r["n"]
        print(f"{name:26s} {gib(r['params'])} {gib(r['opt'])} {gib(r['params'] + r['opt'])} "
              f"{per_param:8.3f} {analytic:8.3f} {gib(r['args']):>13s} {gib(r['temp'])}",
              flush=True)
    print(f"({r['n']:,} parameters without adapters; B/param = per-device "
          "bytes x 8 devices / parameters; compiled args include the batch)")


if __name__ == "__main__":
    main()
