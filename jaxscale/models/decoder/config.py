"""The decoder's config (`LlamaConfig`, built from `config.model`) and its own checks.

Every decoder family of the model table is this config with other defaults (`qwen.py`,
`gemma.py`); `check_config` is their entry's `check`, run by `config.validate` through the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.attention.kernels import ATTENTION_IMPLS, SINK_IMPLS, SOFTCAP_IMPLS
from jaxscale.models.attention.kinds import DEFAULT_ATTENTION, attention_of
from jaxscale.models.attention.latent import MLAConfig
from jaxscale.models.attention.sequence.context import check_config as check_context
from jaxscale.models.moe.config import MoEConfig, sparse_layers
from jaxscale.models.moe.config import num_params as moe_params
from jaxscale.models.moe.layer import check_moe
from jaxscale.models.nn.rope import Rope, check_rope


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    embed: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    mlp: int = 512
    max_len: int = 2048
    rope_theta: float = 10000.0
    # Rotary scaling (HF `rope_scaling`): none | linear | llama3 | yarn; see
    # jaxscale/models/nn/rope.py.
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0       # llama3 only
    rope_high_freq_factor: float = 4.0      # llama3 only
    rope_original_max_len: int = 8192       # llama3, yarn: the pre-extension context length
    rope_beta_fast: float = 32.0            # yarn only: the ramp's ends, in rotations
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0                # yarn only: DeepSeek's attention-scale terms (0: none)
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True              # yarn only: the ramp's ends rounded to whole dims
    rope_attention_factor: float = 0.0      # yarn only: q/k scale; 0: derived from rope_factor
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    remat: str = "none"
    # The LM head and loss run over the sequence in this many strided chunks, each recomputed
    # in the backward pass (`head_losses`): the (batch, length, vocab) float32 logits and their
    # gradient exist one chunk at a time. 1: the whole sequence at once; 0 (default): automatic,
    # the fewest chunks that keep a chip's logits under `lm_task.LOGITS_BUDGET`.
    loss_chunks: int = 0
    # The attention component (`attention/kinds.py` ATTENTIONS): its parameters, cache, FLOPs
    # and bytes. Default grouped-query (num_kv_heads kv heads of head_dim).
    attention_kind: str = DEFAULT_ATTENTION
    # The kernel it computes attention with: "einsum", "dot_product_attention" (fused; cuDNN
    # flash on GPUs), or "splash" (the Pallas TPU flash kernel: no score matrix in HBM;
    # attention/splash.py)
    attention: str = "einsum"
    # Sliding-window attention (Mistral's `sliding_window`): a query at position i sees the keys
    # at i - sliding_window < j <= i only (in training, evaluation and the KV cache alike);
    # 0 or None: the full causal context. Checked by `check_sliding_window`.
    sliding_window: int | None = 0
    # attention across sequence shards (mesh.context > 1): "allgather", "ring" or "ring_vjp"
    # (attention/sequence/context.py)
    context_attention: str = "allgather"
    # the order of a training sequence over its shards: "auto" (zigzag for the ring when the
    # length allows), "zigzag" (load-balanced causal work) or "natural"
    # (models/attention/sequence/context.py)
    context_order: str = "auto"
    # Decoder switches (Qwen2/2.5 and Qwen3 are this model with them on; `qwen.py`):
    qkv_bias: bool = False   # a bias on the q/k/v projections
    qk_norm: bool = False    # per-head RMSNorm of q and k before rotary
    # GPT-OSS's switches (`gpt_oss.py`):
    out_bias: bool = False   # a bias on the attention's output projection
    attn_sinks: bool = False  # a learned logit per head in each softmax denominator
    # Gemma's switches (`gemma.py`):
    norm_offset: bool = False      # RMSNorms scale by 1 + weight (weights start at zero)
    post_norms: bool = False       # RMSNorms after attention and after the MLP too (4 a block)
    embed_scale: bool = False      # embeddings times sqrt(embed), in the compute dtype
    mlp_activation: str = "silu"   # or "gelu_tanh" (GeGLU): `layers.ACTIVATIONS`
    query_pre_attn_scalar: float = 0.0  # scores scaled by 1/sqrt(this); 0: head_dim
    # A local/global pattern: layer i is "sliding_attention" (the `sliding_window`, rotary
    # `rope_local_theta` when set) or "full_attention"; empty: every layer alike (the window,
    # if any, on all). A mixed pattern is scanned as a per-layer flag (`Block.per_layer`).
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 0.0  # rotary base of the local layers; 0: rope_theta
    # Gemma 2's soft-capping, x -> cap * tanh(x / cap), of the attention scores and of the
    # final logits; 0: none. Attention soft-capping runs the einsum or splash kernel.
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Mixture of experts in place of the dense MLP (num_experts > 0): jaxscale/models/moe/layer.py.
    moe: MoEConfig = MoEConfig()
    # Multi-head latent attention's widths (`attention_kind=latent`): attention/latent.py.
    mla: MLAConfig = MLAConfig()
    # DeepSeek-V3's multi-token prediction (`mtp.py`): 1 adds the MTP module (training only),
    # its cross entropy weighted by mtp_loss_weight in the loss; 0: none.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    @classmethod
    def from_config(cls, model_cfg: Mapping[str, Any]) -> "LlamaConfig":
        fields = cls.__dataclass_fields__
        kw = {k: v for k, v in dict(model_cfg).items() if k in fields}
        if "moe" in kw:
            kw["moe"] = MoEConfig.from_config(kw["moe"])
        if "mla" in kw:
            kw["mla"] = MLAConfig.from_config(kw["mla"])
        if "layer_types" in kw:
            kw["layer_types"] = tuple(kw["layer_types"] or ())
        return cls(**kw)

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: does it use the sliding window (and the local rotary)? Without
        `layer_types`, every layer does exactly when there is a window."""
        if not self.layer_types:
            return (bool(self.sliding_window),) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def local_rope(self) -> Rope:
        """The local layers' rotary (Gemma 3's `rope_local_base_freq`: plain, unscaled)."""
        return Rope(self.rope_local_theta) if self.rope_local_theta else self.rope

    @property
    def rope(self) -> Rope:
        """The rotary settings every attention layer (and the KV-cache decoder) uses."""
        return Rope(self.rope_theta, self.rope_scaling, self.rope_factor,
                    self.rope_low_freq_factor, self.rope_high_freq_factor,
                    self.rope_original_max_len, self.rope_beta_fast, self.rope_beta_slow,
                    self.rope_mscale, self.rope_mscale_all_dim, self.rope_truncate,
                    self.rope_attention_factor)

    @property
    def moe_layers(self) -> int:
        """How many layers run the experts (`moe.config.sparse_layers`)."""
        return sparse_layers(self.moe, self.num_layers)

    def num_params(self) -> int:
        """The model's parameters: its attention component's (`attention_of`), the MLP's or
        experts', the norms (two a block, four with `post_norms`), embedding and head."""
        e, f, l = self.embed, self.mlp, self.num_layers
        ffn = self.moe_layers * moe_params(self.moe, e, f) + (l - self.moe_layers) * 3 * e * f
        per_layer = attention_of(self).num_params() + (2 + 2 * self.post_norms) * e
        head = 0 if self.tie_embeddings else e * self.vocab_size
        mtp = self.mtp_depth * (3 * e + 2 * e * e + per_layer + (
            moe_params(self.moe, e, f) if self.moe.num_experts else 3 * e * f))
        return self.vocab_size * e + l * per_layer + ffn + e + head + mtp


