"""What the test suite's XLA flags (`tests/child_env.py`) buy: compile seconds and step time of
the suite's typical programs, with and without each candidate flag.

    python bench/suite_compile.py [--candidates="--xla_cpu_use_fusion_emitters=false"] [--steps=10]

Each variant runs in a fresh process (XLA reads its flags at start-up) with the tests' base flags
(LLVM at -O0, 8 simulated CPU devices) plus the candidate: it builds and trains the tiny_lm test
config on one device and on fsdp=4 x tensor=2, and a DeepSeek-style MoE (latent attention,
8 sigmoid-routed experts, one MTP module) on one device and on fsdp x tensor x expert = 2 x 2 x 2,
each for 1 + `--steps` steps. Printed: the XLA compile seconds of all their programs (init, train
step; from `jax_log_compiles`), the ms of a compiled step of the two 8-device runs, and each
run's last loss (to see how far the flag moves the arithmetic). The variants alternate
(`--rounds`) so that other load on the machine hits them alike; compare the ratios.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_FLAGS = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"
MOE = dict(num_experts=8, experts_per_token=2, router="sigmoid_group", n_group=4, topk_group=2,
           routed_scaling_factor=2.5, shared_experts=1, mlp=32, first_k_dense_replace=1,
           router_aux_loss_coef=0.0, bias_update_rate=1e-3)
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)


def _configs() -> list[tuple[str, object, dict, int]]:
    from configs.tiny_lm import get_config

    moe = get_config("test")
    moe.model.moe.update(MOE)
    moe.model.update(attention_kind="latent", mtp_depth=1)
    moe.model.mla.update(MLA)
    one = dict(data=1, fsdp=1, tensor=1, expert=1)
    return [("tiny", get_config("test"), one, 1),
            ("tiny", get_config("test"), dict(one, fsdp=4, tensor=2), 8),
            ("moe", moe, one, 1),
            ("moe", moe, dict(one, fsdp=2, tensor=2, expert=2), 8)]


def measure(steps: int) -> dict:
    """In this process (started by `main` with the flags): compile seconds, step ms, losses."""
    import jax

    from jaxscale.train.loop import Trainer

    jax.config.update("jax_num_cpu_devices", 8)
    log = io.StringIO()
    logging.getLogger("jax").addHandler(logging.StreamHandler(log))
    jax.config.update("jax_log_compiles", True)
    step_ms, losses = {}, {}
    for name, config, mesh, devices in _configs():
        config.mesh.update(mesh)
        trainer = Trainer.build(config, workdir=None, devices=jax.devices()[:devices])
        batches = trainer.batches.iterator()
        state, metrics = trainer.train_fn(trainer.state, trainer.to_global(next(batches)))
        float(metrics["loss"])
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = trainer.train_fn(state, trainer.to_global(next(batches)))
        losses[f"{name}/{devices}"] = float(metrics["loss"])
        if devices > 1:
            step_ms[name] = (time.perf_counter() - start) / steps * 1e3
    compile_s = sum(float(s) for s in re.findall(
        r"Finished XLA compilation of .* in ([0-9.e-]+) sec", log.getvalue()))
    return {"compile_s": compile_s, "step_ms": step_ms, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--candidates", default="--xla_cpu_use_fusion_emitters=false",
                        help="flag strings to compare with the base flags, ';'-separated")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.steps)))
        return
    variants = ["", *[c.strip() for c in args.candidates.split(";") if c.strip()]]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for flags in variants:
            env = {**os.environ, "XLA_FLAGS": f"{BASE_FLAGS} {flags}".strip(),
                   "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
            done = subprocess.run([sys.executable, __file__, "--child", f"--steps={args.steps}"],
                                  env=env, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"{flags or 'base flags'}: failed\n{done.stderr[-2000:]}")
            results[flags].append(json.loads(done.stdout.strip().splitlines()[-1]))
    base = min(r["compile_s"] for r in results[""])
    print("| extra flags | compile s (best) | vs base | step ms tiny / moe (8 dev) | last losses |")
    print("|---|---:|---:|---|---|")
    for flags, runs in results.items():
        best = min(runs, key=lambda r: r["compile_s"])
        ms = " / ".join(f"{min(r['step_ms'][k] for r in runs):.0f}" for k in ("tiny", "moe"))
        losses = ", ".join(f"{v:.6f}" for v in best["losses"].values())
        print(f"| {flags or '(base: -O0 only)'} | {best['compile_s']:.1f} | "
              f"{best['compile_s'] / base:.2f} | {ms} | {losses} |")


if __name__ == "__main__":
    main()
