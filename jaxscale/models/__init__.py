"""Model registry: `config.model.name` -> (config dataclass, NNX module class, task loss name).

Each model module registers itself here; `ModelDef.build` looks models up by name.
"""

from __future__ import annotations

from typing import Any

MODELS: dict[str, tuple[Any, Any]] = {}


def register(name: str, config_cls: Any, module_cls: Any) -> None:
    MODELS[name] = (config_cls, module_cls)


def lookup(name: str) -> tuple[Any, Any]:
    # Importing the model modules registers them.
    from jaxscale.models import llama  # noqa: F401
    try:
        from jaxscale.models import vit  # noqa: F401
    except ImportError:
        pass
    if name not in MODELS:
        from jaxscale.errors import ConfigError
        raise ConfigError(f"Unknown model.name={name!r}; registered models: {sorted(MODELS)}.")
    return MODELS[name]
