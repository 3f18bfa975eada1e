"""How the tests start command-line runs: one XLA flag string for the test process and every
process it starts.

XLA:CPU compiles the same HLO about twice as fast with LLVM at -O0, and a tiny model's test is
mostly compiling. The flag also changes the floating-point results (fused and vectorised
arithmetic differ), so tests that compare an in-process run with a command-line run bit for bit
need both compiled alike: conftest puts `TEST_XLA_FLAGS` in this process's XLA_FLAGS and every
child starts from `child_env()`. The simulated device count is not in it: each command-line run
sets its own with `--cpu_devices`.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a command-line run of the repository: the tests' XLA
    flags (no device count), the repository on PYTHONPATH, then `extra`."""
    return {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS, "PYTHONPATH": ROOT, **extra}
