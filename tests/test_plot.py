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


def _closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plot_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    from child_env import child_env
    return subprocess.run([sys.executable, "-m", "jaxscale", "plot", *args], cwd=ROOT,
                          env=child_env(**(env or {})), capture_output=True, text=True,
                          timeout=120)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("jaxscale: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


def test_plot_of_an_unreachable_bucket_fails_fast_in_one_paragraph(tmp_path):
    """Before the fix, a bucket read retried (and logged) for minutes: the command hung."""
    dead = f"http://127.0.0.1:{_closed_port()}"
    proc = _plot_cli("s3://bucket/run", f"--out={tmp_path / 's.png'}",
                     env={"AWS_ENDPOINT_URL_S3": dead})
    assert f"cannot connect to the endpoint {dead}" in _error_line(proc)
    assert not (tmp_path / "s.png").exists()


def test_plot_of_a_metrics_jsonl_that_is_a_directory_names_it(tmp_path):
    os.makedirs(tmp_path / "run" / "metrics.jsonl")
    line = _error_line(_plot_cli(str(tmp_path / "run"), f"--out={tmp_path / 's.png'}"))
    assert f"{tmp_path / 'run' / 'metrics.jsonl'} cannot be read as a text file" in line
    assert "directory" in line


def test_plot_of_a_metrics_jsonl_of_binary_bytes_names_it(tmp_path):
    os.makedirs(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_bytes(b"\xde\xad\xbe\xef" * 100)
    line = _error_line(_plot_cli(str(tmp_path / "run"), f"--out={tmp_path / 's.png'}"))
    assert f"{tmp_path / 'run' / 'metrics.jsonl'} cannot be read" in line
    assert "not UTF-8 text" in line
