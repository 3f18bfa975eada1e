"""Multi-host runs on one machine: 2 processes x 4 CPU devices (gloo collectives) train exactly
like 1 process x 8 devices, only process 0 logs, and missing hosts or a mesh sized for one host
fail with one clear paragraph instead of hanging, aborting or training independent copies."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from child_env import child_env
from jaxscale.runtime import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# conftest's tiny_metrics: the 1-process run (8 steps, evaluated every 5) this one equals.
TRAIN = ["--config=configs/tiny_lm.py:test", "--config.train.steps=8"]
MULTIHOST = [sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
             "--devices_per_process=4", "--"]


def _run(cmd: list[str], timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    env = child_env(**env)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _metrics(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_match_one_process_and_only_process_0_logs(tmp_path, tiny_metrics):
    multi = _run([*MULTIHOST, *TRAIN, f"--workdir={tmp_path / 'multi'}"])
    assert multi.returncode == 0, (multi.stdout + multi.stderr)[-3000:]

    one, two = tiny_metrics, _metrics(tmp_path / "multi")
    # One file, one line per step: process 1 wrote nothing (no duplicated or interleaved lines).
    assert [m["step"] for m in one] == [m["step"] for m in two] == list(range(1, 9))
    assert [p.name for p in (tmp_path / "multi").rglob("metrics.jsonl")] == ["metrics.jsonl"]
    assert len(list((tmp_path / "multi" / "tensorboard").iterdir())) == 1
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in a or key in b:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
    assert "eval_loss" in two[-1]
    # One global 8-device mesh; the banner and progress come from process 0 only.
    out = multi.stdout
    assert "[p0] jaxscale: mesh data=8 pipeline=1 fsdp=1 tensor=1 (8 cpu devices)" in out
    assert "[p1] jaxscale: mesh" not in out and "[p1] step" not in out


@pytest.mark.slow
def test_missing_peer_fails_clearly_within_the_timeout(tmp_path):
    """Process 0 whose peer never comes, and process 1 whose coordinator never comes, both
    stop after --initialization_timeout with one paragraph naming the missing process."""
    def start(pid: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "launch.train", *TRAIN, f"--workdir={tmp_path / str(pid)}",
               "--cpu_devices=4", "--num_processes=2", f"--process_id={pid}",
               f"--coordinator_address=localhost:{_free_port()}",
               "--initialization_timeout=8"]
        env = child_env()
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    start_time = time.monotonic()
    alone = {pid: start(pid) for pid in (0, 1)}  # separate ports: neither finds the other
    outs = {pid: p.communicate(timeout=90) for pid, p in alone.items()}
    assert time.monotonic() - start_time < 60
    for pid, p in alone.items():
        stderr = outs[pid][1]
        assert p.returncode == 2, stderr[-3000:]
        assert "Traceback" not in stderr and "Check failure" not in stderr, stderr[-3000:]
        errors = [l for l in stderr.splitlines() if l.startswith("jaxscale: error:")]
        assert len(errors) == 1, stderr[-3000:]
        assert f"process {pid} of 2" in errors[0], errors[0]
    assert "waited 8s at localhost:" in outs[0][1] and "but process 1 never joined" in outs[0][1]
    assert "could not reach the coordinator, process 0, at localhost:" in outs[1][1]
    assert not (tmp_path / "0" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_mesh_sized_for_one_host_gives_the_mesh_error(tmp_path):
    """data=4 fits one host's 4 devices but not the global 8: every process says so."""
    out = _run([*MULTIHOST, *TRAIN, f"--workdir={tmp_path}", "--config.mesh.data=4"])
    assert out.returncode != 0
    for pid in (0, 1):
        assert f"[p{pid}] jaxscale: error: The ICI (per-slice) mesh" in out.stdout
    assert "has 4 devices but 8 are available" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


