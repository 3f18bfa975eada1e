"""Hugging Face DeepSeek-V2 checkpoints (`DeepseekV2ForCausalLM`: DeepSeek-V2, V2-Lite, the
`deepseek:v2-lite` preset's model) <-> the decoder with latent attention and softmax routing.

    source = open_deepseek_v2(hf_dir)   # model table opener (model_type "deepseek_v2")
    save_deepseek_v2(model, out_dir, dtype=None, max_shard_size=None)

V2 is V3's layout (`hf_deepseek.py`: the latent attention with its interleaved rotary pairs
de-interleaved, YaRN, shared experts, dense first layers, the same tensor names) with another
router and no selection bias: a softmax over the experts, then `topk_method` `greedy` (the top k:
`model.moe.router=softmax_topk`, V2-Lite) or `group_limited_greedy` (the top k within the
`topk_group` groups of `n_group` whose best expert scores highest: `softmax_group`, V2); the
weights are the top-k probabilities, not renormalised, times `routed_scaling_factor` (V2: 16,
V2-Lite: 1). There is no `e_score_correction_bias` and no multi-token prediction.

Refused in one paragraph naming the field: another `topk_method` or `scoring_func`, a
`moe_layer_freq` other than 1 (transformers puts experts on every layer past
`first_k_dense_replace`), and `norm_topk_prob` true (DeepSeek's own code would renormalise the
weights, transformers' does not: the two disagree, so the checkpoint's model is ambiguous).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxscale.errors import paragraph
from jaxscale.interop.hf import ConversionError, Source, decoder_opener, decoder_saver
from jaxscale.interop.hf_deepseek import (
    deepseek_config_from_hf,
    deepseek_config_to_hf,
    deepseek_leaves,
    with_fp8,
)
from jaxscale.models.moe.config import MoEConfig

# topk_method -> the router computing it (`models/moe/routers.py`).
TOPK_METHODS = {"greedy": "softmax_topk", "group_limited_greedy": "softmax_group"}


def deepseek_v2_config_from_hf(hf: Mapping[str, Any], where: str = "config.json",
                               name: str = "deepseek_v2") -> dict:
    """HF `DeepseekV2Config` fields -> `config.model` of `model.name=deepseek_v2`."""
    method = hf.get("topk_method") or "greedy"
    for key, value, ok, why in (
            ("topk_method", method, method in TOPK_METHODS,
             f"the routings jaxscale has are {', '.join(TOPK_METHODS)}"),
            ("scoring_func", hf.get("scoring_func", "softmax"),
             hf.get("scoring_func", "softmax") == "softmax", "DeepSeek-V2 scores by softmax"),
            ("moe_layer_freq", hf.get("moe_layer_freq", 1), hf.get("moe_layer_freq", 1) == 1,
             "experts sit on every layer past first_k_dense_replace"),
            ("norm_topk_prob", hf.get("norm_topk_prob"), not hf.get("norm_topk_prob"),
             "DeepSeek's code renormalises the top-k weights then, transformers' does not, so "
             "the model is ambiguous")):
        if not ok:
            raise ConversionError(paragraph(
                f"{where}: {key}={value!r} cannot be converted: {why}. Convert a DeepSeek-V2",
                "checkpoint with the published values (topk_method greedy or",
                "group_limited_greedy, scoring_func softmax, moe_layer_freq 1, norm_topk_prob",
                "false)."))
    fields = deepseek_config_from_hf(hf, where, name, model_type="deepseek_v2")
    grouped = method == "group_limited_greedy"
    moe = {**fields["moe"], "router": TOPK_METHODS[method], "norm_topk_prob": False,
           "n_group": int(hf.get("n_group") or 1) if grouped else 1,
           "topk_group": int(hf.get("topk_group") or 1) if grouped else 1}
    return {**fields, "moe": moe}


def deepseek_v2_config_to_hf(model_cfg: Mapping[str, Any]) -> dict:
    """`config.model` of a deepseek_v2 model -> a `config.json` `DeepseekV2ForCausalLM` loads."""
    moe = MoEConfig.from_config(model_cfg.get("moe"))
    methods = {router: method for method, router in TOPK_METHODS.items()}
    if moe.router not in methods or moe.norm_topk_prob:
        raise ConversionError(paragraph(
            f"model.moe.router={moe.router!r} with norm_topk_prob={moe.norm_topk_prob} does not",
            "fit a Hugging Face DeepSeek-V2, which routes by softmax_topk (topk_method greedy)",
            "or softmax_group (group_limited_greedy) without renormalising. Export it as the",
            "family it is."))
    as_v3 = {**dict(model_cfg), "moe": {**dict(model_cfg["moe"]), "router": "sigmoid_group"}}
    hf = deepseek_config_to_hf(as_v3)  # the widths, rotary and checks V3 shares
    for v3_only in ("rope_interleave", "num_nextn_predict_layers"):
        hf.pop(v3_only)
    return {**hf, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
            "topk_method": methods[moe.router], "norm_topk_prob": False,
            "n_group": moe.n_group, "topk_group": moe.topk_group}


def deepseek_v2_leaves(model_cfg: Mapping[str, Any]) -> dict:
    """V3's tensor names without the selection bias (the router keeps none) or an MTP layer."""
    return deepseek_leaves({**dict(model_cfg), "mtp_depth": 0})


_open = decoder_opener("deepseek_v2", deepseek_v2_config_from_hf, deepseek_v2_leaves)


def open_deepseek_v2(hf_dir: str) -> Source:
    """The config and lazy reader of a HF deepseek_v2 directory (validated); FP8
    block-quantised weights, as V3's, read dequantised (`hf_fp8.py`)."""
    return with_fp8(_open(hf_dir), hf_dir)


save_deepseek_v2 = decoder_saver("save_deepseek_v2", deepseek_v2_config_to_hf,
                                 deepseek_v2_leaves, ("deepseek_v2",))
