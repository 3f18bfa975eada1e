"""The decoder's FLOP counts, its table entries' facts: training FLOPs per token (what MFU is
quoted in), the attention part a fused kernel hides from the HLO count, and the remat recompute.

What the attention contributes is asked of its component (`attention/kinds.attention_of`: its
matmul parameters, those behind each named activation, its QK^T and AV FLOPs), so a new kind of
attention is counted without an edit here. Every decoder family shares these counts, each with
its own config class (`config_cls`, bound by the model table: its defaults, e.g. the attention
kind): the switches (a q/k/v bias, per-head q/k RMSNorm, Gemma's norms and scales) add no
matmul.

Every function takes the `config.model` section and the sequence length, so that metrics and
ahead-of-time accounting ask the model table (`jaxscale.models.MODELS`) and never the model's
fields themselves.

MoE layers (`moe/layer.py`) count their active parameters (the experts_per_token routed
experts, the shared experts and the router), not all experts. Measured on libtpu's partitioned
HLO (tiny dims, 4 experts, v5p:2x2x1): under `remat=full` an MoE layer recomputes its router and
all three routed-expert matmuls (the combine's backward needs the experts' outputs), and the
shared experts' gate/up as the dense MLP (`_experts_recompute` for the other policies); the
capacity path computes every slot of its expert buffers, empty or not
(`padding_flops_per_token`). With MoE on every n-th layer only (`model.moe.every`), each count
is the MoE layers' plus the dense layers' (`_by_layer_kind`). Sliding-window layers (Mistral,
Gemma's and GPT-OSS's local layers) count the keys their window lets a query see; the scores a
masking kernel computes outside it are padding (`_masked_scores`). A multi-token-prediction
module counts as one more block plus its projection and head pass (`_with_mtp`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from jaxscale.models.attention.component import AttentionKind
from jaxscale.models.attention.kinds import attention_of
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.moe.config import MoEConfig, active_mlp, expert_width, sparse_layers
from jaxscale.models.moe.layer import capacity
from jaxscale.models.nn.scan import NAMED_POLICIES

Count = Callable[..., float]  # (model_cfg, seq_len, config_cls=...) -> a count per token


def _by_layer_kind(count: Count) -> Count:
    """`count` of a model with MoE on every n-th layer (`model.moe.every` = n > 1) or after
    dense first layers (`first_k_dense_replace`): that of its MoE layers plus that of its dense layers, the part no layer has (the head)
    once. Every count here is affine in num_layers, so the parts add up."""
    @functools.wraps(count)
    def mixed(m: Mapping[str, Any], seq_len: int, **kw: Any) -> float:
        moe = MoEConfig.from_config(m.get("moe"))
        if not moe.num_experts or (moe.every == 1 and not moe.first_k_dense_replace):
            return count(m, seq_len, **kw)
        layers, dense = m["num_layers"], {**dict(m), "moe": {}}
        sparse = sparse_layers(moe, layers)
        experts = {**dict(m), "num_layers": sparse,
                   "moe": {**dict(m["moe"]), "first_k_dense_replace": 0}}
        return (count(experts, seq_len, **kw)
                + count({**dense, "num_layers": layers - sparse}, seq_len, **kw)
                - count({**dense, "num_layers": 0}, seq_len, **kw))
    return mixed


def _with_mtp(extra: Callable[[Mapping[str, Any], int], float]) -> Callable[[Count], Count]:
    """`count` of a model with a multi-token-prediction module (`model.mtp_depth=1`,
    `mtp.py`): the main model's plus one more layer of the model's MoE kind (its block: every
    count is affine in num_layers, so a one-layer model's less a zero-layer model's) plus
    `extra(m, seq_len)`, what the module has beyond a block (its 2E x E projection and its pass
    through the LM head)."""
    def wrap(count: Count) -> Count:
        @functools.wraps(count)
        def with_module(m: Mapping[str, Any], seq_len: int, **kw: Any) -> float:
            main = {**dict(m), "mtp_depth": 0}
            if not m.get("mtp_depth"):
                return count(main, seq_len, **kw)
            moe = {**dict(m.get("moe") or {}), "first_k_dense_replace": 0, "every": 1}
            block = {**main, "num_layers": 1, "layer_types": (), "moe": moe}
            return (count(main, seq_len, **kw) + count(block, seq_len, **kw)
                    - count({**block, "num_layers": 0}, seq_len, **kw) + extra(m, seq_len))
        return with_module
    return wrap


def _attention(m: Mapping[str, Any], config_cls: type[LlamaConfig]) -> AttentionKind:
    """The attention component of a `config.model` section, with the family's defaults."""
    return attention_of(config_cls.from_config(m))


