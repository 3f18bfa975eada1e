"""Step time, tokens/s and MFU of the ~1B Llama in bf16-mixed on one GPU.

    python -m bench.mfu                      # the 1B preset; skips cleanly without a GPU
    python -m bench.mfu --smoke              # tiny shape on any backend (checks the script)
    python -m bench.mfu --attention=dot_product_attention --remat=dots --batch=8

Times the train step `launch.train` runs (`train.build.build_step`, initialised and jitted as
the loop does: AdamW, donated state, explicit shardings) on
synthetic tokens after `--warmup` untimed steps, blocking on the result of every timed step. MFU
uses the PaLM FLOP convention of the model's table entry (`observe.metrics.model_flops_per_token`,
what the training loop logs) and the peak table of `jaxscale.hardware`. The model shape comes
from `configs/llama.py:1b` when that preset exists, else the fallback below (the Llama 3.2 1B
shape with a 32k vocabulary). Prints one JSON line; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

FALLBACK_1B = dict(vocab_size=32768, embed=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                   head_dim=64, mlp=8192, max_len=4096, rope_theta=500000.0, norm_eps=1e-5,
                   tie_embeddings=True)
SMOKE = dict(vocab_size=256, embed=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             mlp=128, max_len=128)


def build_config(args: argparse.Namespace):
    from jaxscale.config import base_config
    preset = None
    if not args.smoke:
        try:
            from configs import llama
            preset = llama.get_config("1b")
        except (ImportError, ValueError, AttributeError):
            preset = None
    c = preset or base_config()
    if preset is None:
        c.model.update(SMOKE if args.smoke else FALLBACK_1B)
    c.model.update(attention=args.attention, remat=args.remat)
    c.precision = args.precision
    c.mesh.update(data=-1, pipeline=1, fsdp=1, tensor=1)
    c.data.update(seq_len=args.seq or (32 if args.smoke else 2048),
                  batch_size=args.batch or (4 if args.smoke else 8))
    c.train.update(steps=args.warmup + args.steps, grad_accum=1)
    return c


def measure(config, warmup: int, steps: int) -> dict:
    import jax
    import numpy as np

    from jaxscale import config as config_lib
    from jaxscale.mesh import make_mesh
    from jaxscale.observe.metrics import mfu, model_flops_per_token
    from jaxscale.train.build import batch_spec, build_step

    config_lib.validate(config)
    one = config.mesh.data == 1  # --smoke: one device even where several are simulated
    mesh = make_mesh(config.mesh, jax.devices()[:1] if one else None)
    setup = build_step(config, mesh)
    state, shardings = setup.init_state(config.seed)
    spec = batch_spec(config)
    train_fn = setup.jit(shardings, spec)
    b, t, v = config.data.batch_size, config.data.seq_len, config.model.vocab_size
    tokens = np.random.default_rng(0).integers(0, v, spec["tokens"].shape).astype(np.int32)
    batch = {"tokens": jax.device_put(tokens)}
    for _ in range(warmup):
        state, metrics = train_fn(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = train_fn(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    m = config.model
    step_time = float(np.median(times))
    tokens_per_s = b * t / step_time
    fpt = model_flops_per_token(m, t)
    device = jax.devices()[0]
    n = mesh.devices.size
    return {"device": device.device_kind, "num_devices": n,
            "params": setup.ctx.model_def.num_params(), "precision": config.precision,
            "attention": m.attention, "remat": m.remat, "batch": b, "seq_len": t,
            "step_time_s": step_time, "tokens_per_s": tokens_per_s,
            "mfu": mfu(fpt, tokens_per_s, n, device.device_kind) if fpt else None,
            "loss": float(metrics["loss"])}


def skip_message(devices: list) -> str:
    """Why nothing was measured: a CPU (or TPU) number would not be the GPU figure asked for."""
    kinds = sorted({f"{d.platform}:{d.device_kind}" for d in devices})
    return (f"bench.mfu: skipped: no GPU found (devices: {', '.join(kinds)}). The ~1B Llama "
            "bf16-mixed benchmark needs one GPU; run it on a GPU machine, or pass --smoke to "
            "check the script on this one.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shape, any backend")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--attention", default="dot_product_attention",
                   choices=["einsum", "dot_product_attention"])
    p.add_argument("--remat", default="dots", choices=["none", "full", "dots", "dots_no_batch"])
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--seq", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    import jax
    if not args.smoke and jax.devices()[0].platform != "gpu":
        print(skip_message(jax.devices()))
        return 0
    if args.smoke:  # one device: the benchmark is a single-accelerator number
        config = build_config(args)
        config.mesh.data = 1
        result = measure(config, args.warmup, args.steps)
    else:
        result = measure(build_config(args), args.warmup, args.steps)
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
