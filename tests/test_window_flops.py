"""Analytic FLOPs per token (`models/decoder/flops.py`) where layers are not all alike:
GPT-OSS's sliding-window layers count their 128-token window, not the context (and the scores a
masking kernel computes outside the window are padding), and a multi-token-prediction module
counts as one more block plus its projection and head pass. Hand counts, written out here."""

import pytest

from configs.tiny_lm import get_config
from jaxscale.configs import gpt_oss
from jaxscale.models import entry_of

T = 4096


def _gpt_oss_20b() -> dict:
    return gpt_oss.get_config("20b").model.to_dict()


def test_gpt_oss_counts_the_window_on_its_sliding_layers():
    m = _gpt_oss_20b()
    E, H, K, D, V, L = 2880, 64, 8, 64, 201088, 24
    X, k, F = 32, 4, 2880
    assert (m["embed"], m["num_heads"], m["num_kv_heads"], m["head_dim"], m["vocab_size"],
            m["num_layers"], m["sliding_window"]) == (E, H, K, D, V, L, 128)
    per_layer = E * D * (H + 2 * K) + H * D * E + 3 * E * F * k + E * X  # qkv, o, experts, router
    # 12 sliding layers see 128 keys, 12 full layers all 4,096 (no causal saving, as PaLM).
    attention = 3 * 4 * H * D * (12 * 128 + 12 * T)
    want = 6 * (L * per_layer + E * V) + attention
    assert entry_of(m).flops_per_token(m, T) == pytest.approx(want, rel=1e-12)
    full = {**m, "sliding_window": 0, "layer_types": []}
    assert entry_of(m).flops_per_token(full, T) - want == pytest.approx(
        3 * 4 * H * D * 12 * (T - 128), rel=1e-12)
    # Shorter than the window, a sliding layer sees the whole context.
    assert entry_of(m).flops_per_token(m, 64) == entry_of(m).flops_per_token(full, 64)


@pytest.mark.parametrize("kernel,remat,passes", [("einsum", "full", 4), ("einsum", "none", 3),
                                                 ("splash", "full", 0)])
def test_the_scores_a_masking_kernel_computes_outside_the_window_are_padding(kernel, remat,
                                                                               passes):
    """The einsum kernel computes every score and masks the window's outside: forward, two
    backward and the remat's forward again; splash's local mask skips those tiles."""
    m = {**_gpt_oss_20b(), "attention": kernel, "remat": remat}
    H, D = 64, 64
    assert entry_of(m).padding_flops(m, T) == pytest.approx(
        passes * 12 * 4 * H * D * (T - 128), rel=1e-12)


def test_an_mtp_module_counts_as_a_block_its_projection_and_a_head_pass():
    c = get_config("test")
    c.model.moe.update(num_experts=8, experts_per_token=2, mlp=32, shared_experts=1,
                       first_k_dense_replace=1, router="sigmoid_group")
    m = {**c.model.to_dict(), "mtp_depth": 1}
    E, V, H, D = m["embed"], m["vocab_size"], m["num_heads"], m["head_dim"]
    K = m["num_kv_heads"]
    block = E * D * (H + 2 * K) + H * D * E + 3 * E * 32 * (2 + 1) + E * 8
    extra = 6 * (2 * E * E + block + E * V) + 3 * 4 * H * D * 64
    flops = entry_of(m).flops_per_token
    assert flops(m, 64) - flops({**m, "mtp_depth": 0}, 64) == pytest.approx(extra, rel=1e-12)