def check_config(m: Mapping[str, Any], seq_len: int,
                 config_cls: type[LlamaConfig] = LlamaConfig) -> None:
    """The decoder's own `config.model` checks, run by `config.validate` through the model table
    (a ConfigError paragraph naming the field): what would otherwise fail deep inside the build
    or silently compute another model. `config_cls`: the family's (its defaults); the attention
    component checks its own fields."""
    def require(ok: bool, *sentences: str) -> None:
        if not ok:
            raise ConfigError(paragraph(*sentences))

    attention_of(config_cls.from_config(m)).check()
    require(seq_len <= m["max_len"],
            f"data.seq_len={seq_len} exceeds model.max_len={m['max_len']}.")
    check_rope(m)
    attention = m.get("attention", "einsum")
    require(attention in ATTENTION_IMPLS,
            f"model.attention={attention!r}: use one of {', '.join(ATTENTION_IMPLS)}.")
    check_sliding_window(m)
    check_layer_pattern(m)
    chunks = m.get("loss_chunks", 0)
    require(isinstance(chunks, int) and (chunks == 0 or chunks >= 1 and seq_len % chunks == 0),
            f"model.loss_chunks={chunks!r} must be 0 (automatic) or a positive divisor of",
            f"data.seq_len ({seq_len}): the LM head and loss run over the sequence in that many",
            "chunks (1: all at once; 4-16 cut the float32 logits' memory that many times).")
    check_moe(m)
    check_mtp(m)


def check_mesh(m: Mapping[str, Any], mesh_cfg: Mapping[str, Any], seq_len: int,
               repeats: int = 1) -> None:
    """The decoder's checks against `config.mesh` (and `pipeline.repeats`): attention across
    sequence shards (`mesh.context`), the experts over `mesh.expert` and the pipeline stages."""
    check_context(mesh_cfg, m, seq_len)
    check_moe(m, mesh_cfg, repeats)
    check_mtp(m, mesh_cfg)


