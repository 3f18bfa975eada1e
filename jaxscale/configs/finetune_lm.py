"""Fine-tune a decoder from saved weights: `--config=finetune_lm[:lora]` or
`--config=finetune_lm:SIZE[,lora][,TARGET]`.

    jaxscale train --config=finetune_lm:lora --workdir=RUN --config.init_from=HF_DIR \\
        --config.data.sources='text=my/files/*.txt'

`config.init_from` is required (validation stops with a clear error until it is set): a Hugging
Face model directory (read directly, no convert step), a `launch.convert` output, a previous
run's workdir or checkpoint, a params export or a Lo-Fi store, locally or in a bucket.

Without a SIZE (`finetune_lm`, `finetune_lm:lora`) the model comes with its weights
(`config.model_from_weights`, `jaxscale/weights/resolve.py`): its fields are the ones
`init_from` records, and so is `data.tokenizer` unless it is set; the recipe is the `1b` size's
(FSDP over every local device, full remat, `bf16-mixed`, 256 x 2048 tokens a step; lower
`--config.data.batch_size` or raise `--config.train.grad_accum` to fit your devices, or name a
SIZE,TARGET preset). A `--config.model.*` flag may set the fields that do not change what the
weights compute (`resolve.SAFE`: `max_len`, `remat`, the attention kernel, loss chunks, the MoE
capacity and kernels); one that contradicts the weights (vocabulary, layers, widths, rotary,
norms, family) is refused naming each field with both values. With a SIZE, the config names its
model (SIZE and TARGET are those of `configs/llama.py`: model dims, mesh, rules, micro-batch),
and weights of another model are refused the same way.

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

`:test` (and `:test,lora`) is the small-run mode: 4 CPU steps of the recipe of
`configs/llama.py:tiny`, with `init_from=''`, so it runs without a checkpoint on the tiny model
as a stand-in (fresh random weights); pointed at weights (a tiny Hugging Face directory of any
family, a `configs/llama.py:tiny` workdir), it takes their model.
"""

from __future__ import annotations

import ml_collections as mlc

from jaxscale.configs import sibling
from jaxscale.configs._preset_parts import Size
from jaxscale.errors import ConfigError, paragraph

llama = sibling("llama")

_FULL_LR_FACTOR = 0.1
_RECIPE = "1b"  # the recipe of `finetune_lm[:lora]`, whose model comes from the weights
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
VARIANTS: tuple[str, ...] = ("test", "test,lora", "", "lora") + tuple(
    v for size in _SIZES
    for base in (size, *(f"{size},{t}" for t in llama.TARGETS if _fits(size, t)))
    for v in _with_lora(base))


def parse_arg(arg: str | None) -> tuple[str, bool]:
    """'1b,lora,v5e-16' -> ('1b,v5e-16', True): the SIZE[,TARGET] ('' without a SIZE: the
    model comes from the weights) and whether to use LoRA."""
    parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
    lora = "lora" in parts
    rest = [p for p in parts if p != "lora"]
    ok = rest in ([], ["test"]) or (0 < len(rest) <= 2 and rest[0] in _SIZES
                                    and all(t in llama.TARGETS for t in rest[1:]))
    if not ok:
        raise ConfigError(paragraph(
            f"configs/finetune_lm.py: cannot read the argument {arg!r}. Use nothing or lora (the",
            "model comes with config.init_from's weights), test[,lora], or SIZE[,lora][,TARGET]",
            f"with SIZE in {', '.join(_SIZES)} and TARGET in {', '.join(llama.TARGETS)}, e.g.",
            ":1b,lora,v5e-16 (a TARGET sizes the micro-batch for a model it knows: name a SIZE).",
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
    c = llama.get_config("tiny") if test else _base_config(base or _RECIPE)
    pretrain_lr = c.optim.lr
    c.init_from = "" if test else mlc.config_dict.placeholder(str)
    c.model_from_weights = base in ("", "test")  # the model is a stand-in for init_from's
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
