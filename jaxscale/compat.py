"""What differs between the jax / flax / orbax versions jaxscale supports, in one place.

jaxscale runs on jax 0.10.2 (Python 3.11; jax 0.11 dropped 3.11) through 0.12.x (Python 3.12 and
3.13), with flax 0.12.8 through 0.12.12 and orbax-checkpoint 0.12.8. Where those releases spell
something differently, the difference lives here behind one name, and the rest of the code
never tests a version (docs/contributing.md says how both ends are tested).

What differs today, and where it is handled:
- jax 0.12's XLA writes a tuple element as an operand `%t#k` instead of a `get-tuple-element`
  instruction: a fact of the HLO text, read in `aot/hlo.py` (`_tuple_elements`), which turns
  the new form into the old one; nothing in the Python APIs.
- Compile results cached by the planner depend on the compiler and the HLO it is given: their
  cache key carries the jax, jaxlib and libtpu versions (`aot.search.code_version`).
- jax 0.12 lowers the same step to different memory under the same libtpu (the presets from
  13% less to 10% more, the 7B v5p step 16 KiB less; bench/RESULTS.md): the recorded
  memory (`configs/llama.py`'s `COMPILED`, from jax 0.10.2) is matched exactly only under the
  jax it was recorded with (`memory_drifted`).
- `jax.core.jaxprs_in_params` is gone in jax 0.12; `jax.extend.core.jaxprs_in_params`, in both,
  is the one spelling used.

Layer 0 of `tests/test_imports.py`: imports nothing of jaxscale.
"""

from __future__ import annotations

from importlib import metadata


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


# The jax that `configs/llama.py`'s COMPILED table (bench/presets.py) was recorded under.
PRESETS_RECORDED_WITH = "0.10.2"


def memory_drifted(compiled_gib: float, recorded_gib: float) -> bool:
    """Whether a preset's compiled memory has moved from its record enough for `bench/presets.py
    --check` to ask for a rerun: by over 0.02 GiB either way under the jax the record was made
    with. Under another jax the lowering differs by more than any fixed tolerance (jax 0.12 on
    the presets: 125m 1.5-1.9% less, 1b up to 13% less, 7b on v5e-256 10% more), so there the
    check guards only what matters, the fit within the margin, which it tests on its own."""
    if _version("jax") == PRESETS_RECORDED_WITH:
        return abs(compiled_gib - recorded_gib) > 0.02
    return False
