"""Mixture-of-experts presets, Mixtral-shaped: `--config=configs/mixtral.py:SIZE[,TARGET]`.

    --config=configs/mixtral.py:tiny           a tiny MoE on CPU (`docs/moe.md`)
    --config=configs/mixtral.py:8x7b,v5p-128   Mixtral-8x7B's shape on 64 v5p chips

SIZE (the Llama decoder of `configs/llama.py` with an MoE block, `model.moe`, on every layer):

    tiny   configs/llama.py:tiny's dims (embed 64, 2 layers, vocab 256) with 4 experts of width
           128, top-2, capacity factor 2.0 (few drops, so it runs on any expert axis); 32-true,
           10 steps                                                                   0.25M
    8x7b   Mixtral-8x7B-v0.1: embed 4096, 32 layers, 32 heads (8 kv) of 128, 8 experts of width
           14336, top-2, vocab 32000, rope 1e6, untied; capacity factor 1.25   46,702.8M
           (12,879.9M active a token: 2 of the 8 experts)

TARGET (one slice): `v5p-128` (64 chips, libtpu topology v5p:4x4x4; the suffix counts
TensorCores): experts over `expert` (8 chips, one expert each) x the weights over `fsdp` (8), the
batch over both, the capacity path, whose token dispatch is an all-to-all over `expert`
(`--config.model.moe.capacity_factor=0` makes it dropless: a ragged all-to-all and megablox on
TPU, more HBM for the worst-case receive buffer; `docs/moe.md`). The micro-batch is the TPU
compiler's (`COMPILED`, `launch.compile` with libtpu, nothing ran): the largest power of two that
leaves 10% of HBM free; bench/RESULTS.md has its memory, FLOPs and step-time estimate. Attention
is the Pallas splash kernel, precision `bf16-mixed`, remat `full`.

8x7b's recipe is 256 sequences of 4,096 tokens a step (1M tokens), lr 3e-4 (cosine, 2,000 warm-up
steps). The data is the byte-level stdlib corpus of `configs/llama.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_collections as mlc

from jaxscale.configs import sibling
from jaxscale.configs._preset_parts import Compiled, Size, Target
from jaxscale.errors import ConfigError, paragraph

llama = sibling("llama")

_TINY_MOE = dict(num_experts=4, experts_per_token=2, capacity_factor=2.0)
_MIXTRAL_MOE = dict(num_experts=8, experts_per_token=2, capacity_factor=1.25)
SIZES: dict[str, Size] = {
    "tiny": Size(dict(llama.SIZES["tiny"].model, moe=_TINY_MOE), "fsdp", "none",
                       seq_len=64, batch=16, lr=3e-3, warmup=2, steps=10, precision="32-true",
                       max_bytes=400_000),
    "8x7b": Size(dict(vocab_size=32000, embed=4096, num_layers=32, num_heads=32,
                            num_kv_heads=8, head_dim=128, mlp=14336, max_len=32768,
                            rope_theta=1e6, norm_eps=1e-5, tie_embeddings=False,
                            moe=_MIXTRAL_MOE),
                       "fsdp", "full", seq_len=4096, batch=256, lr=3e-4, warmup=2000,
                       steps=100_000),
}


@dataclass(frozen=True)
class MoETarget:
    """A TPU slice for an MoE size: the chips (`configs/llama.py`'s `Target`) and how many of
    them the experts split over (`mesh.expert`; the rest is `mesh.fsdp`)."""

    target: Target
    expert: int


TARGETS: dict[str, MoETarget] = {
    "v5p-128": MoETarget(Target(64, 1, "v5p", topology="v5p:4x4x4"), expert=8),
}
# The TPU compiler's micro-batch (sequences per chip at once) and memory per chip
# (`Compiled`; libtpu 0.0.52, `launch.compile`, nothing ran; bench/RESULTS.md).
COMPILED: dict[tuple[str, str], Compiled] = {
    ("8x7b", "v5p-128"): Compiled(4, 26.91, (4743, 5065)),
}
VARIANTS: tuple[str, ...] = tuple(SIZES) + tuple(f"{s},{t}" for s, t in COMPILED)


def parse_arg(arg: str | None) -> tuple[str, str | None]:
    """'8x7b,v5p-128' -> ('8x7b', 'v5p-128'); None / '' -> ('tiny', None)."""
    parts = [p.strip() for p in (arg or "tiny").split(",")]
    size, target = parts[0], (parts[1] if len(parts) > 1 else None)
    if size not in SIZES or len(parts) > 2 or (target is not None and
                                               (size, target) not in COMPILED):
        raise ConfigError(paragraph(
            f"configs/mixtral.py: cannot read the argument {arg!r}. Use SIZE or SIZE,TARGET",
            f"with SIZE in {', '.join(SIZES)}; the targets sized for each SIZE:",
            f"{', '.join(f'{s},{t}' for s, t in COMPILED)}.",
        ))
    return size, target


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    size, target = parse_arg(arg)
    c = llama.build(size, None, sizes=SIZES)  # tiny: the small-run mode, as llama's tiny
    if target is not None:
        _apply_target(c, size, target)
    return c


def _apply_target(c: mlc.ConfigDict, size: str, target: str) -> None:
    """The mesh (expert x fsdp), micro-batch and accumulation, precision and attention."""
    t, micro = TARGETS[target], COMPILED[(size, target)].micro_batch
    chips = t.target.total
    c.mesh.update(data=1, fsdp=chips // t.expert, expert=t.expert)
    c.train.grad_accum = c.data.batch_size // (micro * chips)
    c.train.eval_every = 0 if c.train.grad_accum > 1 else c.train.eval_every
    c.precision = "bf16-mixed"
    c.model.attention = "splash"
    c.model.loss_chunks = 1  # as `COMPILED` was sized (not the automatic default), as llama's
