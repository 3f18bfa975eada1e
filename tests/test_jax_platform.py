"""A command run on a machine whose only usable platform is the CPU starts the CPU alone: an
installed libtpu does not start (and print its INVALID_ARGUMENT lines) where no TPU is attached."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from jax._src import hardware_utils

from child_env import ROOT, child_env
from jaxscale.runtime import jax_platform

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu, whose start-up this is about, is not installed")
@pytest.mark.skipif(not jax_platform.only_cpu_usable(),
                    reason="this machine has an accelerator: the command rightly starts it")
def test_a_cpu_only_machine_runs_without_libtpus_start_up_lines(tmp_path):
    env = {k: v for k, v in child_env().items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-m", "launch.inspect", "--config=tiny_lm:test"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cpu devices" in done.stdout
    for noise in ("INVALID_ARGUMENT", "TPU_ACCELERATOR_TYPE", "libtpu"):
        assert noise not in done.stderr, done.stderr[-3000:]


def test_an_attached_tpu_or_another_plugin_keeps_every_platform(monkeypatch):
    if HAS_LIBTPU:
        monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id",
                            lambda: (4, None))
        assert not jax_platform.only_cpu_usable()
        monkeypatch.setattr(hardware_utils, "num_available_tpu_chips_and_device_id",
                            lambda: (0, None))
    monkeypatch.setattr(jax_platform, "entry_points",
                        lambda group: ["xla_cuda12"] if group == "jax_plugins" else [])
    assert not jax_platform.only_cpu_usable()


def test_a_platform_the_user_chose_is_kept(monkeypatch):
    """Even where the CPU is all there is: chosen in the environment or in jax's config (this
    process's, set from JAX_PLATFORMS=cpu by conftest before jax started)."""
    import jax
    monkeypatch.setattr(jax_platform, "only_cpu_usable", lambda: True)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    jax_platform.cpu_when_no_accelerator()
    assert os.environ["JAX_PLATFORMS"] == "cuda"
    monkeypatch.delenv("JAX_PLATFORMS")
    assert jax.config.jax_platforms
    jax_platform.cpu_when_no_accelerator()
    assert "JAX_PLATFORMS" not in os.environ  # the config's choice stands; nothing was set
