"""Fine-tune a decoder from saved weights: `--config=configs/finetune_lm.py:SIZE[,lora][,TARGET]`.

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

Besides the Llama sizes, SIZE may be a small model of another decoder family at its published
shapes (`FAMILIES`, with the recipe of the closest Llama size), sized for each TARGET by the
memory estimate: docs/fine-tune-families.md ("The published sizes") has the shapes, parameter
counts and what the TPU compiler makes of the estimate.

`:test` (and `:test,lora`) is the small-run mode: the tiny model of `configs/llama.py:tiny` for 4
CPU steps, with `init_from=''` (fresh random weights) so it runs without a checkpoint; point it at
a `configs/llama.py:tiny` workdir to fine-tune real weights.
"""

from __future__ import annotations

import ml_collections as mlc

from jaxscale.configs import sibling
from jaxscale.configs._preset_parts import Size
from jaxscale.errors import ConfigError, paragraph

llama = sibling("llama")

_FULL_LR_FACTOR = 0.1
_LORA = dict(rank=16, alpha=32.0, targets=("attn/w[qkvo]$", "mlp/w_(gate|up|down)$"))

# Other families of the model table at their published shapes, with the recipe of the closest
# Llama size; `norm_eps`, `rope_theta` and `max_len` as their config.json has them.
_QWEN = dict(vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True)
_RECIPE_1B = dict(strategy="fsdp", remat="full", seq_len=2048, batch=256, lr=3e-4, warmup=2000,
                  steps=50_000)
# Gemma: head_dim 256 (not embed / heads), scores scaled by 1/sqrt(256), tied embeddings.
_GEMMA = dict(head_dim=256, query_pre_attn_scalar=256.0, norm_eps=1e-6, tie_embeddings=True)


def _pattern(layers: int, period: int) -> tuple[str, ...]:
    """HF's layer_types for a `sliding_window_pattern`: every period-th layer global."""
    return tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention"
                 for i in range(layers))


FAMILIES: dict[str, Size] = {
    "qwen3-0.6b": Size(dict(_QWEN, name="qwen3", embed=1024, num_layers=28, num_heads=16,
                                  num_kv_heads=8, head_dim=128, mlp=3072, max_len=40960),
                             **_RECIPE_1B),
    "qwen2.5-0.5b": Size(dict(_QWEN, name="qwen2", embed=896, num_layers=24, num_heads=14,
                                    num_kv_heads=2, head_dim=64, mlp=4864, max_len=32768),
                               **_RECIPE_1B),
    "mistral-7b": Size(dict(name="mistral", vocab_size=32768, embed=4096, num_layers=32,
                                  num_heads=32, num_kv_heads=8, head_dim=128, mlp=14336,
                                  max_len=32768, rope_theta=1e6, norm_eps=1e-5,
                                  tie_embeddings=False, sliding_window=0),
                             **dict(_RECIPE_1B, batch=512, steps=100_000)),
    "gemma3-1b": Size(dict(_GEMMA, name="gemma3", vocab_size=262144, embed=1152,
                                 num_layers=26, num_heads=4, num_kv_heads=1, mlp=6912,
                                 max_len=32768, rope_theta=1e6, rope_local_theta=1e4,
                                 sliding_window=512, layer_types=_pattern(26, 6)),
                            **_RECIPE_1B),
    "gemma2-2b": Size(dict(_GEMMA, name="gemma2", vocab_size=256000, embed=2304,
                                 num_layers=26, num_heads=8, num_kv_heads=4, mlp=9216,
                                 max_len=8192, rope_theta=1e4, sliding_window=4096,
                                 layer_types=_pattern(26, 2), attn_softcap=50.0,
                                 final_softcap=30.0),
                            **_RECIPE_1B),
}


def _fits(size: str, target: str) -> bool:
    if size in FAMILIES:
        return llama.why_not(size, target, FAMILIES) is None
    return f"{size},{target}" in llama.VARIANTS


def _with_lora(base: str) -> tuple[str, str]:
    """'1b,v5e-16' -> ('1b,v5e-16', '1b,lora,v5e-16'): a base variant and its LoRA spelling."""
    return base, (base.replace(",", ",lora,", 1) if "," in base else f"{base},lora")


_SIZES = tuple(s for s in llama.SIZES if s != "tiny") + tuple(FAMILIES)
VARIANTS: tuple[str, ...] = ("test", "test,lora") + tuple(
    v for size in _SIZES
    for base in (size, *(f"{size},{t}" for t in llama.TARGETS if _fits(size, t)))
    for v in _with_lora(base))


def parse_arg(arg: str | None) -> tuple[str, bool]:
    """'1b,lora,v5e-16' -> ('1b,v5e-16', True): the SIZE[,TARGET] and whether to use LoRA."""
    parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
    lora = "lora" in parts
    rest = [p for p in parts if p != "lora"]
    ok = rest == ["test"] or (0 < len(rest) <= 2 and rest[0] in _SIZES
                              and all(t in llama.TARGETS for t in rest[1:]))
    if not ok:
        raise ConfigError(paragraph(
            f"configs/finetune_lm.py: cannot read the argument {arg!r}. Use test[,lora] or",
            f"SIZE[,lora][,TARGET] with SIZE in {', '.join(_SIZES)}",
            f"and TARGET in {', '.join(llama.TARGETS)}, e.g. :1b,lora,v5e-16.",
        ))
    if len(rest) == 2 and rest[0] in FAMILIES and not _fits(*rest):
        size, target = rest
        fits = [t for t in llama.TARGETS if _fits(size, t)]
        raise ConfigError(paragraph(
            f"configs/finetune_lm.py:{size},{target}: the {size} model does not fit {target}:",
            f"{llama.why_not(size, target, FAMILIES)}. Targets that fit {size}:",
            f"{', '.join(fits)}.",
        ))
    return ",".join(rest), lora


def _base_config(base: str) -> mlc.ConfigDict:
    """The pre-training config of SIZE[,TARGET]: `configs/llama.py`'s, or a family's built the
    same way (`llama.build` over `FAMILIES`)."""
    size, *target = base.split(",")
    if size in FAMILIES:
        return llama.build(size, target[0] if target else None, sizes=FAMILIES)
    return llama.get_config(base)  # raises listing sizes / targets


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    base, use_lora = parse_arg(arg)
    test = base == "test"
    c = llama.get_config("tiny") if test else _base_config(base)
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