@_with_mtp(lambda m, t: 6.0 * m["embed"] * (2 * m["embed"] + m["vocab_size"]))
@_by_layer_kind
def flops_per_token(m: Mapping[str, Any], seq_len: int,
                    config_cls: type[LlamaConfig] = LlamaConfig) -> float:
    """Training FLOPs per token of a decoder (forward + backward).

    Convention of PaLM (Chowdhery et al. 2022), appendix B: 6·N + 3·L·A, where N counts the
    parameters that take part in matmuls (the attention's projections, the three SwiGLU
    matrices, an MoE layer's router and active experts, and the output projection onto the
    vocabulary; embedding lookups and norms are excluded), L layers, and A the attention's own
    forward FLOPs per token and layer (QK^T and AV: 4·H·Q·T for H query heads of head_dim Q over
    T positions, so the familiar 12·L·H·Q·T; a sliding-window layer's T is its window when
    shorter: `score_flops`). The factor 6 is 2 (multiply-add) × 3 (forward +
    two backward matmuls); attention counts QK^T and AV without exploiting the causal mask, as
    PaLM and MaxText do, so numbers are comparable. An MoE layer counts its active parameters
    (`moe.active_mlp`: the routed and shared experts a token passes through, and the router),
    not all experts."""
    attn = _attention(m, config_cls)
    mlp, router = active_mlp(m)
    layer = attn.matmul_params() + 3 * m["embed"] * mlp + router
    matmul = m["num_layers"] * layer + m["embed"] * m["vocab_size"]
    return 6.0 * matmul + 3.0 * m["num_layers"] * attn.score_flops(seq_len)


def _remat(m: Mapping[str, Any]) -> str:
    return m.get("remat", "none")


@_with_mtp(lambda m, t: 2.0 * m["embed"] * m["vocab_size"] * (m.get("loss_chunks", 1) > 1))
@_by_layer_kind
def recompute_flops_per_token(m: Mapping[str, Any], seq_len: int,
                              config_cls: type[LlamaConfig] = LlamaConfig) -> float:
    """Matmul FLOPs per token that the backward pass recomputes under `model.remat` (and the
    head's, under `model.loss_chunks`).

    Measured on libtpu's partitioned HLO (1B dims, v5p:2x2x2, fsdp=8), `remat=full`
    (`nothing_saveable`) recomputes every matmul of a layer's forward except the last one, the
    MLP's down projection, whose output is the layer's output and is not needed to
    differentiate the layer (XLA drops it as dead code): the attention's projections, gate/up,
    and both attention einsums. `dots` saves every matmul output (no matmul recomputed);
    `dots_no_batch` saves those without batch dimensions, i.e. all but the two attention
    einsums (QK^T and AV), which are recomputed. `model.loss_chunks > 1` recomputes each
    chunk's logits (the head's forward matmul, 2·E·V per token) in the backward pass.
    """
    attn = _attention(m, config_cls)
    attention = attn.score_flops(seq_len)  # QK^T and AV, forward, a layer
    experts = _experts_recompute(m)
    if _remat(m) == "full":
        dense = _mlp_widths(m)[0]  # a dense MLP's w_down is not recomputed (experts' are)
        per_layer = 2.0 * (attn.matmul_params() + 2 * m["embed"] * dense + active_mlp(m)[1]) \
            + attention + experts
    elif _remat(m) == "dots_no_batch":  # the router's dot has no batch dimension: kept
        per_layer = attention + experts
    elif (named := _named_recompute(m, attn)) is not None:
        per_layer = named + attention + experts + 2.0 * active_mlp(m)[1]
    else:  # 'none', 'dots': every matmul output is kept
        per_layer = 0.0
    head = 2.0 * m["embed"] * m["vocab_size"] if m.get("loss_chunks", 1) > 1 else 0.0
    return m["num_layers"] * per_layer + head


def _experts_recompute(m: Mapping[str, Any]) -> float:
    """Forward FLOPs per token and layer of the routed experts' three matmuls, which every
    remat policy but `none` and `dots` recomputes (measured, tiny MoE on v5p:2x2x1): their
    einsums batch over the experts and grouped matmuls are no dots, so `dots_no_batch` keeps
    neither, no named policy names them, and the combine's backward needs the down
    projection's output. Padding slots are in `padding_flops_per_token`."""
    return 0.0 if _remat(m) in ("none", "dots") else 2.0 * 3 * m["embed"] * _mlp_widths(m)[1]


