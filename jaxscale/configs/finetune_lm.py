"""Fine-tune a Llama from saved weights: `--config=configs/finetune_lm.py:SIZE[,lora][,TARGET]`.

    python -m launch.train --config=configs/finetune_lm.py:1b,lora,v5e-16 --workdir=RUN \\
        --config.init_from=WEIGHTS

SIZE and TARGET are those of `configs/llama.py` (model dims, mesh, rules, micro-batch); the
model must match the weights, so for a converted Hugging Face model also pass the
`--config.model.*` flags `launch.convert` prints. `config.init_from` is required (validation
stops with a clear error until it is set): a `launch.convert` output, a previous run's workdir
or checkpoint, a params export or a Lo-Fi store.

Against pre-training it changes what fine-tuning needs: the learning rate is a tenth of the
pre-training one for full fine-tuning (the weights are already good; large steps would undo
them), warm-up is short (50 steps), there is no weight decay, data is the `b` half of the corpus
(`data.part='b'`: pre-train with `--config.data.part=a` and the fine-tuning text is unseen), and
a checkpoint is written every 200 steps (evaluation too, unless the target accumulates
gradients: see `configs/llama.py`). `lora` trains rank-16 adapters (alpha 32) on every
attention and MLP projection instead: the base weights are frozen (no gradients or optimizer
state) and, because the adapters start at zero, at the pre-training learning rate.

`:test` (and `:test,lora`) is the small-run mode: the tiny model of `configs/llama.py:tiny` for 4
CPU steps, with `init_from=''` (fresh random weights) so it runs without a checkpoint; point it at
a `configs/llama.py:tiny` workdir to fine-tune real weights.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import ml_collections as mlc

from jaxscale.errors import ConfigError, paragraph


def _sibling(name: str) -> ModuleType:
    """Loads configs/NAME.py by path: config files are loaded by path too, from any directory."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_jaxscale_configs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


llama = _sibling("llama")

_FULL_LR_FACTOR = 0.1
_LORA = dict(rank=16, alpha=32.0, targets=("attn/w[qkvo]$", "mlp/w_(gate|up|down)$"))

VARIANTS: tuple[str, ...] = ("test", "test,lora") + tuple(
    v for base in llama.VARIANTS if not base.startswith("tiny")
    for v in (base, base.replace(",", ",lora,", 1) if "," in base else f"{base},lora"))


def parse_arg(arg: str | None) -> tuple[str, bool]:
    """'1b,lora,v5e-16' -> ('1b,v5e-16', True): the llama.py argument and whether to use LoRA."""
    parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
    lora = "lora" in parts
    rest = [p for p in parts if p != "lora"]
    sizes = [s for s in llama.SIZES if s != "tiny"]
    ok = rest == ["test"] or (0 < len(rest) <= 2 and rest[0] in sizes
                              and all(t in llama.TARGETS for t in rest[1:]))
    if not ok:
        raise ConfigError(paragraph(
            f"configs/finetune_lm.py: cannot read the argument {arg!r}. Use test[,lora] or",
            f"SIZE[,lora][,TARGET] with SIZE in {', '.join(sizes)}",
            f"and TARGET in {', '.join(llama.TARGETS)}, e.g. :1b,lora,v5e-16.",
        ))
    return ",".join(rest), lora


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    base, use_lora = parse_arg(arg)
    test = base == "test"
    c = llama.get_config("tiny" if test else base)  # raises listing sizes / targets
    pretrain_lr = c.optim.lr
    c.init_from = "" if test else mlc.config_dict.placeholder(str)
    c.data.part = "b"
    c.optim.update(lr=pretrain_lr * (1.0 if use_lora else _FULL_LR_FACTOR), warmup_steps=50,
                   weight_decay=0.0, min_lr_ratio=0.1)
    c.train.update(steps=2000, eval_every=200 if c.train.eval_every else 0)  # 0: accumulating
    c.checkpoint.update(every=200, keep=2)
    if use_lora:
        c.lora.update(_LORA)
    if test:
        c.optim.warmup_steps = 1
        c.train.update(steps=4, log_every=1, eval_every=2)
        c.checkpoint.update(every=2, keep=1)
        if use_lora:
            c.lora.update(rank=4, alpha=8.0)
    return c
