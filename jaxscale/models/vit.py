"""A Vision Transformer classifier (ViT, Dosovitskiy et al. 2021) in Flax NNX, HF-ViT compatible.

Patch embedding (a strided convolution written as an einsum over patches), a class token and
learned position embeddings, a pre-norm encoder (LayerNorm with bias, multi-head attention with
biases, GELU MLP) stacked along a leading `layers` dimension and scanned like the Llama's, a final
LayerNorm and a linear head on the class token. Every parameter carries logical axes, so the same
rules shard it. The `classify` task (`CLASSIFY`: integer labels, mean cross entropy, held-out
sums) and the FLOP count per token live here.
Shape suffixes: B batch, H/W image height/width, C channels, P patch size, N patches + 1,
E embed, A heads, D head dim, F mlp hidden, K classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from einops import rearrange
from flax import nnx

from jaxscale.models.attention.kernels import attend
from jaxscale.models.nn.layers import param, project
from jaxscale.models.nn.scan import check_remat, scan_layers
from jaxscale.models.runner import LayerRunner
from jaxscale.models.task import Task, masked_sums
from jaxscale.precision import Policy, get_policy
from jaxscale.rules import constrain


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    num_classes: int = 10
    embed: int = 64
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 16
    mlp: int = 128
    norm_eps: float = 1e-12
    remat: str = "none"

    @classmethod
    def from_config(cls, model_cfg: Mapping[str, Any]) -> "ViTConfig":
        fields = cls.__dataclass_fields__
        cfg = cls(**{k: v for k, v in dict(model_cfg).items() if k in fields})
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image_size={cfg.image_size} is not a multiple of patch_size="
                             f"{cfg.patch_size}; choose a patch size that tiles the image.")
        return cfg

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, policy: Policy, *, stack: int | None = None):
        self.scale = param(None, (dim,), ("norm",), init="ones", stack=stack, dtype=policy.param)
        self.bias = param(None, (dim,), ("norm",), init="zeros", stack=stack, dtype=policy.param)
        self.eps, self.policy = eps, policy

    def __call__(self, x_BNE: jax.Array) -> jax.Array:
        dtype = self.policy.dtype_for("norm")
        x = x_BNE.astype(dtype)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(var + self.eps)
        scale_11E = self.scale[...].astype(dtype)[None, None]
        out = x * scale_11E + self.bias[...].astype(dtype)[None, None]
        return out.astype(self.policy.compute)


class SelfAttention(nnx.Module):
    """Bidirectional multi-head attention with biases on every projection (as HF ViT)."""

    LORA_WEIGHTS = ("wq", "wk", "wv", "wo")  # read through `project`: may carry LoRA adapters

    def __init__(self, embed: int, heads: int, head_dim: int, policy: Policy, rngs: nnx.Rngs,
                 *, stack: int | None = None):
        kw = dict(stack=stack, dtype=policy.param)
        for name in ("wq", "wk", "wv"):
            setattr(self, name, param(rngs, (embed, heads, head_dim),
                                      ("embed", "heads", "head_dim"), fan_in=embed, **kw))
            setattr(self, "b" + name[1], param(None, (heads, head_dim), ("heads", "head_dim"),
                                               init="zeros", **kw))
        self.wo = param(rngs, (heads, head_dim, embed), ("heads", "head_dim", "embed"),
                        fan_in=heads * head_dim, **kw)
        self.bo = param(None, (embed,), ("embed",), init="zeros", **kw)
        self.policy = policy

    def __call__(self, x_BNE: jax.Array) -> jax.Array:
        c = self.policy.compute
        proj = lambda n: (project(self, "w" + n, "bne,ead->bnad", x_BNE, c)
                          + getattr(self, "b" + n)[...].astype(c)[None, None])
        q_BNAD = constrain(proj("q"), "batch", "length", "heads", "head_dim")
        k_BNAD = constrain(proj("k"), "batch", "length", "heads", "head_dim")
        v_BNAD = constrain(proj("v"), "batch", "length", "heads", "head_dim")
        out_BNAD = attend(q_BNAD, k_BNAD, v_BNAD, None,
                          softmax_dtype=self.policy.dtype_for("softmax"))  # bidirectional
        out_BNE = (project(self, "wo", "bnad,ade->bne", out_BNAD, c)
                   + self.bo[...].astype(c)[None, None])
        return constrain(out_BNE, "batch", "length", "embed")


class GeluMLP(nnx.Module):
    LORA_WEIGHTS = ("w_in", "w_out")

    def __init__(self, embed: int, hidden: int, policy: Policy, rngs: nnx.Rngs, *,
                 stack: int | None = None):
        kw = dict(stack=stack, dtype=policy.param)
        self.w_in = param(rngs, (embed, hidden), ("embed", "mlp"), fan_in=embed, **kw)
        self.b_in = param(None, (hidden,), ("mlp",), init="zeros", **kw)
        self.w_out = param(rngs, (hidden, embed), ("mlp", "embed"), fan_in=hidden, **kw)
        self.b_out = param(None, (embed,), ("embed",), init="zeros", **kw)
        self.policy = policy

    def __call__(self, x_BNE: jax.Array) -> jax.Array:
        c = self.policy.compute
        h_BNF = project(self, "w_in", "bne,ef->bnf", x_BNE, c)
        h_BNF = jax.nn.gelu(h_BNF + self.b_in[...].astype(c)[None, None], approximate=False)
        h_BNF = constrain(h_BNF, "batch", "length", "mlp")
        out_BNE = project(self, "w_out", "bnf,fe->bne", h_BNF, c)
        out_BNE = out_BNE + self.b_out[...].astype(c)[None, None]
        return constrain(out_BNE, "batch", "length", "embed")


class EncoderBlock(nnx.Module):
    def __init__(self, cfg: ViTConfig, policy: Policy, rngs: nnx.Rngs, stack: int):
        self.attn_norm = LayerNorm(cfg.embed, cfg.norm_eps, policy, stack=stack)
        self.attn = SelfAttention(cfg.embed, cfg.num_heads, cfg.head_dim, policy, rngs,
                                  stack=stack)
        self.mlp_norm = LayerNorm(cfg.embed, cfg.norm_eps, policy, stack=stack)
        self.mlp = GeluMLP(cfg.embed, cfg.mlp, policy, rngs, stack=stack)

    def __call__(self, h_BNE: jax.Array, positions: Any = None) -> jax.Array:
        h_BNE = h_BNE + self.attn(self.attn_norm(h_BNE))
        h_BNE = h_BNE + self.mlp(self.mlp_norm(h_BNE))
        return constrain(h_BNE, "batch", "length", "embed")


class ViT(nnx.Module):
    def __init__(self, cfg: ViTConfig, rngs: nnx.Rngs, policy: Policy | None = None):
        policy = policy or get_policy("32-true")
        check_remat(cfg.remat)
        self.cfg, self.policy = cfg, policy
        p, e, dt = cfg.patch_size, cfg.embed, policy.param
        self.patch_kernel = param(rngs, (p, p, cfg.channels, e), (None, None, None, "embed"),
                                  fan_in=p * p * cfg.channels, dtype=dt)
        self.patch_bias = param(None, (e,), ("embed",), init="zeros", dtype=dt)
        self.cls_token = param(rngs, (e,), ("embed",), fan_in=50, dtype=dt)
        self.pos_embedding = param(rngs, (cfg.num_patches + 1, e), (None, "embed"),
                                   fan_in=50, dtype=dt)
        self.layers = EncoderBlock(cfg, policy, rngs, stack=cfg.num_layers)
        self.final_norm = LayerNorm(e, cfg.norm_eps, policy)
        self.head_kernel = param(rngs, (e, cfg.num_classes), ("embed", None), fan_in=e, dtype=dt)
        self.head_bias = param(None, (cfg.num_classes,), (None,), init="zeros", dtype=dt)

    def embed(self, images_BHWC: jax.Array) -> jax.Array:
        c, p = self.policy.compute, self.cfg.patch_size
        b = images_BHWC.shape[0]
        x_BNPPC = rearrange(images_BHWC.astype(c), "b (i p) (j q) ch -> b (i j) p q ch", p=p, q=p)
        patches_BNE = jnp.einsum("bnpqc,pqce->bne", x_BNPPC, self.patch_kernel[...].astype(c))
        patches_BNE = patches_BNE + self.patch_bias[...].astype(c)[None, None]
        cls_B1E = jnp.broadcast_to(self.cls_token[...].astype(c), (b, 1, self.cfg.embed))
        h_BNE = jnp.concatenate([cls_B1E, patches_BNE], axis=1)
        h_BNE = h_BNE + self.pos_embedding[...].astype(c)[None]
        return constrain(h_BNE, "batch", "length", "embed")

    def head(self, h_BNE: jax.Array) -> jax.Array:
        dtype = self.policy.dtype_for("logits")
        cls_BE = self.final_norm(h_BNE)[:, 0].astype(dtype)
        logits_BK = cls_BE @ self.head_kernel[...].astype(dtype)
        return logits_BK + self.head_bias[...].astype(dtype)[None]

    def __call__(self, images_BHWC: jax.Array,
                 run_layers: LayerRunner | None = None) -> jax.Array:
        """Class logits (B, num_classes) for images (B, H, W, C)."""
        h_BNE = self.embed(images_BHWC)
        if run_layers is None:
            h_BNE = scan_layers(self.layers, h_BNE, None, self.cfg.remat)
        else:
            h_BNE = run_layers(self.layers, h_BNE, None)
        return self.head(h_BNE)


def classify_loss(model: ViT, batch: Mapping[str, jax.Array],
                  run_layers: LayerRunner | None = None) -> jax.Array:
    """Mean cross entropy of `model(batch['images'])` against integer `batch['labels']`."""
    images = constrain(batch["images"], "batch", None, None, None)
    logits_BK = model(images, run_layers=run_layers).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BK, batch["labels"]))



def eval_sums(model: ViT, batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Summed loss, correct predictions and count of one batch of images (masked rows, the
    padding of the last held-out batch, excluded)."""
    return masked_sums(model(batch["images"]), batch["labels"], batch.get("mask"))


