"""How the tests start command-line runs: one XLA flag string for the test process and every
process it starts.

XLA:CPU compiles the same HLO about twice as fast with LLVM at -O0, and a tiny model's test is
mostly compiling. The flag also changes the floating-point results (fused and vectorised
arithmetic differ), so tests that compare an in-process run with a command-line run bit for bit
need both compiled alike: conftest puts `TEST_XLA_FLAGS` in this process's XLA_FLAGS and every
child starts from `child_env()`. The simulated device count is not in it: each command-line run
sets its own with `--cpu_devices`.

jaxlib 0.10 still has XLA:CPU's older loop emitters beside the MLIR fusion emitters it uses by
default; with the older ones the suite's programs compile in about two thirds of the time (a
compiled step runs about a fifth slower; bench/RESULTS.md, `bench/suite_compile.py`). jaxlib 0.11 removed them and the flag with them, and
XLA aborts on a flag it does not know, so it is passed to jaxlib 0.10 only.
"""

from __future__ import annotations

import os
from importlib.metadata import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _test_xla_flags() -> str:
    flags = ["--xla_backend_optimization_level=0"]
    if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11):
        flags.append("--xla_cpu_use_fusion_emitters=false")
    return " ".join(flags)


TEST_XLA_FLAGS = _test_xla_flags()


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a command-line run of the repository: the tests' XLA
    flags (no device count), the repository on PYTHONPATH, then `extra`."""
    return {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS, "PYTHONPATH": ROOT, **extra}
