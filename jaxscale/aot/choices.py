"""The memory-relevant choices a language-model config can make, and advice built from them.

One place says which attention kernels and loss chunkings apply to a config, so that the
planner searches exactly those and the out-of-HBM advice (`launch.compile`'s error, the
planner's "no candidate fits") suggests only what applies and what the config does not do yet.
"""

from __future__ import annotations

import ml_collections as mlc

from jaxscale.errors import ConfigError, paragraph

# Splash first: it never holds the (B, H, T, T) scores einsum keeps, so for the same settings it
# fits wherever einsum does (1B without remat, 64 x 2,048 tokens on v5p-16: see bench/RESULTS.md).
ATTENTIONS = ("splash", "einsum")
# The LM head and loss whole, then in 8 chunks (`model.loss_chunks`): chunking costs one more
# head forward pass (0.5% of the compiled FLOPs of a 7B step) and keeps only a chunk of the
# float32 logits and their gradient: 10 GiB less temporaries per chip for 7B under fsdp=4 x
# tensor=4 at 512 x 2,048 tokens on v5p-16 (96.25 -> 86.22 GiB, bench/RESULTS.md). The
# config's default, 0, chooses at trace time (`models.decoder.lm_task.loss_chunks_for`); the planner
# spells its candidates' count out, so each compile, guess and winner's flags say what ran.
LOSS_CHUNKS = (1, 8)
ADAM = ("adamw", "adam")  # the optimizers whose two float32 moments 8-bit Adam replaces
# Remat policies that keep more than q/k/v (`models/nn/scan.py`): for them `save_qkv_proj` is
# advised before `full`, most of full's saving at less recompute (7B on v5e-256: 10.6 GiB per
# chip, 8% faster than full by the estimate; bench/RESULTS.md).
KEEPS_MORE_THAN_QKV = ("none", "dots", "dots_no_batch", "minimal", "save_dot_except_mlp")


def require_language_model(config: mlc.ConfigDict) -> None:
    """AOT compilation builds a language-model step (token batches): refuse a model whose task
    trains on anything else (its model table entry says so: `Task.token_batches`)."""
    from jaxscale.models import DEFAULT_MODEL, task_of  # late: the models pull in jax

    if not task_of(config.model).token_batches:
        name = config.model.get("name", DEFAULT_MODEL)
        raise ConfigError(paragraph(
            "Ahead-of-time compilation and planning build a language model's train step on",
            f"token batches; model.name={name!r} is not one. Use a Llama config (e.g.",
            "--config=llama:1b), or measure this model with `launch.inspect` on CPU devices.",
        ))


def attentions(config: mlc.ConfigDict) -> tuple[str, ...]:
    """The attention kernels that apply: splash and einsum where the splash kernel can run
    (a sequence length on its 128 grid), else the config's own."""
    from jaxscale.models.attention.splash import block_size

    if block_size(config.data.seq_len) is not None:
        return ATTENTIONS
    return (config.model.get("attention", "einsum"),)


# Context parallelism is searched for sequences at least this long (`model.context_attention` and
# `mesh.context`, `models/attention/sequence/context.py`): below it one chip holds a sequence's
# activations with room to spare, and the shards' attention traffic would only cost.
LONG_SEQUENCE = 32768
CONTEXT_SIZES = (2, 4, 8, 16)
CONTEXT_VARIANTS = ("ring", "allgather")  # the ring first: no whole-sequence K/V per chip


def context_options(config: mlc.ConfigDict, chips: int) -> list[dict]:
    """The sequence shardings to search: none, and for a long sequence (`LONG_SEQUENCE`)
    every `mesh.context` in `CONTEXT_SIZES` that divides the chips and the length (the
    zigzag order's 2 x context chunks too) with each attention variant."""
    options = [{}]
    seq = config.data.seq_len
    if seq < LONG_SEQUENCE:
        return options
    return options + [{"mesh.context": c, "model.context_attention": v}
                      for c in CONTEXT_SIZES if chips % c == 0 and seq % (2 * c) == 0
                      for v in CONTEXT_VARIANTS]


# The logits' dtype: under `bf16-mixed` the head's matmul output is float32; the override keeps
# it in bf16 (`precision.py`; the loss still reduces in float32), the same FLOPs with less HBM
# and half the bytes of the head's float32 gradient traffic (7B on v5e-256: 0.35 GiB less per
# chip, 2.6 ms less by the no-overlap estimate, bench/RESULTS.md). Searched first.
BF16_LOGITS = ",logits=bfloat16"


def precisions(config: mlc.ConfigDict) -> tuple[str, ...]:
    """The precision policies to search: the config's, and where it is `bf16-mixed` without
    overrides, with bf16 logits first (the same work: float32 weights, bf16 compute)."""
    if config.precision == "bf16-mixed":
        return (config.precision + BF16_LOGITS, config.precision)
    return (config.precision,)


def f32_logits(precision: str) -> int:
    """1 where `precision` keeps the logits in float32 (more HBM, the same FLOPs), else 0."""
    return 0 if precision.endswith(BF16_LOGITS) else 1


def loss_chunks(config: mlc.ConfigDict) -> tuple[int, ...]:
    """The loss chunkings that apply: whole, and chunked where the length divides."""
    return tuple(n for n in LOSS_CHUNKS if config.data.seq_len % n == 0)


def rows_per_chip(config: mlc.ConfigDict, data: int, fsdp: int) -> float:
    """Sequences a chip takes at once: the global batch over the batch-sharding axes (`data`
    including its slices) and the accumulated micro-batches."""
    return config.data.batch_size / (config.train.grad_accum * data * fsdp)


def fit_advice(config: mlc.ConfigDict, rows_per_chip: float | None = None) -> str:
    """What would make `config`'s step need less HBM per chip, most effective first: only what
    applies to it and what it does not do already (`rows_per_chip`: sequences a chip takes at
    once; accumulation is advised only where that is more than one)."""
    m = config.model
    attention = m.get("attention", "einsum")
    chunks = max(LOSS_CHUNKS)
    fixes = [(True, "more chips (a larger topology or --num_slices)"),
             (m.get("remat", "none") in KEEPS_MORE_THAN_QKV,
              "model.remat=save_qkv_proj (keeps q/k/v only)"),
             (m.get("remat", "none") != "full", "model.remat=full"),
             (m.get("loss_chunks", 0) in (0, 1) and chunks in loss_chunks(config),
              f"model.loss_chunks={chunks} (the LM head and loss a chunk at a time)"),
             (attention != "splash" and "splash" in attentions(config),
              "model.attention=splash"),
             (rows_per_chip is None or rows_per_chip > 1,
              "train.grad_accum (fewer sequences at once)"),
             (config.precision != "bf16-true", "precision=bf16-true"),
             (config.optim.name in ADAM, "optim.name=adam8bit (8-bit Adam states)"),
             (not config.lora.rank, "LoRA (lora.rank=16) for fine-tuning")]
    return ", ".join(text for applies, text in fixes if applies)
