"""Test set-up: 8 simulated CPU devices (before jax initialises), the tests' XLA flags and
strict rank promotion."""

import os
import shutil
import sys

from child_env import TEST_XLA_FLAGS, child_env

# LLVM at -O0 here and in every run the tests start (tests/child_env.py says why).
os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}"
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# gcsfs >= 2026.10 asks a gRPC control API for the bucket type (60 s time-out against the GCS
# emulator, which has none); set before gcsfs is imported. Real GCS is unaffected.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # so `configs` and `launch` import from the repo root

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

# The command-line runs the tests start (the docs' blocks, the fault and multi-process tests)
# share one persistent compilation cache for this test run: the same tiny models compile once
# instead of in every process (a docs walk-through runs `jaxscale` a dozen times). Set after
# jax is imported, so this process's own compiles stay uncached; emptied when a run starts
# (below), so every run, like CI's, starts cold.
# Every compile goes in, not only those over jax's default second: at LLVM -O0 most of the tiny
# models' programs compile in less, and the next process needs them all the same
# (measured: bench/RESULTS.md, "the suite's own time: every subprocess compile cached").
JIT_CACHE = os.path.join(ROOT, ".pytest_cache", "jit-cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", JIT_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controlling process, before any worker starts
        shutil.rmtree(JIT_CACHE, ignore_errors=True)

# More meshes, schedules and remat policies of a property that a default test already proves:
# `@pytest.mark.exhaustive` runs only with JAXSCALE_EXHAUSTIVE=1, so `make test` (and CI, 30
# minutes on 2 cores) runs one representative of each (docs/contributing.md).
EXHAUSTIVE = os.environ.get("JAXSCALE_EXHAUSTIVE") == "1"


def pytest_collection_modifyitems(config, items):
    if EXHAUSTIVE:
        return
    skip = pytest.mark.skip(reason="an exhaustive variant: JAXSCALE_EXHAUSTIVE=1 runs it")
    for item in items:
        if "exhaustive" in item.keywords:
            item.add_marker(skip)


# The uninterrupted run that the multi-process and fault tests compare with (test_multihost,
# test_local_tier_kill, test_local_tier_faults, test_local_tier, test_checkpoint_outage,
# test_preemption, test_checkpoint's SIGKILL): one per pytest process. A subprocess, so its
# train step comes from (or goes to) the compilation cache above; the 2 x 4 runs train as many
# steps, so one compile of each mesh's step serves them all. An in-process run of the same
# steps gives the same losses bit for bit.
TINY_STEPS = 8


@pytest.fixture(scope="session")
def tiny_metrics(tmp_path_factory) -> list[dict]:
    """metrics.jsonl of `configs/tiny_lm.py:test` trained TINY_STEPS steps on 1 process x 8
    devices (which 2 processes x 4 equal: test_multihost), evaluated every 5 steps (which does
    not change the training losses)."""
    import json
    import subprocess

    workdir = tmp_path_factory.mktemp("tiny_run")
    run = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py:test",
         f"--config.train.steps={TINY_STEPS}", "--config.train.log_every=1",
         "--config.train.eval_every=5", "--cpu_devices=8", f"--workdir={workdir}"],
        cwd=ROOT, env=child_env(), capture_output=True,
        text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in (workdir / "metrics.jsonl").open()]


@pytest.fixture(scope="session")
def tiny_losses(tiny_metrics) -> list[float]:
    """Its per-step training losses."""
    return [m["loss"] for m in tiny_metrics]


@pytest.fixture
def store(tmp_path):
    """A Lo-Fi store holding round 0 (the initial weights) of tests/lofi_common.py's params."""
    from jaxscale.lofi.averager import publish_initial
    from jaxscale.weights.kv import Store
    from tests.lofi_common import _params

    st = Store(str(tmp_path / "store"))
    publish_initial(st, _params(0))
    return st


# Object-store servers (tests/servers.py): one per pytest process for the session; tests that
# use one are marked `@pytest.mark.xdist_group(<server>)` so `--dist=loadgroup` keeps them on
# one worker, which then starts that server once. Each test gets a fresh bucket and the
# standard credential/endpoint environment variables (never config).
def _serve(kind):
    from tests import servers

    try:
        server = servers.start(kind)
    except servers.Unavailable as e:
        pytest.skip(f"{kind.name} cannot start here: {e}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweedfs_server():
    from tests.servers import SeaweedFS
    yield from _serve(SeaweedFS)


@pytest.fixture(scope="session")
def moto_server():
    from tests.servers import Moto
    yield from _serve(Moto)


@pytest.fixture(scope="session")
def fake_gcs_server():
    from tests.servers import FakeGCS
    yield from _serve(FakeGCS)


def _bucket(server, monkeypatch):
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    return server, server.make_bucket()


@pytest.fixture
def seaweedfs(seaweedfs_server, monkeypatch):
    """(server, fresh bucket) on SeaweedFS, with AWS_* variables pointing at it."""
    return _bucket(seaweedfs_server, monkeypatch)


@pytest.fixture
def moto(moto_server, monkeypatch):
    """(server, fresh bucket) on the moto server, with AWS_* variables pointing at it."""
    return _bucket(moto_server, monkeypatch)


@pytest.fixture
def fake_gcs(fake_gcs_server, monkeypatch):
    """(server, fresh bucket) on fake-gcs-server, with TENSORSTORE_GCS_HTTP_URL and
    STORAGE_EMULATOR_HOST pointing at it."""
    return _bucket(fake_gcs_server, monkeypatch)
