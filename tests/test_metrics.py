"""metrics.py: peak table, MFU arithmetic (FLOPs per token from the model table), metrics.jsonl
writer; the TensorBoard logger (locally and on a bucket); progress bar fallback."""

import importlib.util
import io
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from jaxscale import hardware
from jaxscale.hardware import peak_flops
from jaxscale.models import vit
from jaxscale.models.decoder.flops import flops_per_token
from jaxscale.observe import metrics
from jaxscale.observe.loggers import TensorBoardLogger
from jaxscale.observe.metrics import MetricsWriter, mfu, read_metrics
from jaxscale.observe.progress import ProgressBar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kind, expected", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5p", 459e12), ("TPU v6 lite", 918e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("cpu", None), ("Intel Xeon", None), ("", None),
])
def test_peak_flops(kind, expected):
    assert peak_flops(kind) == expected


def test_mfu_by_hand():
    # 1e9 FLOPs/token × 1e5 tokens/s = 1e14 FLOP/s over 4 × 275e12 = 1.1e15 peak.
    assert mfu(1e9, 1e5, 4, "TPU v4") == pytest.approx(1e14 / 1.1e15)
    assert mfu(1e9, 1e5, 4, "cpu") is None


def test_llama_flops_by_hand():
    # L=2, D=8, H=2, KV=1, Q=4, F=16, V=32, T=10.
    attn = 8 * 4 * (2 * 2 + 2 * 1)           # 192
    n = 2 * (attn + 3 * 8 * 16) + 8 * 32     # 2·(192+384)+256 = 1408
    expected = 6 * n + 12 * 2 * 2 * 4 * 10   # 8448 + 1920
    m = dict(num_layers=2, embed=8, num_heads=2, num_kv_heads=1, head_dim=4, mlp=16,
             vocab_size=32)
    assert flops_per_token(m, 10) == expected == 10368


def test_writer_lines(tmp_path):
    w = MetricsWriter(str(tmp_path))
    w.write(np.int64(1), {"loss": np.float32(2.5), "tokens": 7, "bad": float("nan")})
    w.write(2, {"loss": 2.0, "eval_loss": float("inf")})
    w.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert list(first) == ["step", "loss", "tokens", "bad"]
    assert first == {"step": 1, "loss": 2.5, "tokens": 7, "bad": None}
    assert type(first["step"]) is int and type(first["tokens"]) is int
    assert "NaN" not in lines[0] and "Infinity" not in lines[1]
    assert read_metrics(str(tmp_path))[1] == {"step": 2, "loss": 2.0, "eval_loss": None}


def test_writer_disabled(tmp_path):
    w = MetricsWriter(str(tmp_path / "run"), enabled=False)
    w.write(1, {"loss": 1.0})
    w.truncate_after(0)
    w.close()
    assert not (tmp_path / "run").exists()


def test_truncate_after_and_append(tmp_path):
    w = MetricsWriter(str(tmp_path))
    for step in range(1, 6):
        w.write(step, {"loss": float(step)})
    w.close()
    resumed = MetricsWriter(str(tmp_path))
    resumed.truncate_after(3)
    resumed.write(4, {"loss": 40.0})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path))] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_read_skips_cut_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 1.0}]
    assert read_metrics(str(tmp_path / "missing")) == []


def _tensorboard_logger(workdir: str) -> TensorBoardLogger:
    return TensorBoardLogger(SimpleNamespace(is_primary=True, workdir=workdir), start_step=0)


def test_tensorboard_event_file(tmp_path):
    tb = _tensorboard_logger(str(tmp_path))
    tb.on_metrics(SimpleNamespace(step=1, metrics={"loss": 1.5, "eval_loss": None}))
    tb.close()
    files = os.listdir(tmp_path / "tensorboard")
    assert any(f.startswith("events.out.tfevents") for f in files), files
    assert not (tmp_path / "metrics.jsonl").exists()  # metrics.jsonl is the jsonl logger's


@pytest.mark.xdist_group("seaweedfs")
def test_tensorboard_on_a_bucket_uploads_and_leaves_no_local_mirror(seaweedfs):
    server, bucket = seaweedfs
    tb = _tensorboard_logger(f"s3://{bucket}/run")
    mirror = tb._mirror.local
    tb.on_metrics(SimpleNamespace(step=1, metrics={"loss": 1.5}))
    assert os.listdir(mirror)  # events are written locally, then uploaded
    tb.close()
    keys = [o["Key"] for o in server.client().list_objects_v2(
        Bucket=bucket, Prefix="run/tensorboard/").get("Contents", [])]
    assert any(k.startswith("run/tensorboard/events.out.tfevents") for k in keys), keys
    assert not os.path.exists(mirror)  # the temporary mirror goes once its events are uploaded


