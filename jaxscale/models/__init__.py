"""The models and what they own: the model table, each task's loss, and `ModelDef`.

`MODELS` maps `config.model.name` to the model's config dataclass and NNX module class, and
`LOSSES` maps `config.model.task` to its loss (the LM loss lives next to the Llama, the
classification loss next to the ViT). Both are explicit tables: adding a model is one line here.
`ModelDef` is a model's static structure (graph definition plus abstract, shape-only state with
logical axes), built by name; training, evaluation, generation and conversion all start from it.
Nothing here knows about training: `train/` imports `models/`, never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxscale.errors import ConfigError
from jaxscale.models.llama import Llama, LlamaConfig, lm_loss
from jaxscale.models.vit import ViT, ViTConfig, classify_loss
from jaxscale.precision import Policy


@dataclass(frozen=True)
class ModelEntry:
    config_cls: Any  # a frozen dataclass with `from_config(model_cfg)`
    module_cls: Any  # an nnx.Module built as module_cls(cfg, rngs, policy)


MODELS: dict[str, ModelEntry] = {
    "llama": ModelEntry(LlamaConfig, Llama),
    "vit": ModelEntry(ViTConfig, ViT),
}

# Task losses by `config.model.task`: loss(model, batch, run_layers: LayerRunner | None).
LOSSES: dict[str, Callable[..., jax.Array]] = {
    "lm": lm_loss,
    "classify": classify_loss,
}


def lookup(name: str) -> tuple[Any, Any]:
    """(config dataclass, module class) of the model called `name`."""
    if name not in MODELS:
        raise ConfigError(f"Unknown model.name={name!r}; registered models: {sorted(MODELS)}.")
    entry = MODELS[name]
    return entry.config_cls, entry.module_cls


def get_loss(task: str) -> Callable[..., jax.Array]:
    if task not in LOSSES:
        raise ConfigError(f"Unknown model.task={task!r}; tasks with a loss: {sorted(LOSSES)}.")
    return LOSSES[task]


@dataclass(frozen=True)
class ModelDef:
    """The model's static structure: NNX graph definition plus abstract state with metadata."""

    graphdef: Any
    abstract: nnx.State
    make: Callable[[jax.Array], nnx.Module]

    @classmethod
    def build(cls, model_cfg: Mapping, policy: Policy) -> "ModelDef":
        config_cls, module_cls = lookup(model_cfg.get("name", "llama"))
        cfg = config_cls.from_config(model_cfg)
        make = lambda rng: module_cls(cfg, nnx.Rngs(rng), policy)
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(jax.random.key(0))))
        return cls(graphdef, abstract, make)

    def module(self, params: Mapping) -> nnx.Module:
        """An NNX module bound to `params` (call inside jit; the abstract state is copied)."""
        state = jax.tree.map(lambda x: x, self.abstract)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def logical_axes(self) -> dict[str, tuple]:
        """{'layers/attn/wq': ('layers', 'embed', 'heads', 'head_dim'), ...}."""
        return {"/".join(map(str, path)): tuple(var.get_metadata()["logical_axes"])
                for path, var in nnx.to_flat_state(self.abstract)}

    def shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {"/".join(map(str, path)): jax.ShapeDtypeStruct(var.shape, var.dtype)
                for path, var in nnx.to_flat_state(self.abstract)}

    def num_params(self) -> int:
        return sum(int(np.prod(s.shape)) for s in self.shapes().values())

    def init_params(self, rng: jax.Array) -> dict:
        return nnx.to_pure_dict(nnx.state(self.make(rng)))
