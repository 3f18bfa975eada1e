"""DeepSeek presets (latent attention, DeepSeek's mixture of experts): `--config=deepseek:SIZE`.

    --config=deepseek:tiny      a tiny DeepSeek-V3-shaped model on CPU (docs/deepseek.md)
    --config=deepseek:v2-lite   DeepSeek-V2-Lite's shape (15.7B, 2.4B active a token)
    --config=deepseek:v3        DeepSeek-V3's shape (671B, 37B active a token)

SIZE (the decoder of `configs/llama.py` with `model.attention_kind=latent` and `model.moe`):

    tiny     embed 64, 2 layers (the first dense), 4 heads; latent widths q 32, kv 16, rope 8,
             nope 16, v 16; 8 experts of width 32 in 4 groups (2 kept), top-2, one shared
             expert, sigmoid routing with bias balancing at 1e-3; 32-true, 10 steps
    v2-lite  DeepSeek-V2-Lite: embed 2048, 27 layers (the first dense, width 10944), 16 heads,
             the query projected directly (q_lora_rank 0), kv_lora_rank 512, rope 64, nope
             128, v 128; 64 experts of width 1408, top-6 by softmax (V2's routing,
             `softmax_topk`, no renormalisation), 2 shared experts; vocab 102400     15,706.5M
    v3       DeepSeek-V3: embed 7168, 61 layers (the first 3 dense, width 18432), 128 heads,
             q_lora_rank 1536, kv_lora_rank 512, rope 64, nope 128, v 128; 256 experts of
             width 2048 in 8 groups (4 kept), top-8 by sigmoid, routed_scaling_factor 2.5,
             1 shared expert, bias balancing at 1e-3; vocab 129280                 671,026.4M

Both full sizes carry the published checkpoints' YaRN extension from 4,096 to 163,840 tokens
(factor 40; V3's mscale and mscale_all_dim 1, V2-Lite's 0.707), so a converted checkpoint
computes its own frequencies; the recipes train at 4,096. DeepSeek-V3's multi-token prediction
module is off in every size: `--config.model.mtp_depth=1` adds it (docs/deepseek.md).
There is no hardware target yet (the planner, `jaxscale plan --config=deepseek:v3`, is the way
to size one); the recipes are the papers' (V3: 15,360 sequences of 4,096 tokens, lr 2.2e-4;
V2-Lite: 4,608, lr 4.2e-4) over the byte-level stdlib corpus of `configs/llama.py`.
"""

from __future__ import annotations

import ml_collections as mlc

from jaxscale.configs import sibling
from jaxscale.configs._preset_parts import Size
from jaxscale.errors import ConfigError, paragraph

llama = sibling("llama")

_TINY = dict(vocab_size=256, embed=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
             mlp=128, max_len=256, attention_kind="latent",
             mla=dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                      v_head_dim=16),
             moe=dict(num_experts=8, router="sigmoid_group", experts_per_token=2, mlp=32,
                      shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                      bias_update_rate=1e-3, first_k_dense_replace=1, router_aux_loss_coef=0.0,
                      capacity_factor=0.0))
# What both full sizes share: YaRN from 4,096 to 163,840 positions, untied embeddings.
_FULL = dict(max_len=163840, rope_theta=10000.0, rope_scaling="yarn", rope_factor=40.0,
             rope_original_max_len=4096, rope_beta_fast=32.0, rope_beta_slow=1.0,
             norm_eps=1e-6, tie_embeddings=False, attention_kind="latent")
_V2_LITE = dict(_FULL, rope_mscale=0.707, rope_mscale_all_dim=0.707, vocab_size=102400,
                embed=2048, num_layers=27, num_heads=16, num_kv_heads=16, head_dim=64, mlp=10944,
                mla=dict(q_lora_rank=0, kv_lora_rank=512, qk_rope_head_dim=64,
                         qk_nope_head_dim=128, v_head_dim=128),
                moe=dict(num_experts=64, router="softmax_topk", experts_per_token=6,
                         norm_topk_prob=False, mlp=1408, shared_experts=2,
                         first_k_dense_replace=1, router_aux_loss_coef=0.001,
                         capacity_factor=0.0))
_V3 = dict(_FULL, rope_mscale=1.0, rope_mscale_all_dim=1.0, vocab_size=129280, embed=7168,
           num_layers=61, num_heads=128, num_kv_heads=128, head_dim=64, mlp=18432,
           mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                    qk_nope_head_dim=128, v_head_dim=128),
           moe=dict(num_experts=256, router="sigmoid_group", experts_per_token=8, mlp=2048,
                    shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                    bias_update_rate=1e-3, first_k_dense_replace=3, router_aux_loss_coef=0.0,
                    capacity_factor=0.0))
SIZES: dict[str, Size] = {
    "tiny": Size(_TINY, "fsdp", "none", seq_len=64, batch=16, lr=3e-3, warmup=2, steps=10,
                 precision="32-true", max_bytes=400_000),
    "v2-lite": Size(_V2_LITE, "fsdp", "full", seq_len=4096, batch=4608, lr=4.2e-4,
                    warmup=2000, steps=300_000),
    "v3": Size(_V3, "fsdp", "full", seq_len=4096, batch=15360, lr=2.2e-4, warmup=2000,
               steps=235_000),
}
VARIANTS: tuple[str, ...] = tuple(SIZES)


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    size = (arg or "tiny").strip()
    if size not in SIZES:
        raise ConfigError(paragraph(
            f"configs/deepseek.py: cannot read the argument {arg!r}. Use SIZE, one of",
            f"{', '.join(SIZES)}."))
    return llama.build(size, None, sizes=SIZES)  # tiny: the small-run mode, as llama's tiny