def test_tensorboard_leaves_torch_boto3_and_gcs_unimported_and_importable(tmp_path):
    """tensorboardX would import torch (seconds of every run's start, where installed) only for
    type hints, and boto3 and google-cloud-storage for writers jaxscale never uses: the writer
    imports it with those refused, in a fresh process (pytest's has them already), and they
    import as usual afterwards."""
    unused = [n for n in ("torch", "boto3", "google.cloud.storage")
              if importlib.util.find_spec(n.partition(".")[0]) is not None]
    assert "boto3" in unused  # installed with jaxscale (object stores)
    code = ("import os, sys\n"
            "from jaxscale.observe.loggers import summary_writer\n"
            f"w = summary_writer({str(tmp_path / 'tensorboard')!r}, None)\n"
            "w.add_scalar('loss', 1.5, 1)\n"
            "w.close()\n"
            f"assert not any(n in sys.modules for n in {unused!r}), "
            "[n for n in sys.modules if n.split('.')[0] in ('torch', 'boto3', 'google')]\n"
            f"assert os.listdir({str(tmp_path / 'tensorboard')!r})\n"
            "import importlib\n"
            f"for n in {unused!r}: importlib.import_module(n)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_progress_bar_plain_lines():
    out = io.StringIO()  # not a TTY: plain lines every print_every steps
    bar = ProgressBar(10, enabled=True, print_every=5, stream=out)
    for step in range(1, 11):
        m = {"loss": 1.0 / step, "tokens_per_s": 1234.0}
        if step == 6:
            m["eval_loss"] = 0.5
        bar.update(step, m)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["5/10", "6/10", "10/10"]
    assert "eval=0.5000" in lines[-1] and "tok/s=1,234" in lines[0]
    silent = io.StringIO()
    ProgressBar(10, enabled=False, stream=silent).update(5, {"loss": 1.0})
    assert silent.getvalue() == ""


def test_peak_table_covers_issue_hardware():
    for kind in ("TPU v4", "TPU v5e", "TPU v5p", "TPU v6e", "A100", "H100", "H200"):
        assert kind in hardware.PEAK_FLOPS and math.isfinite(hardware.PEAK_FLOPS[kind])


def test_every_peak_names_its_source():
    assert set(hardware.PEAK_SOURCES) == set(hardware.PEAK_FLOPS)
    assert hardware.peak_flops_source("NVIDIA H100 80GB HBM3").startswith("H100: NVIDIA H100")
    assert hardware.peak_flops_source("TPU v5 lite").startswith("TPU v5 lite: https://")
    assert hardware.peak_flops_source("cpu") is None


def test_vit_flops_by_hand():
    # L=2, E=8, H=2, Q=4, F=16, P=2, C=1, K=10, T=5 (4 patches + class token):
    # per token 2*(4*8*2*4 + 2*8*16) = 1024; per image 4*2*2*1*8 + 8*10 = 208 -> 208/5;
    # 6*(1024 + 41.6) + 12*2*2*4*5 = 6393.6 + 960
    assert vit.vit_flops_per_token(2, 8, 2, 4, 16, 2, 1, 10, 5) == pytest.approx(7353.6)


def test_every_shipped_model_has_a_flop_count():
    import importlib
    for name, arg in (("tiny_lm", "test"), ("vit_digits", "test"), ("llama", "1b")):
        c = importlib.import_module(f"configs.{name}").get_config(arg)
        assert metrics.model_flops_per_token(c.model, c.data.seq_len) > 0, name
    llama = importlib.import_module("configs.llama").get_config("1b")
    m, t = llama.model, llama.data.seq_len  # the table's count is PaLM's formula, by hand:
    # 6 x (16 layers x (q/k/v/o 2048 x 64 x (2 x 32 + 2 x 8) + SwiGLU 3 x 2048 x 8192)
    #      + head 2048 x 32000) + 12 x 16 layers x 32 heads x 64 x 2048 positions
    assert metrics.model_flops_per_token(m, t) == 6 * (16 * (10_485_760 + 50_331_648)
                                                       + 65_536_000) + 805_306_368


def test_throughput_window_mfu():
    from jaxscale.observe.throughput import Throughput
    meter = Throughput(1000, 6e9, 4, "TPU v4")
    meter.compiled(5.0)
    meter.first_step_done(1, 0.5)
    first = meter.window(3)
    assert first["compile_s"] == 5.0 and first["first_step_s"] == 0.5
    assert first["mfu"] == pytest.approx(6e9 * first["tokens_per_s"] / (275e12 * 4))
    assert "compile_s" not in meter.window(5)  # logged once
    meter.restart(5)
    assert meter.window(5)["step_time_s"] is None  # no step since the window started
