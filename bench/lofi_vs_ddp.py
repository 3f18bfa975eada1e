"""Lo-Fi vs data-parallel fine-tuning: held-out loss and bytes communicated.

Pre-trains the tiny LM briefly on half `a` of the corpus, then fine-tunes it on half `b` three
ways with the same total samples and hyper-parameters:
  (a) data parallel: one run, global batch = workers x per-worker batch, over `data=4`;
  (b) Lo-Fi, `sync=end`: 4 independent workers (own shard, own batch), one average at the end;
  (c) Lo-Fi, `sync=diloco`: average every H steps with the outer Nesterov optimizer.
Workers are real `launch.train` processes driven by `launch.lofi_local`.

    python bench/lofi_vs_ddp.py [--pretrain_steps=200] [--steps=200] [--sync_every=50]
    python bench/lofi_vs_ddp.py --small --pretrain_steps=1000 --steps=2500 --sync_every=250

`--small` shrinks the tiny LM (embed 64, 2 layers, 32-token sequences: 0.1M parameters) so
that runs of thousands of steps, the regime Lo-Fi and DiLoCo are meant for, fit on a CPU.

Bytes: Lo-Fi counts everything that went through the store (every worker's pushes and reads
plus the averager's reads and writes, as recorded by them); data parallel counts the ring
all-reduce 2(N-1)/N x gradient bytes per step per worker. Lo-Fi's bytes per exchange are fixed,
so the ratio grows linearly with the steps between exchanges.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

WORKERS, BATCH = 4, 16
SMALL = {"model.embed": 64, "model.num_layers": 2, "model.head_dim": 16, "model.mlp": 128,
         "data.seq_len": 32}
MODEL: dict = {}  # the overrides of this run (SMALL with --small)


def sh(args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""}
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"failed: {' '.join(args)}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return out.stdout


def train_flags(steps: int, batch: int, init_from: str | None, part: str,
                lr: float = 1e-3, seed: int = 0) -> list[str]:
    flags = ["--config=configs/tiny_lm.py", f"--config.train.steps={steps}",
             f"--config.seed={seed}",
             f"--config.data.batch_size={batch}", f"--config.data.part={part}",
             "--config.train.log_every=25", "--config.train.eval_every=0",
             "--config.optim.warmup_steps=10", f"--config.optim.lr={lr}"]
    flags += [f"--config.{k}={v}" for k, v in MODEL.items()]
    return flags + ([f"--config.init_from={init_from}"] if init_from else [])


def heldout_loss(init_from: str) -> float:
    from configs.tiny_lm import get_config
    from jaxscale.train.loop import Trainer
    c = get_config()
    c.update(init_from=init_from)
    for key, value in MODEL.items():
        section, field = key.split(".")
        c[section][field] = value
    c.mesh.data = -1
    c.data.eval_batches = 16
    trainer = Trainer.build(c, workdir=None)
    return trainer.evaluate(trainer.state)["loss"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pretrain_steps", type=int, default=200)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync_every", type=int, default=50)
    p.add_argument("--small", action="store_true", help="a 0.1M-parameter model (see above)")
    p.add_argument("--runs", default="end,diloco",
                   help="Lo-Fi runs after data parallel: end, diloco, end_ema (sync=end pushing "
                        "an EMA of the weights, decay --ema)")
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate of all three fine-tuning runs (pre-training: 1e-3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the fine-tuning runs (data order); pre-training keeps seed 0")
    p.add_argument("--keep", action="store_true", help="keep the runs' directory (else deleted)")
    args = p.parse_args()
    unknown = [r for r in args.runs.split(",") if r not in ("end", "diloco", "end_ema")]
    if unknown:
        raise SystemExit(f"--runs: unknown run {unknown[0]!r}; use end, diloco, end_ema")
    MODEL.update(SMALL if args.small else {})
    tmp = tempfile.mkdtemp(prefix="lofi_bench_")
    try:
        rows, ddp_bytes, param_bytes = measure(args, tmp)
    finally:
        if args.keep:
            print(f"runs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report(args, rows, ddp_bytes, param_bytes)


def measure(args: argparse.Namespace, tmp: str) -> tuple[list, float, float]:
    """Pre-trains, then fine-tunes data parallel and each Lo-Fi run under `tmp`; returns
    (rows of (name, held-out loss, bytes moved), DDP bytes, bytes of one parameter copy)."""
    py = sys.executable
    pre = os.path.join(tmp, "pretrain")
    sh([py, "-m", "launch.train", *train_flags(args.pretrain_steps, 32, None, "a"),
        f"--workdir={pre}", "--cpu_devices=4", "--config.lofi.enabled=True",
        f"--config.lofi.store={pre}/store", "--config.lofi.push_every=100000"])
    sh([py, "-m", "launch.lofi_average", f"--store={pre}/store", f"--final={pre}/final"])
    base = f"{pre}/final"
    from jaxscale.lofi.accounting import store_totals
    rows = [("pretrained (no fine-tuning)", heldout_loss(base), 0.0)]

    ddp = os.path.join(tmp, "ddp")
    tune = (args.lr, args.seed)
    sh([py, "-m", "launch.train", *train_flags(args.steps, WORKERS * BATCH, base, "b", *tune),
        f"--workdir={ddp}", "--cpu_devices=4", "--config.mesh.data=4",
        "--config.lofi.enabled=True", f"--config.lofi.store={ddp}/store",
        "--config.lofi.push_every=100000"])
    sh([py, "-m", "launch.lofi_average", f"--store={ddp}/store", f"--final={ddp}/final"])
    param_bytes = store_totals(f"{ddp}/store")["param_bytes"]
    ddp_bytes = 2 * (WORKERS - 1) / WORKERS * param_bytes * args.steps * WORKERS
    rows.append(("data parallel, 4 shards", heldout_loss(f"{ddp}/final"), ddp_bytes))

    for run in args.runs.split(","):
        sync = run.removesuffix("_ema")
        store = os.path.join(tmp, run)
        extra = [f"--config.lofi.sync_every={args.sync_every}"] if sync != "end" else []
        extra += [f"--config.lofi.push_ema={args.ema}"] if run.endswith("_ema") else []
        # Push only when an exchange needs it (end: once; diloco: every H steps), so the bytes
        # are those of the algorithm; shorter push_every adds fault-tolerance snapshots.
        push = args.steps if sync == "end" else args.sync_every
        extra.append(f"--config.lofi.push_every={push}")
        sh([py, "-m", "launch.lofi_local", f"--num_workers={WORKERS}", "--devices_per_worker=1",
            f"--store={store}", f"--sync={sync}", "--",
            *train_flags(args.steps, BATCH, base, "b", *tune), *extra])
        moved = store_totals(store)["lofi_total"]
        name = f"Lo-Fi sync={sync}" + (f" (H={args.sync_every})" if sync != "end" else "")
        rows.append((name + (f", EMA {args.ema}" if run.endswith("_ema") else ""),
                     heldout_loss(os.path.join(store, "runs", "final")), moved))
    return rows, ddp_bytes, param_bytes


def report(args: argparse.Namespace, rows: list, ddp_bytes: float, param_bytes: float) -> None:
    ddp_loss = rows[1][1]
    print(f"\n{'run':<34} {'held-out loss':>13} {'vs DDP':>8} {'bytes moved':>14} {'DDP/this':>10}")
    for name, loss, moved in rows:
        ratio = f"{ddp_bytes / moved:,.0f}x" if moved else "-"
        print(f"{name:<34} {loss:>13.4f} {100 * (loss / ddp_loss - 1):>+7.2f}% "
              f"{moved / 2**20:>11.2f} MiB {ratio:>10}")
    print(f"\n{WORKERS} workers x batch {BATCH}, {args.steps} fine-tuning steps each; DDP uses "
          f"global batch {WORKERS * BATCH}; same lr schedule (peak {args.lr:g}). Lo-Fi bytes = "
          f"all store traffic (workers + averager); DDP bytes = ring all-reduce 2(N-1)/N x "
          f"{param_bytes / 2**20:.2f} MiB per step per worker.")


if __name__ == "__main__":
    main()