def _mlp_widths(m: Mapping[str, Any]) -> tuple[int, int]:
    """(the dense SwiGLU width a token passes through: `mlp`, or an MoE layer's shared experts;
    the routed experts' summed width, experts_per_token x the expert width; 0 without MoE)."""
    moe = MoEConfig.from_config(m.get("moe"))
    if not moe.num_experts:
        return m["mlp"], 0
    width = expert_width(moe, m["mlp"])
    return width * moe.shared_experts, width * moe.experts_per_token


@_with_mtp(lambda m, t: 0.0)
@_by_layer_kind
def padding_flops_per_token(m: Mapping[str, Any], seq_len: int) -> float:
    """Matmul FLOPs per token an MoE capacity path (`model.moe.capacity_factor > 0`) spends on
    the empty slots of its expert buffers: each row (sequence) fills X buffers of C slots,
    C = moe.capacity(capacity_factor, T x k, X), and the expert matmuls run over all X x C of
    them, so (X·C / (T·k) - 1) times the routed experts' training FLOPs (6 per parameter per
    token, and their forward again where `remat=full` recomputes it). 0 when dropless or
    dense. Plus, with a sliding window and a kernel that masks rather than skips (einsum, the
    fused kernel), the scores outside the window (`_masked_scores`)."""
    moe = MoEConfig.from_config(m.get("moe"))
    if not moe.num_experts or moe.capacity_factor <= 0:
        return _masked_scores(m, seq_len)
    k, x = moe.experts_per_token, moe.num_experts
    ratio = x * capacity(moe.capacity_factor, seq_len * k, x) / (seq_len * k)
    per_matmul = 2.0 * m["embed"] * _mlp_widths(m)[1]  # forward, the routed experts, a token
    passes = 3 + (_remat(m) not in ("none", "dots"))  # forward + two backward (+ recompute)
    return m["num_layers"] * (ratio - 1.0) * 3 * per_matmul * passes + _masked_scores(m, seq_len)


def _masked_scores(m: Mapping[str, Any], seq_len: int) -> float:
    """The attention FLOPs per token the model count leaves out because a sliding window
    hides them, but a kernel that masks scores computes anyway (all but splash, whose
    local mask skips the hidden tiles): forward, two backward, and the recompute."""
    if m.get("attention", "einsum") == "splash":
        return 0.0
    passes = 3.0 + _recomputes_attention(m)
    return passes * m["num_layers"] * attention_of(LlamaConfig.from_config(m)) \
        .masked_score_flops(seq_len)


def _named_recompute(m: Mapping[str, Any], attn: AttentionKind) -> float | None:
    """Forward matmul FLOPs per token and layer that a policy named by what it keeps
    (`models.nn.scan.NAMED_POLICIES`) recomputes: the weight matmuls it keeps neither in HBM nor
    on the host (the attention's unnamed ones always; never w_down, as under `full`); None for a
    policy that is not named so."""
    named = NAMED_POLICIES.get(_remat(m))
    if named is None:
        return None
    kept = set(named.saved) | set(named.offloaded)
    attention = attn.matmul_params() - sum(
        v for k, v in attn.named_matmuls().items() if k in kept)
    gate_up = 0 if "mlp_gate_up" in kept else 2 * m["embed"] * _mlp_widths(m)[0]
    return 2.0 * (attention + gate_up)


def _recomputes_attention(m: Mapping[str, Any]) -> bool:
    """Whether the backward pass runs attention's forward (QK^T and AV) again: under `full`,
    `dots_no_batch` and every policy named by what it keeps (none keeps the scores)."""
    return _remat(m) in ("full", "dots_no_batch") or _remat(m) in NAMED_POLICIES


@_with_mtp(lambda m, t: 0.0)
def attention_flops_per_token(m: Mapping[str, Any], seq_len: int,
                              config_cls: type[LlamaConfig] = LlamaConfig) -> float:
    """Attention matmul FLOPs per token of a step (what a fused attention kernel computes out of
    the HLO's sight): the model count's three times the attention's forward QK^T and AV (forward
    and backward), plus the forward once more where remat recomputes it."""
    passes = 3.0 + _recomputes_attention(m)
    return passes * m["num_layers"] * _attention(m, config_cls).score_flops(seq_len)
