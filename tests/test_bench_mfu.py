"""bench/mfu.py: a clear skip (exit 0) without a GPU, and a smoke run of the timed step."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_skips_cleanly_without_gpu():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "bench.mfu"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "bench.mfu: skipped: no GPU found" in run.stdout and "--smoke" in run.stdout
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_smoke_measures_the_train_step(tmp_path, capsys):
    sys.path.insert(0, ROOT)
    from bench import mfu

    out = tmp_path / "mfu.jsonl"
    assert mfu.main(["--smoke", "--warmup=1", "--steps=2", f"--out={out}"]) == 0
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["step_time_s"] > 0 and result["tokens_per_s"] > 0
    assert result["precision"] == "bf16-mixed" and result["mfu"] is None  # no peak for CPU
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result
