"""The bundled experiment configs, and how a `--config=` value finds one from any directory.

Each config is a Python file with `get_config(arg=None)` (ml_collections loads it by path).
They ship inside the package so that `--config=tiny_lm` (or `tiny_lm.py`, `configs/tiny_lm.py`)
names the bundled file from anywhere, while a value naming an existing file always means that
file: a user's own `configs/my_run.py` is never shadowed by a bundled one.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

DIRECTORY = os.path.dirname(os.path.abspath(__file__))


def bundled_names() -> list[str]:
    """Names of the bundled configs (`tiny_lm`, `llama`, ...)."""
    return sorted(f[:-3] for f in os.listdir(DIRECTORY)
                  if f.endswith(".py") and not f.startswith("_"))


def resolve(spec: str) -> str:
    """`file.py[:arg]` with the file made concrete: an existing file stays as given; otherwise
    `NAME`, `NAME.py` or `configs/NAME.py` of a bundled config becomes its path in the package."""
    path, sep, arg = spec.partition(":")
    if not path or os.path.isfile(path):
        return spec
    name = path.removeprefix("configs/").removesuffix(".py")
    if name in bundled_names():
        return os.path.join(DIRECTORY, f"{name}.py") + sep + arg
    return spec


def sibling(name: str) -> ModuleType:
    """The bundled config `NAME` as a module, for a config built on another (`mixtral` and
    `finetune_lm` on `llama`): loaded by path, as ml_collections loads config files, so it
    works from any directory; one module per name (dataclasses look their module up while it
    executes)."""
    key = f"_jaxscale_configs_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, os.path.join(DIRECTORY, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