def check_sliding_window(m: Mapping[str, Any]) -> None:
    """`model.sliding_window`: None or a non-negative int (0: full causal attention). Every
    kernel in `ATTENTION_IMPLS` applies it (einsum and the KV cache through `Mask.dense`, the
    fused kernel's `local_window_size`, splash's `LocalMask`), so no kernel is refused."""
    window = m.get("sliding_window", 0)
    if window is None or (isinstance(window, int) and not isinstance(window, bool)
                          and window >= 0):
        return
    raise ConfigError(paragraph(
        f"model.sliding_window={window!r} must be a non-negative integer: the number of",
        "latest positions a query attends to, itself included (Mistral's sliding_window,",
        "e.g. 4096), or 0 for the full causal context.",
    ))


def check_layer_pattern(m: Mapping[str, Any]) -> None:
    """`model.layer_types`: one known kind per layer. A mixed pattern passes each layer's
    window to the mask as a traced value: einsum (and the KV cache) take it, splash chooses
    between its static local and global kernels per layer (`attention/splash.py`); the fused
    kernel builds its mask from a static window, so it is refused."""
    kinds = tuple(m.get("layer_types") or ())
    known = ("sliding_attention", "full_attention")
    bad = [k for k in kinds if k not in known]
    if kinds and (bad or len(kinds) != m["num_layers"]):
        raise ConfigError(paragraph(
            f"model.layer_types={list(kinds)!r} must name one of {', '.join(known)} for each",
            f"of the model.num_layers={m['num_layers']} layers (or be empty: every layer alike)."))
    attention = m.get("attention", "einsum")
    if m.get("attn_sinks") and attention not in SINK_IMPLS:
        raise ConfigError(paragraph(
            f"model.attention={attention!r} has no attention sinks (model.attn_sinks, GPT-OSS's",
            "learned per-head logit in each softmax denominator): jax.nn.dot_product_attention",
            "takes no extra softmax term, and leaving it out computes another model. Use",
            "model.attention=einsum (or splash on TPUs)."))
    if m.get("attn_softcap") and attention not in SOFTCAP_IMPLS:
        raise ConfigError(paragraph(
            f"model.attention={attention!r} does not soft-cap the attention scores",
            f"(model.attn_softcap={m['attn_softcap']}, Gemma 2's): use model.attention=einsum",
            "(or splash on TPUs)."))
    if len(set(kinds)) > 1 and attention not in ("einsum", "splash"):
        raise ConfigError(paragraph(
            f"model.attention={attention!r} cannot follow a mixed model.layer_types (local and",
            "global layers, Gemma's pattern): the layers are scanned, so each layer's window is",
            "a traced value, and that kernel needs a static window. Use model.attention=einsum",
            "(or splash on TPUs)."))


def check_mtp(m: Mapping[str, Any], mesh: Mapping[str, Any] | None = None) -> None:
    """`model.mtp_depth` / `model.mtp_loss_weight` (ConfigError paragraphs); with `config.mesh`,
    the meshes whose schedules the MTP loss does not run in yet."""
    depth, weight = m.get("mtp_depth", 0), m.get("mtp_loss_weight", 0.3)
    if depth not in (0, 1) or isinstance(depth, bool):
        raise ConfigError(paragraph(
            f"model.mtp_depth={depth!r} must be 0 (no multi-token prediction) or 1 (DeepSeek-V3's",
            "one MTP module, predicting the token after next): deeper chains are not built."))
    if not (isinstance(weight, (int, float)) and 0 <= weight < float("inf")):
        raise ConfigError(paragraph(
            f"model.mtp_loss_weight={weight!r} must be a finite number >= 0: the MTP cross",
            "entropy's weight in the training loss (DeepSeek-V3: 0.3 for the first 10T tokens,",
            "then 0.1)."))
    if depth and len(set(m.get("layer_types") or ())) > 1:
        raise ConfigError(paragraph(
            "model.mtp_depth=1 with a mixed model.layer_types pattern: the MTP block is one",
            "layer of neither kind. Use multi-token prediction on a model whose layers are alike",
            "(DeepSeek-V3's), or model.mtp_depth=0."))
    if not depth or mesh is None:
        return
    stages = mesh.get("pipeline", 1) * mesh.get("dcn_pipeline", 1)
    context = mesh.get("context", 1) * mesh.get("dcn_context", 1)
    if stages > 1 or context > 1:
        raise ConfigError(paragraph(
            f"model.mtp_depth=1 with mesh.pipeline x dcn_pipeline={stages} and mesh.context x",
            f"dcn_context={context}: the MTP module runs after the last layer on whole,",
            "naturally ordered sequences, which pipeline schedules and sequence shards do not",
            "give it yet. Use data, fsdp, expert and tensor axes, or model.mtp_depth=0."))
