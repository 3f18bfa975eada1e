"""Shared by the AOT tests: the libtpu marks and running an entry point in a subprocess.

libtpu is loaded only in subprocesses, never in the test process. One xdist worker runs the
libtpu tests (`--dist=loadgroup`): a TPU compile keeps about 1.6 cores busy, so two at once on
a 2-core machine would only slow each other and the rest of the suite.
"""

import os
import subprocess
import sys

import pytest

from jaxscale.aot.topology import has_libtpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config=configs/llama.py:tiny", "--config.precision=bf16-mixed"]
_MARKS = [pytest.mark.skipif(not has_libtpu(),
                             reason="libtpu is not installed (pip install 'jaxscale[tpu]')"),
          pytest.mark.xdist_group("libtpu")]


def libtpu_test(fn):
    for mark in _MARKS:
        fn = mark(fn)
    return fn


def run(args: list[str], tmp_path, timeout: int = 900) -> subprocess.CompletedProcess:
    """`python ARGS...` from the repository root, with libtpu's own platform choice."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_module(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """`python -m ARGS...` (an entry point such as launch.compile)."""
    return run(["-m", *args], tmp_path)
