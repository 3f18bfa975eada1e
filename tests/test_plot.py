"""launch.plot: two fake runs' metrics.jsonl -> one PNG."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_run(path, scale):
    os.makedirs(path)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step in range(1, 11):
            record = {"step": step, "loss": scale / step}
            if step % 5 == 0:
                record["eval_loss"] = scale / step + 0.1
            f.write(json.dumps(record) + "\n")


def test_plot_cli_writes_png(tmp_path):
    runs = [str(tmp_path / "a"), str(tmp_path / "b")]
    _fake_run(runs[0], 3.0)
    _fake_run(runs[1], 4.0)
    out = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, "-m", "launch.plot", *runs, f"--out={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_missing_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launch.plot", str(tmp_path / "nope"),
                           f"--out={tmp_path / 'x.png'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "metrics.jsonl is missing" in proc.stderr


def test_plot_without_an_extension_prints_the_png_it_wrote(tmp_path):
    from jaxscale.observe.plots import plot_runs
    _fake_run(str(tmp_path / "a"), 3.0)
    written = plot_runs([str(tmp_path / "a")], str(tmp_path / "sig"))
    assert written == str(tmp_path / "sig.png")
    assert sorted(os.listdir(tmp_path)) == ["a", "sig.png"]
