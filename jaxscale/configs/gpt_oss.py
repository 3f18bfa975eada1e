"""GPT-OSS presets: `--config=configs/gpt_oss.py:SIZE` (`model.name=gpt_oss`, `docs/moe.md`).

    --config=configs/gpt_oss.py:tiny    a tiny GPT-OSS-shaped MoE on CPU
    --config=configs/gpt_oss.py:20b     gpt-oss-20b's shape
    --config=configs/gpt_oss.py:120b    gpt-oss-120b's shape

SIZE (the decoder with GPT-OSS's switches, `models/decoder/gpt_oss.py`: attention sinks, q/k/v/o
biases, sliding-window and full layers alternating, YaRN; every layer a mixture of experts with
a biased top-k-softmax router, biased experts and the clamped SwiGLU):

    tiny   embed 64, 2 layers (window 16, then full), 4 heads (2 kv) of 16, 4 experts of width
           64, top-2, vocab 256, YaRN x4 over 64; dropless, 32-true, 10 steps        0.16M
    20b    openai/gpt-oss-20b: embed 2880, 24 layers, 64 heads (8 kv) of 64, 32 experts of
           width 2880, top-4, window 128, vocab 201088, rope 150000 with YaRN x32 over 4096
           (truncate off), untied                                             20,914.8M
    120b   openai/gpt-oss-120b: the same with 36 layers and 128 experts       116,829.2M

The published weights import with `jaxscale convert` (MXFP4 experts dequantised,
`interop/hf_mxfp4.py`); fine-tuning starts from them (`init_from`). No hardware TARGET is sized
here yet: the 20b / 120b recipe (256 sequences of 4,096 tokens, lr 3e-4) shards the weights over
`fsdp` and the experts over `--config.mesh.expert`, dropless (a ragged all-to-all on TPU).
"""

from __future__ import annotations

import ml_collections as mlc

from jaxscale.configs import sibling
from jaxscale.configs._preset_parts import Size
from jaxscale.errors import ConfigError, paragraph

llama = sibling("llama")


def _gpt_oss(layers: int, experts: int) -> dict:
    """gpt-oss-20b / 120b's `config.model` (their config.json, field for field)."""
    return dict(name="gpt_oss", vocab_size=201088, embed=2880, num_layers=layers, num_heads=64,
                num_kv_heads=8, head_dim=64, mlp=2880, max_len=131072, rope_theta=150000.0,
                rope_scaling="yarn", rope_factor=32.0, rope_original_max_len=4096,
                rope_beta_fast=32.0, rope_beta_slow=1.0, rope_truncate=False, norm_eps=1e-5,
                tie_embeddings=False, sliding_window=128,
                layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                moe=_moe(experts, 4))


def _moe(experts: int, k: int) -> dict:
    return dict(num_experts=experts, experts_per_token=k, router="topk_softmax",
                router_bias=True, expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702,
                capacity_factor=0.0, router_aux_loss_coef=0.0)


SIZES: dict[str, Size] = {
    "tiny": Size(dict(name="gpt_oss", vocab_size=256, embed=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, mlp=64, max_len=256, rope_scaling="yarn",
                      rope_factor=4.0, rope_original_max_len=64, rope_truncate=False,
                      sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                      moe=_moe(4, 2)),
                 "fsdp", "none", seq_len=64, batch=16, lr=3e-3, warmup=2, steps=10,
                 precision="32-true", max_bytes=400_000),
    "20b": Size(_gpt_oss(24, 32), "fsdp", "full", seq_len=4096, batch=256, lr=3e-4,
                warmup=2000, steps=100_000),
    "120b": Size(_gpt_oss(36, 128), "fsdp", "full", seq_len=4096, batch=256, lr=3e-4,
                 warmup=2000, steps=100_000),
}
VARIANTS: tuple[str, ...] = tuple(SIZES)


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    size = (arg or "tiny").strip()
    if size not in SIZES:
        raise ConfigError(paragraph(
            f"configs/gpt_oss.py: cannot read the argument {arg!r}. Use one SIZE of",
            f"{', '.join(SIZES)} (hardware targets are not sized for GPT-OSS yet: set",
            "--config.mesh.* yourself)."))
    return llama.build(size, None, sizes=SIZES)