@pytest.mark.slow
def test_launcher_stops_the_others_when_one_process_fails(tmp_path):
    """A survivor would wait minutes for its dead peer; the launcher stops it after --grace_s."""
    (tmp_path / "fail_or_hang.py").write_text(
        "import sys, time\n"
        "if '--process_id=1' in sys.argv:\n"
        "    print('process 1 failing'); sys.exit(3)\n"
        "time.sleep(300)\n")
    start = time.monotonic()
    out = _run([sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
                "--module=fail_or_hang", "--grace_s=1"],
               PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    assert time.monotonic() - start < 30
    assert out.returncode == 1
    assert "[p1] process 1 failing" in out.stdout
    assert "failed processes (exit codes): {'p1': 3}; stopped ['p0']" in out.stderr


def test_a_module_python_cannot_find_is_refused_before_any_process_starts(tmp_path):
    """Otherwise every process prints the same import traceback."""
    for module in ("launch.nope", "nope.train", "jaxscale.launch"):  # the last: no __main__
        out = _run([*MULTIHOST[:-1], f"--module={module}", "--", *TRAIN,
                    f"--workdir={tmp_path}/run"])
        assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("jaxscale: error:")]
        assert len(errors) == 1 and f"--module={module} is no module" in errors[0], out.stderr
        assert "jaxscale.launch.train" in errors[0] and "PYTHONPATH" in errors[0]
        assert "Traceback" not in out.stderr and "[p0]" not in out.stdout
    assert not os.path.exists(tmp_path / "run")


def test_incomplete_flags_are_refused_before_jax_starts(monkeypatch):
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(distributed.DistributedError, match="Incomplete multi-host flags"):
        distributed.init_distributed(None, 2, 0)
    with pytest.raises(distributed.DistributedError, match="Incomplete multi-host flags"):
        distributed.init_distributed("localhost:1", 2, 2)


def test_jaxs_distributed_state_is_read_in_one_place_and_its_absence_is_said(monkeypatch):
    """Outside a joined run there is no client; a JAX that keeps its state elsewhere is named
    (pre-emption and the persistent-save barrier must not take a multi-process run for one)."""
    from jax._src import distributed as jax_distributed
    readers = [str(f) for f in pathlib.Path(distributed.__file__).parents[1].rglob("*.py")
               if "jax._src import distributed" in f.read_text()]
    assert readers == [distributed.__file__], readers
    assert distributed.jax_state() is jax_distributed.global_state
    assert distributed.coordination_client() is None  # this test process never joined
    monkeypatch.delattr(jax_distributed, "global_state")
    assert distributed.jax_state() is None
    assert distributed._fill_from_jax(None, 2, None) == (None, 2, None)
    with pytest.raises(distributed.DistributedError,
                       match=r"no `jax._src.distributed.global_state`.*supports"):
        distributed.coordination_client()


def test_join_timeout_messages_name_the_missing_processes():
    msg = distributed.join_timeout_message
    assert "but process 1 never joined" in msg("h:1", 2, 0, 10, None)
    assert "one or more of processes [1, 2, 3] never joined" in msg("h:1", 4, 0, 10, None)
    assert "one or more of processes [1, 3] never joined" in msg("h:1", 4, 2, 10, True)
    assert "could not reach the coordinator, process 0, at h:1 within 10s" in msg(
        "h:1", 4, 2, 10, False)
    for m in (msg("h:1", 2, 0, 10, None), msg(None, None, None, 5, None)):
        assert "\n" not in m and "--initialization_timeout" in m


def test_lone_process_of_a_detected_cluster_is_refused(monkeypatch):
    """Under SLURM with 4 tasks, a process that ends up alone must not train a copy."""
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed.detected_num_processes() == 4
    with pytest.raises(distributed.DistributedError, match="4 processes were expected"):
        distributed.check_not_alone(None)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    distributed.check_not_alone(None)


def test_workers_get_the_users_xla_flags_but_not_a_device_count(monkeypatch):
    """`launch.local_multihost` and a Lo-Fi job start workers that set their own device count
    (`--cpu_devices`); the user's other XLA flags (dumps, tuning, the suite's -O0, which the
    2 x 4 run above needs to equal the 1 x 8 one bit for bit) reach them unchanged."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to='/tmp/a b' "
                                    "--xla_force_host_platform_device_count=8 --xla_foo=1")
    env = distributed.worker_environment()
    assert env["XLA_FLAGS"] == "--xla_dump_to='/tmp/a b' --xla_foo=1"
    assert env["PYTHONUNBUFFERED"] == "1"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert "XLA_FLAGS" not in distributed.worker_environment()
