"""Hugging Face DeepSeek-V3 checkpoints (`DeepseekV3ForCausalLM`) <-> the decoder with latent
attention and DeepSeek's mixture of experts.

    source = open_deepseek_v3(hf_dir, mtp=False)   # model table opener ("deepseek_v3")
    save_deepseek(model, out_dir, dtype=None, max_shard_size=None, mtp=False)

DeepSeek-V3 is the Llama decoder (`models/decoder/`) with `model.attention_kind=latent`
(`models/attention/latent.py`, widths in `model.mla`) and `model.moe.router=sigmoid_group`: a
sigmoid router with a selection bias (`e_score_correction_bias` <-> `balance_bias`), group-limited
top-k, `routed_scaling_factor`, `n_shared_experts` shared experts and the first
`first_k_dense_replace` layers dense (the decoder's `dense_layers` stack, HF layers 0..k-1; the
MoE stack `layers` holds HF layers k..). Tensors are transposed, reshaped and stacked; the one
permutation: DeepSeek's rotary pairs are interleaved (`rope_interleave`, true in the published
checkpoints; false is refused), jaxscale's rotary rotates halves, so the rope rows of
`q_b_proj` (`q_proj`) and `kv_a_proj_with_mqa` are de-interleaved on import (evens, then odds:
the same scores) and interleaved again on export, which always writes `rope_interleave`
true. Round trips stay bit for bit.

The published checkpoints' YaRN rotary (`rope_scaling` yarn with `mscale` / `mscale_all_dim`)
is read as the decoder's `rope_*` fields (`interop/hf_rope.py`); the latent attention takes its
softmax factor from it (`Rope.score_scale`). Refused in one paragraph naming the field: other
rotary scalings the decoder lacks, attention biases, and on export a model that is not this
family's shape (no experts, `moe.every` != 1, another router, no shared expert).

The published checkpoints' FP8 weights (float8_e4m3fn with 128 x 128 block scales,
`quantization_config`) read dequantised (`hf_fp8.py`); exports write them unquantised.

Multi-token prediction (`models/decoder/mtp.py`): a checkpoint's `num_nextn_predict_layers`
MTP layers (HF layer N = num_hidden_layers: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`
and a block's tensors) are left unread (`Source.unread_layers`) unless asked for:
`open_deepseek_v3(hf_dir, mtp=True)` (`hf.load(..., mtp=True)`, `convert --mtp`) reads layer N
as the model's `mtp` module (`model.mtp_depth=1`); its `embed_tokens` and `shared_head.head`
copies of the main embedding and head are not read. `save_deepseek(..., mtp=True)` writes the
module as layer N, those two copies included, with `num_nextn_predict_layers` 1; without it the
export has no MTP layer (0), whether or not the model has one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxscale.errors import paragraph
from jaxscale.interop.hf import (
    ConversionError,
    Leaf,
    Pretrained,
    Source,
    decoder_opener,
    save_decoder,
    unpack,
)
from jaxscale.interop.hf_config import decoder_fields, require_keys
from jaxscale.interop.hf_fp8 import fp8_reader
from jaxscale.interop.hf_rope import rope_scaling_to_hf
from jaxscale.models.attention.latent import MLAConfig
from jaxscale.models.moe.config import BIASED_ROUTERS, MoEConfig, expert_width
from jaxscale.models.nn.fused import GATE_UP
from jaxscale.weights.sources import read_hf_config

REQUIRED = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


def deepseek_config_from_hf(hf: Mapping[str, Any], where: str = "config.json",
                            name: str = "deepseek_v3", model_type: str = "deepseek_v3") -> dict:
    """HF `DeepseekV3Config` fields -> `config.model` of `model.name=deepseek_v3` (also the
    latent attention and expert widths DeepSeek-V2 shares, `model_type` its: hf_deepseek_v2)."""
    if hf.get("model_type") != model_type:
        raise ConversionError(paragraph(
            f"{where}: model_type={hf.get('model_type')!r} is read by the {model_type}",
            f"converter; only model_type={model_type!r} is (the model table dispatches:",
            "interop.hf.load)."))
    require_keys(hf, REQUIRED, where, model_type)
    if hf.get("attention_bias"):
        raise ConversionError(paragraph(
            f"{where}: attention_bias=True adds biases to the latent attention's projections,",
            "which jaxscale's latent attention has not. Convert a checkpoint with",
            "attention_bias=false (the published DeepSeek-V3 has none)."))
    if hf.get("rope_interleave", True) is not True:
        raise ConversionError(paragraph(
            f"{where}: rope_interleave={hf['rope_interleave']!r}: the converter de-interleaves",
            "DeepSeek's rotary pairs (rope_interleave true, the published checkpoints' and",
            "transformers' default) into jaxscale's rotate-half layout. Convert a checkpoint",
            "with rope_interleave true."))
    fields = decoder_fields(hf, where, name)  # the rotary (YaRN included) read and checked
    heads = fields["num_heads"]
    mla = dict(q_lora_rank=int(hf.get("q_lora_rank") or 0), kv_lora_rank=int(hf["kv_lora_rank"]),
               qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
               qk_nope_head_dim=int(hf["qk_nope_head_dim"]), v_head_dim=int(hf["v_head_dim"]))
    moe = dict(num_experts=int(hf["n_routed_experts"]), router="sigmoid_group",
               experts_per_token=int(hf["num_experts_per_tok"]),
               norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
               mlp=int(hf["moe_intermediate_size"]),
               shared_experts=int(hf.get("n_shared_experts") or 0), capacity_factor=0.0,
               router_aux_loss_coef=0.0, router_z_loss_coef=0.0, every=1,
               n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
               routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
               bias_update_rate=0.0,
               first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0))
    return {**fields, "num_kv_heads": heads, "head_dim": mla["qk_rope_head_dim"],
            "attention_kind": "latent", "mla": mla, "moe": moe}


def deepseek_config_to_hf(model_cfg: Mapping[str, Any]) -> dict:
    """`config.model` of a deepseek_v3 model -> a `config.json` `DeepseekV3ForCausalLM` loads."""
    m = dict(model_cfg)
    moe, mla = MoEConfig.from_config(m.get("moe")), MLAConfig.from_config(m.get("mla"))
    for key, value, wrong, why in (
            ("attention_kind", m.get("attention_kind"), m.get("attention_kind") != "latent",
             "DeepSeek-V3's attention is latent"),
            ("moe.num_experts", moe.num_experts, not moe.num_experts, "it has experts"),
            ("moe.router", moe.router, moe.router != "sigmoid_group",
             "it routes by sigmoid_group"),
            ("moe.every", moe.every, moe.every != 1, "every layer past the dense ones has experts"),
            ("moe.shared_experts", moe.shared_experts, moe.shared_experts < 1,
             "it always has a shared expert")):
        if wrong:
            raise ConversionError(paragraph(
                f"model.{key}={value!r} does not fit a Hugging Face DeepSeek-V3: {why}, so the",
                "export would drop tensors or compute another model. Export it as the family it",
                "is."))
    scaling = rope_scaling_to_hf(m)
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": m["vocab_size"], "hidden_size": m["embed"],
        "intermediate_size": m["mlp"], "moe_intermediate_size": expert_width(moe, m["mlp"]),
        "num_hidden_layers": m["num_layers"], "num_attention_heads": m["num_heads"],
        "num_key_value_heads": m["num_heads"], "max_position_embeddings": m["max_len"],
        "rms_norm_eps": m["norm_eps"], "tie_word_embeddings": bool(m["tie_embeddings"]),
        "hidden_act": "silu", "attention_bias": False, "rope_interleave": True,
        "rope_theta": m["rope_theta"], "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}),
                            "rope_theta": m["rope_theta"]},
        "q_lora_rank": mla.q_lora_rank or None, "kv_lora_rank": mla.kv_lora_rank,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "v_head_dim": mla.v_head_dim, "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token, "n_shared_experts": moe.shared_experts,
        "n_group": moe.n_group, "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": moe.norm_topk_prob,
        "first_k_dense_replace": moe.first_k_dense_replace, "num_nextn_predict_layers": 0,
        "bos_token_id": None, "eos_token_id": None,
    }


@dataclass(frozen=True)
class _Offset(Leaf):
    """A leaf of a stack whose layer i is HF layer i + offset (the MoE stack after the dense)."""

    offset: int = 0

    def layer_names(self, i: int | None) -> tuple[str, ...]:
        return super().layer_names(None if i is None else i + self.offset)


def _deinterleave(r: int) -> np.ndarray:
    """The rope rows' order in jaxscale: DeepSeek's pairs (x0, x1), (x2, x3).. as evens, odds."""
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])


def deepseek_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """{jaxscale path: Leaf} of a deepseek_v3 model: embedding, head and final norm, and per
    stack (`dense_layers`, then `layers` from HF layer first_k_dense_replace) its norms, latent
    attention and dense MLP or experts."""
    ident = lambda x: x
    t = lambda w: w.T
    leaves = {"embedding": Leaf("model.embed_tokens.weight", ident, ident, stacked=False),
              "final_norm/scale": Leaf("model.norm.weight", ident, ident, stacked=False)}
    if not model_cfg["tie_embeddings"]:
        leaves["lm_head"] = Leaf("lm_head.weight", t, t, stacked=False)
    moe = MoEConfig.from_config(model_cfg.get("moe"))
    k, n = moe.first_k_dense_replace, model_cfg["num_layers"]
    stacks = ([("dense_layers", 0, False)] if k else []) + [("layers", k, True)]
    if model_cfg.get("mtp_depth"):
        stacks.append(("mtp/block", n, bool(moe.num_experts)))
        leaves.update(_mtp_leaves(model_cfg))
    for stack, offset, sparse in stacks:
        own = {**_attention_leaves(model_cfg), **(_expert_leaves(moe) if sparse else {
            "mlp/w_gate_up": Leaf(("{p}mlp.gate_proj.weight", "{p}mlp.up_proj.weight"),
                                  lambda g, u: GATE_UP.join(g.T, u.T),
                                  lambda w: tuple(x.T for x in GATE_UP.split(w))),
            "mlp/w_down": Leaf("{p}mlp.down_proj.weight", t, t)})}
        for path, leaf in own.items():
            names = tuple(n.replace("{p}", "model.layers.{i}.") for n in leaf.names)
            leaves[f"{stack}/{path}"] = _Offset(names if len(names) > 1 else names[0],
                                                leaf.to_jax, leaf.to_hf, True, offset)
    return leaves


def _mtp_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """The MTP module's own tensors at HF layer N (its block: `deepseek_leaves`). The layer's
    copies of the embedding and head are written beside the main ones on export (both names
    of one leaf) and not read on import (the first name is)."""
    ident, t = (lambda x: x), (lambda w: w.T)
    p = f"model.layers.{model_cfg['num_layers']}."
    first = lambda a, _copy: a
    both = lambda w: (w, w)
    copies = {"embedding": Leaf(("model.embed_tokens.weight", p + "embed_tokens.weight"),
                                first, both, stacked=False)}
    head = ("model.embed_tokens.weight" if model_cfg["tie_embeddings"] else "lm_head.weight")
    if model_cfg["tie_embeddings"]:  # the head is the embedding: three names
        copies["embedding"] = Leaf(copies["embedding"].names + (p + "shared_head.head.weight",),
                                   lambda a, *_: a, lambda w: (w, w, w), stacked=False)
    else:
        copies["lm_head"] = Leaf((head, p + "shared_head.head.weight"),
                                 lambda a, _copy: a.T, lambda w: (w.T, w.T), stacked=False)
    return {**copies,
            "mtp/enorm/scale": Leaf(p + "enorm.weight", ident, ident, stacked=False),
            "mtp/hnorm/scale": Leaf(p + "hnorm.weight", ident, ident, stacked=False),
            "mtp/eh_proj": Leaf(p + "eh_proj.weight", t, t, stacked=False),  # (E, 2E) <-> (2E, E)
            "mtp/final_norm/scale": Leaf(p + "shared_head.norm.weight", ident, ident,
                                         stacked=False)}


def _attention_leaves(model_cfg: Mapping[str, Any]) -> dict[str, Leaf]:
    """A block's norms and latent attention, HF names with `{p}` for the layer's prefix."""
    mla = MLAConfig.from_config(model_cfg.get("mla"))
    h, e, n, r = model_cfg["num_heads"], model_cfg["embed"], mla.qk_nope_head_dim, \
        mla.qk_rope_head_dim
    d, c, v = n + r, mla.kv_lora_rank, mla.v_head_dim
    perm = _deinterleave(r)
    inv = np.argsort(perm)
    # The last axis of q's heads (.., D) and of the compressed kv (C + R): rope rows permuted.
    q_in = lambda w, fan: w.T.reshape(fan, h, d)[..., np.r_[np.arange(n), n + perm]]
    q_out = lambda w: w[..., np.r_[np.arange(n), n + inv]].reshape(w.shape[0], h * d).T
    ident = lambda x: x
    leaves = {
        "attn_norm/scale": Leaf("{p}input_layernorm.weight", ident, ident),
        "mlp_norm/scale": Leaf("{p}post_attention_layernorm.weight", ident, ident),
        "attn/wkv_a": Leaf("{p}self_attn.kv_a_proj_with_mqa.weight",  # (C + R, E) <-> (E, C + R)
                           lambda w: w.T[:, np.r_[np.arange(c), c + perm]],
                           lambda w: w[:, np.r_[np.arange(c), c + inv]].T),
        "attn/kv_norm/scale": Leaf("{p}self_attn.kv_a_layernorm.weight", ident, ident),
        "attn/wkv_b": Leaf("{p}self_attn.kv_b_proj.weight",  # (H (N + V), C) <-> (C, H, N + V)
                           lambda w: w.T.reshape(c, h, n + v), lambda w: w.reshape(c, -1).T),
        "attn/wo": Leaf("{p}self_attn.o_proj.weight",  # (E, H V) <-> (H, V, E)
                        lambda w: w.T.reshape(h, v, e), lambda w: w.reshape(h * v, e).T),
    }
    if mla.q_lora_rank:
        q = mla.q_lora_rank
        leaves.update({
            "attn/wq_a": Leaf("{p}self_attn.q_a_proj.weight", lambda w: w.T, lambda w: w.T),
            "attn/q_norm/scale": Leaf("{p}self_attn.q_a_layernorm.weight", ident, ident),
            "attn/wq_b": Leaf("{p}self_attn.q_b_proj.weight", lambda w: q_in(w, q), q_out)})
    else:
        leaves["attn/wq"] = Leaf("{p}self_attn.q_proj.weight", lambda w: q_in(w, e), q_out)
    return leaves


def _expert_leaves(moe: MoEConfig) -> dict[str, Leaf]:
    """A MoE block's router, selection bias, stacked experts and shared experts."""
    t = lambda w: w.T
    p = "{p}mlp."
    leaves = {"mlp/router": Leaf(p + "gate.weight", t, t),  # (X, E) <-> (E, X)
              "mlp/shared/w_gate_up": Leaf(
                  (p + "shared_experts.gate_proj.weight", p + "shared_experts.up_proj.weight"),
                  lambda g, u: GATE_UP.join(g.T, u.T),
                  lambda w: tuple(x.T for x in GATE_UP.split(w))),
              "mlp/shared/w_down": Leaf(p + "shared_experts.down_proj.weight", t, t)}
    if moe.router in BIASED_ROUTERS:  # V3's selection bias (V2's routers keep none)
        leaves["mlp/balance_bias"] = Leaf(p + "gate.e_score_correction_bias", lambda b: b,
                                          lambda b: b)
    for path, hf_name in zip(("w_gate", "w_up", "w_down"), ("gate_proj", "up_proj", "down_proj")):
        leaves[f"mlp/{path}"] = Leaf(  # X of (F, E) <-> (X, E, F); down (E, F) <-> (X, F, E)
            tuple(p + f"experts.{j}.{hf_name}.weight" for j in range(moe.num_experts)),
            lambda *w: np.stack([x.T for x in w]), lambda w: tuple(x.T for x in w))
    return leaves


