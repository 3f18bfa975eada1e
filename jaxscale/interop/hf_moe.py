"""Hugging Face Mixtral and Qwen3-MoE checkpoints <-> the Llama decoder with `model.moe`.

    source = open_mixtral(hf_dir)      # model table openers (model_type "mixtral", "qwen3_moe")
    source = open_qwen3_moe(hf_dir)
    save_moe(model, out_dir, dtype=None, max_shard_size=None)

Both are the decoder (`models/decoder/`) with every layer's SwiGLU replaced by
`models/moe/layer.py`'s block: a softmax router over `num_experts`, the top `experts_per_token`,
their weights renormalised to sum to one (Mixtral always; Qwen3-MoE by its `norm_topk_prob`), each
expert a SwiGLU, dropless (`capacity_factor=0`), as transformers computes them. Mixtral is Mistral's
attention (`sliding_window`, null: full) and `block_sparse_moe.gate` + `experts.{j}.w1/w3/w2`
(gate/up/down, width `intermediate_size`); Qwen3-MoE is Qwen3's attention (q/k norms, explicit
`head_dim`) and `mlp.gate` + `mlp.experts.{j}.gate_proj/up_proj/down_proj` (width
`moe_intermediate_size`). The router's (X, E) weight is transposed into `router` (E, X) and the
experts' tensors are stacked into `w_gate` / `w_up` (X, E, F) and `w_down` (X, F, E): transposes and
stacking only, so round trips stay bit for bit.

The router's load-balancing loss trains only where the HF config asks for it
(`output_router_logits`): transformers' loss is `experts_per_token` times jaxscale's `aux`
statistic, so `model.moe.router_aux_loss_coef` = `router_aux_loss_coef` x experts_per_token, and
0 (reported, not trained on) otherwise. Qwen3-MoE's `decoder_sparse_step` n (experts on layer i
when (i + 1) % n == 0, a dense `intermediate_size` SwiGLU on the others) is `model.moe.every`:
the decoder's `LayerGroup` of n-1 dense layers then one MoE layer, HF layer g*n + j stored at
group g of `layers/dense_{j}` (j < n-1) or `layers/moe`. What the decoder cannot reproduce is
refused in one paragraph naming the field: other dense-layer patterns (`mlp_only_layers`, a
step that does not divide the layers), router jitter, and whatever the Mistral / Qwen3
converters refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxscale.errors import paragraph
from jaxscale.interop.hf import ConversionError, Leaf, decoder_opener, decoder_saver, llama_leaves
from jaxscale.interop.hf_config import require_keys
from jaxscale.interop.hf_mistral import mistral_config_from_hf, mistral_config_to_hf
from jaxscale.interop.hf_qwen import qwen_config_from_hf, qwen_config_to_hf, qwen_leaves
from jaxscale.models.moe.config import MoEConfig, expert_width

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
    every = _sparse_step(hf, where)
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
               router_aux_loss_coef=coef, router_z_loss_coef=0.0, every=every)
    return {**fields, "name": name, "moe": moe}


def _sparse_step(hf: Mapping[str, Any], where: str) -> int:
    """`model.moe.every` of Qwen3-MoE's `decoder_sparse_step`: a dense MLP on all but every
    n-th layer is the decoder's scanned group of n layers; `mlp_only_layers` (dense layers
    anywhere) and a step that does not divide the layers are no repeating group."""
    step, dense = hf.get("decoder_sparse_step") or 1, list(hf.get("mlp_only_layers") or [])
    layers = hf.get("num_hidden_layers")
    if dense or not isinstance(step, int) or step < 1 or (layers or step) % step:
        raise ConversionError(paragraph(
            f"{where}: decoder_sparse_step={step!r} and mlp_only_layers={dense!r} (over",
            f"num_hidden_layers={layers!r}) give the layers a dense MLP in no repeating",
            "group; jaxscale's decoder scans groups of model.moe.every layers (dense ones, then",
            "one MoE layer), so the dense layers must be all but every n-th, n dividing the",
            "layers. Convert a checkpoint with mlp_only_layers [] and a decoder_sparse_step",
            "that divides num_hidden_layers."))
    return step


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
             "Mixtral always renormalises the top-k weights"),
            ("every", moe.every, name == "mixtral" and moe.every != 1,
             "Mixtral has the experts on every layer")):
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
            **({"decoder_sparse_step": moe.every, "mlp_only_layers": [],
                "norm_topk_prob": moe.norm_topk_prob} if name == "qwen3_moe" else
               {"router_jitter_noise": 0.0}),
            "output_router_logits": moe.router_aux_loss_coef > 0,
            "router_aux_loss_coef": moe.router_aux_loss_coef / k}


@dataclass(frozen=True)
class _GroupLeaf(Leaf):
    """A leaf of a `LayerGroup` block: its group g holds HF layer g * every + offset."""

    every: int = 1
    offset: int = 0

    def layer_names(self, i: int | None) -> tuple[str, ...]:
        return super().layer_names(None if i is None else i * self.every + self.offset)


def moe_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """{jaxscale path: Leaf} of an MoE family: its attention family's leaves with the dense
    MLP's replaced by the router and the stacked experts; with `model.moe.every` > 1 the
    layers' leaves of each block of the group (`_GroupLeaf`), the dense blocks keeping the MLP."""
    name = model_cfg["name"]
    dense = (llama_leaves(model_cfg) if name == "mixtral"
             else qwen_leaves({**model_cfg, "name": "qwen3"}))
    sparse = _sparse_leaves(model_cfg, dict(dense))
    every = MoEConfig.from_config(model_cfg.get("moe")).every
    if every == 1:
        return sparse
    grouped = {k: v for k, v in dense.items() if not k.startswith("layers/")}
    groups = [(f"dense_{j}", dense, j) for j in range(every - 1)] + [("moe", sparse, every - 1)]
    for block, leaves, offset in groups:
        for path, leaf in leaves.items():
            if path.startswith("layers/"):
                grouped[f"layers/{block}/{path.removeprefix('layers/')}"] = _GroupLeaf(
                    leaf.hf_name, leaf.to_jax, leaf.to_hf, leaf.stacked, every, offset)
    return grouped


def _sparse_leaves(model_cfg: Mapping[str, Any], leaves: dict[str, Leaf]) -> dict[str, Leaf]:
    """`leaves` (an attention family's) with the dense MLP's replaced by the MoE block's."""
    family = FAMILIES[model_cfg["name"]]
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
