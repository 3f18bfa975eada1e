"""Test set-up: 8 simulated CPU devices (before jax initialises) and strict rank promotion."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # so `configs` and `launch` import from the repo root

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def store(tmp_path):
    """A Lo-Fi store holding round 0 (the initial weights) of tests/lofi_common.py's params."""
    from jaxscale.lofi import store as S
    from jaxscale.lofi.averager import publish_initial
    from tests.lofi_common import _params

    st = S.Store(str(tmp_path / "store"))
    publish_initial(st, _params(0))
    return st
