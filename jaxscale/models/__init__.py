"""The model table and `ModelDef`: every fact generic code needs about a model, in one place.

`MODELS` maps `config.model.name` to its `ModelEntry`: the config dataclass and NNX module
class, its tasks by `config.model.task` (loss, batch preparation, held-out sums: `task.py`), its
FLOP counts per token, its checks (of its own fields, and of the mesh where it splits sequences
or experts), its attention component (`attention/component.py`: cache and bytes, for the AOT
memory and traffic models) and where its Hugging Face import/export lives. Training, evaluation,
metrics, conversion, weight sources, config validation and ahead-of-time accounting ask the
entry and never name a model, so adding a family is one new module plus one line here.
`ModelDef` is a model's static structure (graph definition plus abstract, shape-only state with
logical axes) and its task, built from `config.model`; training, evaluation, generation and
conversion all start from it. Nothing here knows about training: `train/` imports `models/`,
never the reverse.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxscale.errors import ConfigError, ConversionError, paragraph
from jaxscale.models import vit
from jaxscale.models.attention.component import AttentionKind
from jaxscale.models.attention.kinds import attention_of
from jaxscale.models.decoder import flops, gemma, gpt_oss, lm_task, qwen
from jaxscale.models.decoder.config import LlamaConfig, check_config, check_mesh
from jaxscale.models.decoder.llama import Llama
from jaxscale.models.nn.scan import check_remat
from jaxscale.models.task import Task
from jaxscale.precision import Policy

# A count per token of a `config.model` section at a sequence length: (model_cfg, seq_len).
FlopCount = Callable[[Mapping[str, Any], int], float]


@dataclass(frozen=True)
class HuggingFace:
    """Where a model's Hugging Face import/export lives, as "module:function" names: `interop/`
    imports the models, so the table names its converters and `hf_opener` / `hf_saver` import
    them when a conversion needs one."""

    model_type: str  # the `model_type` of the HF config.json
    opener: str      # hf_dir -> interop.hf.Source (model config + lazy leaves)
    saver: str       # (model, out_dir, dtype=, max_shard_size=) -> the directory written


@dataclass(frozen=True)
class ModelEntry:
    """What generic code may ask of a model family; a fact left None is one the family lacks
    (no MFU, no analytic AOT count, no Hugging Face conversion), never a wrong number."""

    config_cls: Any  # a frozen dataclass with `from_config(model_cfg)`
    module_cls: Any  # an nnx.Module built as module_cls(cfg, rngs, policy)
    tasks: Mapping[str, Task]  # by `config.model.task`; the first is the model's own
    flops_per_token: FlopCount | None = None  # training FLOPs (PaLM convention); None: no MFU
    # Attention matmul FLOPs per token (remat recompute included) that a Pallas attention
    # kernel (`model.attention=splash`) computes where the HLO shows no dot to count.
    attention_flops: FlopCount | None = None
    recompute_flops: FlopCount | None = None  # matmul FLOPs per token that remat recomputes
    # Matmul FLOPs per token spent on padding the model count leaves out (MoE capacity buffers'
    # empty slots); None: none.
    padding_flops: FlopCount | None = None
    hf: HuggingFace | None = None  # Hugging Face import/export; None: none
    # The family's own `config.model` checks at a sequence length (ConfigError paragraphs).
    check: Callable[[Mapping[str, Any], int], None] | None = None
    # Its checks against `config.mesh`: (model_cfg, mesh_cfg, seq_len, pipeline repeats). None:
    # the family splits neither sequences (`mesh.context`) nor experts (`mesh.expert`).
    check_mesh: Callable[[Mapping[str, Any], Mapping[str, Any], int, int], None] | None = None
    # The attention component of a `config.model` section (`models/attention/component.py`:
    # its cache, bytes and widths, for the AOT memory and traffic models); None: none to ask.
    attention: Callable[[Mapping[str, Any]], AttentionKind] | None = None

    def task(self, name: str | None, model_name: str = "") -> Task:
        """The task called `name` (None or empty: the model's own)."""
        if not name:
            return next(iter(self.tasks.values()))
        if name not in self.tasks:
            raise ConfigError(paragraph(
                f"Unknown model.task={name!r} for model.name={model_name!r}; its tasks:",
                f"{sorted(self.tasks)}. Leave model.task out for the model's own task."))
        return self.tasks[name]


def _decoder(config_cls: Any, hf: HuggingFace) -> ModelEntry:
    """The entry of a decoder family (`decoder/`): the Llama decoder with its config class's
    switch defaults, so the same module, task, checks and FLOP counts (biases and norms add no
    matmul), each read with that class's defaults (e.g. its attention kind)."""
    def of_family(fn: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(fn, config_cls=config_cls)

    return ModelEntry(config_cls, Llama, {"lm": lm_task.LM},
                      flops_per_token=of_family(flops.flops_per_token),
                      attention_flops=of_family(flops.attention_flops_per_token),
                      recompute_flops=of_family(flops.recompute_flops_per_token),
                      padding_flops=flops.padding_flops_per_token,
                      hf=hf, check=of_family(check_config), check_mesh=check_mesh,
                      attention=lambda m: attention_of(config_cls.from_config(m)))


DEFAULT_MODEL = "llama"  # what a config without `model.name` builds

MODELS: dict[str, ModelEntry] = {
    "llama": _decoder(LlamaConfig, HuggingFace(
        "llama", "jaxscale.interop.hf:open_llama", "jaxscale.interop.hf:save_llama")),
    # The Llama decoder with `sliding_window` (Mistral's config.json): the same module and task.
    "mistral": _decoder(LlamaConfig, HuggingFace(
        "mistral", "jaxscale.interop.hf_mistral:open_mistral",
        "jaxscale.interop.hf_mistral:save_mistral")),
    # The Llama decoder with its switches on (decoder/qwen.py): its facts, other defaults.
    "qwen2": _decoder(qwen.Qwen2Config, HuggingFace(
        "qwen2", "jaxscale.interop.hf_qwen:open_qwen2", "jaxscale.interop.hf_qwen:save_qwen")),
    "qwen3": _decoder(qwen.Qwen3Config, HuggingFace(
        "qwen3", "jaxscale.interop.hf_qwen:open_qwen3", "jaxscale.interop.hf_qwen:save_qwen")),
    # The decoder with `model.moe` (moe/) on every layer: Mistral's / Qwen3's attention.
    "mixtral": _decoder(LlamaConfig, HuggingFace(
        "mixtral", "jaxscale.interop.hf_moe:open_mixtral", "jaxscale.interop.hf_moe:save_moe")),
    "qwen3_moe": _decoder(qwen.Qwen3Config, HuggingFace(
        "qwen3_moe", "jaxscale.interop.hf_moe:open_qwen3_moe",
        "jaxscale.interop.hf_moe:save_moe")),
    # The decoder with attention sinks, biases, a local/global pattern and biased experts
    # with the clamped SwiGLU on every layer (decoder/gpt_oss.py).
    "gpt_oss": _decoder(gpt_oss.GptOssConfig, HuggingFace(
        "gpt_oss", "jaxscale.interop.hf_gpt_oss:open_gpt_oss",
        "jaxscale.interop.hf_gpt_oss:save_gpt_oss")),
    # The Llama decoder with Gemma's switches and local/global pattern (decoder/gemma.py).
    # DeepSeek-V3: latent attention and sigmoid group-limited routing (attention/latent.py,
    # moe/routers.py), set by the converter and the presets.
    "deepseek_v3": _decoder(LlamaConfig, HuggingFace(
        "deepseek_v3", "jaxscale.interop.hf_deepseek:open_deepseek_v3",
        "jaxscale.interop.hf_deepseek:save_deepseek")),
    # DeepSeek-V2 / V2-Lite: V3's layout with softmax routing and no selection bias.
    "deepseek_v2": _decoder(LlamaConfig, HuggingFace(
        "deepseek_v2", "jaxscale.interop.hf_deepseek_v2:open_deepseek_v2",
        "jaxscale.interop.hf_deepseek_v2:save_deepseek_v2")),
    "gemma3": _decoder(gemma.Gemma3Config, HuggingFace(
        "gemma3_text", "jaxscale.interop.hf_gemma:open_gemma3",
        "jaxscale.interop.hf_gemma:save_gemma")),
    "gemma2": _decoder(gemma.Gemma2Config, HuggingFace(
        "gemma2", "jaxscale.interop.hf_gemma:open_gemma2", "jaxscale.interop.hf_gemma:save_gemma")),
    "vit": ModelEntry(
        vit.ViTConfig, vit.ViT, {"classify": vit.CLASSIFY},
        flops_per_token=vit.flops_per_token,
        hf=HuggingFace("vit", "jaxscale.interop.hf_vit:open_vit",
                       "jaxscale.interop.hf_vit:save_vit")),
}


def entry(name: str) -> ModelEntry:
    """The table entry of the model called `name`."""
    if name not in MODELS:
        raise ConfigError(f"Unknown model.name={name!r}; registered models: {sorted(MODELS)}.")
    return MODELS[name]


def entry_of(model_cfg: Mapping[str, Any]) -> ModelEntry:
    """The table entry of a `config.model` section."""
    return entry(model_cfg.get("name", DEFAULT_MODEL))


def task_of(model_cfg: Mapping[str, Any]) -> Task:
    """The task a `config.model` section trains: its `task`, or the model's own."""
    name = model_cfg.get("name", DEFAULT_MODEL)
    return entry(name).task(model_cfg.get("task"), name)


def check_model(model_cfg: Mapping[str, Any], seq_len: int,
                mesh_cfg: Mapping[str, Any] | None = None, repeats: int = 1) -> None:
    """The `config.model` section's checks (`config.validate` calls this): a known model, a task
    it has, a known remat policy, and the family's own checks; with `config.mesh` (and
    `pipeline.repeats`), the family's checks against it, or, for a family without any, that the
    mesh splits no sequences and no experts."""
    e = entry_of(model_cfg)
    task_of(model_cfg)
    check_remat(model_cfg.get("remat", "none"))
    if e.check is not None:
        e.check(model_cfg, seq_len)
    if mesh_cfg is None:
        return
    if e.check_mesh is not None:
        e.check_mesh(model_cfg, mesh_cfg, seq_len, repeats)
        return
    for axis, what in (("context", "sequence shards"), ("expert", "experts")):
        size = mesh_cfg.get(axis, 1) * mesh_cfg.get(f"dcn_{axis}", 1)
        if size > 1:
            name = model_cfg.get("name", DEFAULT_MODEL)
            raise ConfigError(paragraph(
                f"mesh.{axis} x mesh.dcn_{axis}={size}, but model.name={name!r} has no {what} to",
                f"split over it. Set --config.mesh.{axis}=1 (and mesh.dcn_{axis}=1) and use",
                "mesh.data or mesh.fsdp for those devices."))


def _resolve(dotted: str) -> Callable:
    module, name = dotted.split(":")
    return getattr(importlib.import_module(module), name)


def hf_opener(hf_config: Mapping[str, Any], where: str) -> Callable[[str], Any]:
    """The opener (hf_dir -> `interop.hf.Source`) of the family whose `model_type` a Hugging
    Face config.json at `where` names (the default model's when it names none)."""
    families = {e.hf.model_type: e.hf for e in MODELS.values() if e.hf is not None}
    model_type = hf_config.get("model_type", MODELS[DEFAULT_MODEL].hf.model_type)
    if model_type not in families:
        raise ConversionError(paragraph(
            f"{where}/config.json has model_type={model_type!r}; jaxscale converts",
            f"{sorted(families)}, the model_types of the model table (jaxscale/models/__init__.py).",
            "Convert a checkpoint of one of those architectures, or add the family: a converter",
            "module under jaxscale/interop/ and a MODELS line naming it.",
        ))
    return _resolve(families[model_type].opener)


def hf_saver(model_cfg: Mapping[str, Any]) -> Callable[..., str]:
    """The saver writing the Hugging Face layout of a `config.model` section's family."""
    hf = entry_of(model_cfg).hf
    if hf is None:
        name = model_cfg.get("name", DEFAULT_MODEL)
        exporters = sorted(n for n, e in MODELS.items() if e.hf is not None)
        raise ConversionError(f"model.name={name!r} has no Hugging Face exporter; "
                              f"supported: {exporters}.")
    return _resolve(hf.saver)


def lookup(name: str) -> tuple[Any, Any]:
    """(config dataclass, module class) of the model called `name`."""
    e = entry(name)
    return e.config_cls, e.module_cls


@dataclass(frozen=True)
class ModelDef:
    """The model's static structure: NNX graph definition plus abstract state with metadata."""

    graphdef: Any
    abstract: nnx.State
    make: Callable[[jax.Array], nnx.Module]
    task: Task  # what the step's loss and evaluation compute (`config.model.task`)

    @classmethod
    def build(cls, model_cfg: Mapping, policy: Policy) -> "ModelDef":
        e, task = entry_of(model_cfg), task_of(model_cfg)
        cfg = e.config_cls.from_config(model_cfg)
        make = lambda rng: e.module_cls(cfg, nnx.Rngs(rng), policy)
        if policy.quantized is not None:
            # `int8` swaps the projection modules for qwix's (adapters/int8.py); qwix is
            # imported only here, so runs that do not quantize never pay its import.
            from jaxscale.models.adapters import int8

            plain = make
            make = lambda rng: int8.quantize(plain(rng), policy)
        return cls(*nnx.split(nnx.eval_shape(lambda: make(jax.random.key(0)))), make, task)

    def remade(self, make: Callable[[jax.Array], nnx.Module]) -> "ModelDef":
        """The same model and task built by `make` instead (e.g. with LoRA adapters)."""
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(jax.random.key(0))))
        return dataclasses.replace(self, graphdef=graphdef, abstract=abstract, make=make)

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