def batch_spec(model_cfg: Mapping[str, Any], batch_size: int, seq_len: int,
               segments: bool) -> dict[str, jax.ShapeDtypeStruct]:
    """A training batch: float32 `images` (batch, size, size, channels) and int32 `labels`
    (whatever `seq_len` and `segments`: images have no sequence)."""
    cfg = ViTConfig.from_config(model_cfg)  # its defaults for what the config leaves out
    size = cfg.image_size
    return {"images": jax.ShapeDtypeStruct((batch_size, size, size, cfg.channels), jnp.float32),
            "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32)}


CLASSIFY = Task(classify_loss, eval_sums, batch_spec, unit="examples")


def vit_flops_per_token(num_layers: int, embed: int, heads: int, head_dim: int, mlp: int,
                        patch_size: int, channels: int, num_classes: int, tokens: int) -> float:
    """Training FLOPs per token of a ViT classifier (forward + backward), where `tokens` is the
    patches plus the class token of one image (`data.seq_len` of a ViT config).

    The same convention as the decoder's (`decoder/flops.flops_per_token`): 6 FLOPs per matmul
    parameter per token plus 12·L·H·Q·T for attention (bidirectional, so no causal saving to
    ignore). Per layer the matmul parameters are q/k/v/o (4·E·H·Q) and the two MLP matrices (2·E·F);
    the patch embedding (P²·C·E) runs once per patch and the classifier head (E·K) once per image,
    so both are spread over the image's tokens. Biases, norms and position embeddings are left out,
    as in the Llama count.
    """
    per_token = num_layers * (4 * embed * heads * head_dim + 2 * embed * mlp)
    per_image = (tokens - 1) * patch_size * patch_size * channels * embed + embed * num_classes
    return 6.0 * (per_token + per_image / tokens) + 12.0 * num_layers * heads * head_dim * tokens


def flops_per_token(m: Mapping[str, Any], seq_len: int) -> float:
    """`vit_flops_per_token` of a `config.model` section (`seq_len`: tokens per image)."""
    return vit_flops_per_token(m["num_layers"], m["embed"], m["num_heads"], m["head_dim"],
                               m["mlp"], m["patch_size"], m["channels"], m["num_classes"],
                               seq_len)
