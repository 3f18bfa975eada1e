"""Hugging Face Mixtral and Qwen3-MoE checkpoints <-> the Llama decoder with `model.moe`.

    source = open_mixtral(hf_dir)      # model table openers (model_type "mixtral", "qwen3_moe")
    source = open_qwen3_moe(hf_dir)
    save_moe(model, out_dir, dtype=None, max_shard_size=None)

Both are the decoder (`models/llama.py`) with every layer's SwiGLU replaced by `models/moe.py`'s
block: a softmax router over `num_experts`, the top `experts_per_token`, their weights
renormalised to sum to one (Mixtral always; Qwen3-MoE by its `norm_topk_prob`), each expert a
SwiGLU, dropless (`capacity_factor=0`), as transformers computes them. Mixtral is Mistral's
attention (`sliding_window`, null: full) and `block_sparse_moe.gate` + `experts.{j}.w1/w3/w2`
(gate/up/down, width `intermediate_size`); Qwen3-MoE is Qwen3's attention (q/k norms, explicit
`head_dim`) and `mlp.gate` + `mlp.experts.{j}.gate_proj/up_proj/down_proj` (width
`moe_intermediate_size`). The router's (X, E) weight is transposed into `router` (E, X) and the
experts' tensors are stacked into `w_gate` / `w_up` (X, E, F) and `w_down` (X, F, E): transposes
and stacking only, so round trips stay bit for bit.

The router's load-balancing loss trains only where the HF config asks for it
(`output_router_logits`): transformers' loss is `experts_per_token` times jaxscale's `aux`
statistic, so `model.moe.router_aux_loss_coef` = `router_aux_loss_coef` x experts_per_token, and
0 (reported, not trained on) otherwise. What the decoder cannot reproduce is refused in one
paragraph naming the field: dense layers among the MoE ones (`decoder_sparse_step` != 1,
`mlp_only_layers`), router jitter, and whatever the Mistral / Qwen3 converters refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxscale.errors import paragraph
from jaxscale.interop.hf import ConversionError, Leaf, decoder_opener, decoder_saver, llama_leaves
from jaxscale.interop.hf_config import require_keys
from jaxscale.interop.hf_mistral import mistral_config_from_hf, mistral_config_to_hf
from jaxscale.interop.hf_qwen import qwen_config_from_hf, qwen_config_to_hf, qwen_leaves
from jaxscale.models.moe import MoEConfig, expert_width

# By model.name: the HF model_type and class, the block's and its experts' tensor names
# (gate, up, down), and the HF field holding the expert width.
FAMILIES = {
    "mixtral": dict(model_type="mixtral", arch="MixtralForCausalLM", block="block_sparse_moe",
                    experts=("w1", "w3", "w2"), width="intermediate_size"),
    "qwen3_moe": dict(model_type="qwen3_moe", arch="Qwen3MoeForCausalLM", block="mlp",
                      experts=("gate_proj", "up_proj", "down_proj"),
                      width="moe_intermediate_size"),
}
_MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok",
               "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
               "norm_topk_prob", "router_aux_loss_coef", "output_router_logits",
               "router_jitter_noise")


def moe_config_from_hf(hf: Mapping[str, Any], where: str = "config.json",
                       name: str = "mixtral") -> dict:
    """HF `MixtralConfig` / `Qwen3MoeConfig` fields -> `config.model` of `model.name=name`."""
    family = FAMILIES[name]
    if hf.get("model_type") != family["model_type"]:
        raise ConversionError(paragraph(
            f"{where}: model_type={hf.get('model_type')!r} is read by the {name} converter;",
            f"only model_type={family['model_type']!r} is (the model table dispatches:",
            "interop.hf.load)."))
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    require_keys({**hf, "num_local_experts": experts},
                 ("num_local_experts", "num_experts_per_tok", family["width"]), where, name)
    _refuse_dense_layers(hf, where)
    if hf.get("router_jitter_noise"):
        raise ConversionError(paragraph(
            f"{where}: router_jitter_noise={hf['router_jitter_noise']!r} multiplies the router's",
            "input by random noise in training, which jaxscale's router does not. Convert a",
            "checkpoint with router_jitter_noise 0 (inference is unaffected by it)."))
    dense = {k: v for k, v in hf.items() if k not in _MOE_FIELDS}
    if name == "mixtral":
        fields = mistral_config_from_hf({**dense, "model_type": "mistral"}, where)
    else:
        fields = qwen_config_from_hf({**dense, "model_type": "qwen3"}, "qwen3", where)
    k = int(hf["num_experts_per_tok"])
    coef = float(hf.get("router_aux_loss_coef") or 0.0) * k if hf.get(
        "output_router_logits") else 0.0
    width = int(hf[family["width"]])
    moe = dict(num_experts=int(experts), experts_per_token=k,
               norm_topk_prob=name == "mixtral" or bool(hf.get("norm_topk_prob", False)),
               mlp=0 if width == fields["mlp"] else width, capacity_factor=0.0,
               router_aux_loss_coef=coef, router_z_loss_coef=0.0)
    return {**fields, "name": name, "moe": moe}


def _refuse_dense_layers(hf: Mapping[str, Any], where: str) -> None:
    """A dense MLP on some layers (Qwen3-MoE's `decoder_sparse_step` / `mlp_only_layers`) is a
    non-uniform layer stack, which the scanned decoder does not build yet."""
    step, dense = hf.get("decoder_sparse_step") or 1, list(hf.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise ConversionError(paragraph(
            f"{where}: decoder_sparse_step={step!r} and mlp_only_layers={dense!r} give some",
            "layers a dense MLP instead of the experts; jaxscale's decoder runs one scanned",
            "stack of identical layers, so every layer must be an MoE layer. Convert a",
            "checkpoint with decoder_sparse_step 1 and mlp_only_layers [] (per-layer patterns",
            "of dense and MoE layers are not supported yet)."))


def moe_config_to_hf(model_cfg: Mapping[str, Any]) -> dict:
    """`config.model` of an MoE family -> a `config.json` its `*ForCausalLM` loads."""
    m = dict(model_cfg)
    name, family = m["name"], FAMILIES[m["name"]]
    moe = MoEConfig.from_config(m.get("moe"))
    for key, value, wrong, why in (
            ("num_experts", moe.num_experts, not moe.num_experts, "it has experts"),
            ("shared_experts", moe.shared_experts, moe.shared_experts > 0,
             f"{family['arch']} has no shared experts"),
            ("norm_topk_prob", moe.norm_topk_prob, name == "mixtral" and not moe.norm_topk_prob,
             "Mixtral always renormalises the top-k weights")):
        if wrong:
            raise ConversionError(paragraph(
                f"model.moe.{key}={value!r} does not fit a Hugging Face {name}: {why}, so the",
                "export would drop tensors or compute another model. Export it as the family it",
                "is."))
    dense = {**m, "moe": {}}
    if name == "mixtral":
        hf = mistral_config_to_hf({**dense, "name": "mistral"})
    else:
        hf = qwen_config_to_hf({**dense, "name": "qwen3"})
    k, width = moe.experts_per_token, expert_width(moe, m["mlp"])
    return {**hf, "architectures": [family["arch"]], "model_type": family["model_type"],
            "num_local_experts": moe.num_experts, "num_experts_per_tok": k,
            family["width"]: width,
            **({"decoder_sparse_step": 1, "mlp_only_layers": [],
                "norm_topk_prob": moe.norm_topk_prob} if name == "qwen3_moe" else
               {"router_jitter_noise": 0.0}),
            "output_router_logits": moe.router_aux_loss_coef > 0,
            "router_aux_loss_coef": moe.router_aux_loss_coef / k}


def moe_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """{jaxscale path: Leaf} of an MoE family: its attention family's leaves with the dense
    MLP's replaced by the router and the stacked experts."""
    name, family = model_cfg["name"], FAMILIES[model_cfg["name"]]
    leaves = (llama_leaves(model_cfg) if name == "mixtral"
              else qwen_leaves({**model_cfg, "name": "qwen3"}))
    del leaves["layers/mlp/w_gate_up"], leaves["layers/mlp/w_down"]
    p = f"model.layers.{{i}}.{family['block']}."
    n = MoEConfig.from_config(model_cfg.get("moe")).num_experts
    leaves["layers/mlp/router"] = Leaf(p + "gate.weight", _t, _t)  # (X, E) <-> (E, X)
    for path, hf_name in zip(("w_gate", "w_up", "w_down"), family["experts"]):
        leaves[f"layers/mlp/{path}"] = Leaf(  # X of (F, E) <-> (X, E, F); down (E, F) <-> (X, F, E)
            tuple(p + f"experts.{j}.{hf_name}.weight" for j in range(n)),
            lambda *w: np.stack([x.T for x in w]), lambda w: tuple(x.T for x in w))
    return leaves


def _t(w: np.ndarray) -> np.ndarray:
    return w.T


open_mixtral = decoder_opener("mixtral", moe_config_from_hf, moe_leaves)
open_qwen3_moe = decoder_opener("qwen3_moe", moe_config_from_hf, moe_leaves)
save_moe = decoder_saver("save_moe", moe_config_to_hf, moe_leaves, tuple(FAMILIES))