_open = decoder_opener("deepseek_v3", deepseek_config_from_hf, deepseek_leaves)


def with_fp8(source: Source, hf_dir: str) -> Source:
    """`source` reading its FP8 block-quantised weights dequantised (the published V3's:
    `hf_fp8.py`), when config.json's `quantization_config` says it has them."""
    reader = fp8_reader(source.reader, read_hf_config(hf_dir), f"{hf_dir}/config.json")
    return dataclasses.replace(source, reader=reader)


def open_deepseek_v3(hf_dir: str, mtp: bool = False) -> Source:
    """The config and lazy reader of a HF deepseek_v3 directory (validated). Its
    `num_nextn_predict_layers` multi-token-prediction layers (after the last, in the published
    checkpoints) are left unread, not refused as layers past num_hidden_layers; with `mtp`, the
    first is read as the model's MTP module (`model.mtp_depth=1`)."""
    source = with_fp8(_open(hf_dir), hf_dir)
    depth = read_hf_config(hf_dir).get("num_nextn_predict_layers") or 0
    depth = depth if isinstance(depth, int) else 0
    if not mtp:
        return dataclasses.replace(source, unread_layers=depth)
    if depth < 1:
        raise ConversionError(paragraph(
            f"{hf_dir}/config.json: num_nextn_predict_layers={depth}, so the checkpoint has no",
            "multi-token-prediction layer to read (mtp=True, convert --mtp). Convert it",
            "without MTP, or use a checkpoint that has one (the published DeepSeek-V3's: 1)."))
    model_cfg = {**source.model_cfg, "mtp_depth": 1}
    return dataclasses.replace(source, model_cfg=model_cfg, leaves=deepseek_leaves(model_cfg),
                               unread_layers=depth - 1)


def save_deepseek(model: Pretrained | tuple[Mapping, Mapping], out_dir: str, dtype: Any = None,
                  max_shard_size: int | str | None = None, mtp: bool = False) -> str:
    """Writes a deepseek_v3 model's `config.json` + safetensors (`hf.save_decoder`); `mtp`:
    its MTP module too, as HF layer num_hidden_layers (refused for a model without one)."""
    model_cfg, _ = unpack(model, "save_deepseek")
    if mtp and not model_cfg.get("mtp_depth"):
        raise ConversionError(paragraph(
            f"save_deepseek(mtp=True): model.mtp_depth={model_cfg.get('mtp_depth', 0)}, so the",
            "model has no multi-token-prediction module to write. Export without mtp, or train",
            "with model.mtp_depth=1."))
    written = {**model_cfg, "mtp_depth": int(mtp)}
    return save_decoder(model, out_dir, lambda m: {**deepseek_config_to_hf(m),
                                                   "num_nextn_predict_layers": int(mtp)},
                        lambda m: deepseek_leaves(written), dtype, max_shard_size,
                        "save_deepseek", ("deepseek_v3",))


save_deepseek.leaves_of = deepseek_leaves  # the leaf table, for writers of other layouts
