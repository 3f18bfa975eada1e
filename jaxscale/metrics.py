"""Metrics: metrics.jsonl + TensorBoard, model FLOPs utilisation, and a terminal progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

# Dense bf16 peak FLOP/s per chip, from the vendors' data sheets.
PEAK_FLOPS: dict[str, float] = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,   # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,   # v6e (Trillium)
    "TPU v6e": 918e12,
    "A100": 312e12,
    "H100": 989e12,          # SXM, dense
    "H200": 989e12,
}


def peak_flops(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s for a `device.device_kind` string; None for CPUs and unknown kinds."""
    for name in sorted(PEAK_FLOPS, key=len, reverse=True):
        if name.lower() in device_kind.lower():
            return PEAK_FLOPS[name]
    return None


def mfu(flops_per_token: float, tokens_per_s: float, num_devices: int,
        device_kind: str) -> float | None:
    peak = peak_flops(device_kind)
    return None if peak is None else flops_per_token * tokens_per_s / (peak * num_devices)


def llama_flops_per_token(num_layers: int, embed: int, heads: int, kv_heads: int, head_dim: int,
                          mlp: int, vocab: int, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B convention: 6·N_matmul + 12·L·H·D·T."""
    attn = embed * head_dim * (2 * heads + 2 * kv_heads)
    matmul_params = num_layers * (attn + 3 * embed * mlp) + embed * vocab
    return 6.0 * matmul_params + 12.0 * num_layers * heads * head_dim * seq_len


def _plain(value: Any) -> Any:
    """JSON-safe scalar: numpy/jax scalars to Python; non-finite floats become null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON line per logged step (flushed, so a killed run leaves whole lines)."""

    def __init__(self, workdir: str | None, enabled: bool = True, tensorboard: bool = True):
        self.enabled = bool(enabled and workdir)
        self.path = os.path.join(workdir, "metrics.jsonl") if workdir else None
        self._tb = None
        if self.enabled:
            os.makedirs(workdir, exist_ok=True)
            self._file = open(self.path, "a")
            if tensorboard:
                from tensorboardX import SummaryWriter
                self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def truncate_after(self, step: int) -> None:
        """Drops lines logged after `step` (a resumed run re-logs them)."""
        if not self.enabled:
            return
        self._file.close()
        kept = [l for l in read_metrics_file(self.path) if l["step"] <= step]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(l) + "\n" for l in kept)
        self._file = open(self.path, "a")

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def read_metrics_file(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(workdir: str) -> list[dict]:
    return read_metrics_file(os.path.join(workdir, "metrics.jsonl"))


class ProgressBar:
    """tqdm bar on a terminal; a plain line per update otherwise (CI logs stay readable)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.enabled, self.total = enabled, total
        self._bar = None
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        self._last = initial

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        shown = {"loss": f"{metrics['loss']:.4f}",
                 "tok/s": f"{metrics.get('tokens_per_s', 0):,.0f}"}
        if "eval_loss" in metrics:
            shown["eval"] = f"{metrics['eval_loss']:.4f}"
        if self._bar is not None:
            self._bar.update(step - self._last)
            self._bar.set_postfix(shown)
        else:
            print(f"step {step}/{self.total} " + " ".join(f"{k}={v}" for k, v in shown.items()),
                  flush=True)
        self._last = step

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
