"""What differs between the jax / flax / orbax versions jaxscale supports, in one place.

jaxscale runs on jax 0.10.2 (Python 3.11; jax 0.11 dropped 3.11) through 0.12.x (Python 3.12 and
3.13), with flax 0.12.8 through 0.12.12 and orbax-checkpoint 0.12.8. Where those releases spell
something differently, the difference lives here behind one name, and the rest of the code
never tests a version (docs/contributing.md says how both ends are tested).

What differs today, and where it is handled:
- jax 0.12's XLA writes a tuple element as an operand `%t#k` instead of a `get-tuple-element`
  instruction: a fact of the HLO text, read in `aot/hlo.py` (`_tuple_elements`), which turns
  the new form into the old one; nothing in the Python APIs.
- Compile results cached by the planner depend on the compiler and the HLO it is given, so
  their cache key carries `toolchain()`.

Layer 0 of `tests/test_imports.py`: imports nothing of jaxscale.
"""

from __future__ import annotations

import functools
from importlib import metadata

_TOOLCHAIN = ("jax", "jaxlib", "libtpu", "flax")


@functools.cache
def toolchain() -> str:
    """`jax=0.12.0.1 jaxlib=0.12.0.1 libtpu=0.0.52 flax=0.12.12`: the installed versions that
    shape a compiled step (a missing package, e.g. libtpu on a GPU host, reads `-`)."""
    return " ".join(f"{name}={_version(name)}" for name in _TOOLCHAIN)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"
