"""Llama-style presets at about 125M, 1B and 7B parameters, sized for a hardware target.

    --config=configs/llama.py:SIZE[,TARGET]     e.g. :1b   :1b,v5e-16   :7b,h100x8   :tiny

SIZE (dims; RMSNorm, SwiGLU, RoPE, untied embeddings; params from `LlamaConfig.num_params()`):

    tiny   embed 64, 2 layers, 4 heads (2 kv), mlp 128, vocab 256: the small-run mode, a
           CPU run of seconds (`32-true`, 10 steps)                                 0.11M
    125m   embed 768, 12 layers, 12 heads, mlp 2048, vocab 32000 (GPT-3-Small-shaped)  134.1M
    1b     embed 2048, 16 layers, 32 heads (8 kv), mlp 8192, vocab 32000, rope 5e5
           (Llama-3.2-1B-like; its 128k vocabulary is smaller here)                  1,104.2M
    7b     embed 4096, 32 layers, 32 heads, mlp 11008, vocab 32000 (Llama-2-7B)      6,738.4M

TARGET (one slice or host; data-parallel across the `Nx` hosts of a multi-host target):

    v4-8, v4-32                 TPU v4, 4 / 16 chips (the suffix counts TensorCores)
    v5e-8, v5e-16, v5e-64, v5e-256   TPU v5e, that many chips
    h100x8, 2xh100x8            one / two hosts of 8 H100 GPUs (cuDNN fused attention)

(each chip's memory is the hardware table's, `jaxscale.hardware.CHIPS`)

A target sets the mesh, the rules preset, `bf16-mixed` precision, the attention kernel, and
the micro-batch and gradient accumulation: the global batch (sequences x seq_len) is a property
of the SIZE (125m: 256 x 1024, 1b: 256 x 2048, 7b: 512 x 2048), so results are comparable
across hardware, and the target only decides how many sequences a device processes at once.
125m is data-parallel (`dp`: its whole Adam state fits every device); tiny, 1b and 7b use FSDP
(`fsdp`) over the slice/host, and data parallelism across hosts (`mesh.dcn_data`). Attention
is cuDNN's fused kernel on GPUs and the Pallas splash kernel on TPUs (where the length suits
it), so no 125m, 1b or 7b target keeps the (T x T) scores in HBM. On TPU targets the
micro-batch is the TPU compiler's (`COMPILED`, printed by `python bench/presets.py`, which
compiles each SIZE,TARGET for the slice with libtpu, no TPU needed): the largest power of two
that leaves 10% of HBM free. On GPU targets it is the largest power of two whose estimate
(`memory_estimate`, the one memory model of `jaxscale.aot.memory`: the training state over the
FSDP shards, one gathered layer, and activations under the size's remat policy) stays under 80%
of a device's HBM; on TPU that estimate erred far on the safe side.
With accumulation, periodic evaluation is off (`train.eval_every=0`): the eval step runs the
whole global batch at once. Combinations that cannot work (7b on v4-8 and v5e-8: the
compiler needs more than their HBM for one sequence; tiny on v5e-256: 64-wide embed over 256
shards) are refused with the list of targets that do; `VARIANTS` lists those that work, and
`python configs/llama.py` prints each one's mesh, micro-batch, accumulation and memory.
Without a TARGET, sizes use all local devices (`data=-1` for 125m, `fsdp=-1` otherwise) and no
accumulation. Tensor parallelism is not needed at these sizes; for larger meshes try
`--config.rules_preset=fsdp_tp --config.mesh.tensor=4`.

Long context (`LONG_CONTEXT`, not in `VARIANTS`): `8b-128k,TARGET`, a Llama-3.1-8B shape at
131,072 tokens per sequence, 32 sequences a step, sized by the TPU compiler (bench/RESULTS.md):
a sequence per `context` chips (`ring_vjp` attention), FSDP over the rest. v5p-32: context 4 x
fsdp 4; v6e-128: context 8 x fsdp 16 (docs/long-context.md). v5e has none: its 16 GB need
fsdp=16 for the Adam state, and even context 16 on v5e-256 compiles to 15.44 GiB per chip, over
the 14.18 GiB the margin leaves (`hardware.HBM_MARGIN`); v6e-64 (context 4 x fsdp 16, 27.53 GiB
of the 28.12 it may fill) is not one; on v4-32 (16 chips of 32 GiB) the v5p-32 mesh would need
the 55.92 GiB per chip it compiles to there.

Data stays the byte-level stdlib corpus: bytes are token ids 0..255, a subset of the 32000-entry
vocabulary, so the initial loss is ln(32000) = 10.4 rather than ln(256). Every field can still be
overridden on the command line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_collections as mlc

from jaxscale.aot.memory import Dims, state_bytes_per_param, step_bytes
from jaxscale.config import base_config
from jaxscale.configs._preset_parts import Compiled, LongContext, Size, Target
from jaxscale.errors import ConfigError, paragraph
from jaxscale.hardware import HBM_MARGIN

_LLAMA2 = dict(vocab_size=32000, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
SIZES: dict[str, Size] = {
    "tiny": Size(dict(vocab_size=256, embed=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, mlp=128, max_len=256),
                 "fsdp", "none", seq_len=64, batch=16, lr=3e-3, warmup=2, steps=10,
                 precision="32-true", max_bytes=400_000),
    "125m": Size(dict(_LLAMA2, embed=768, num_layers=12, num_heads=12, num_kv_heads=12,
                      head_dim=64, mlp=2048, max_len=2048),
                 "dp", "none", seq_len=1024, batch=256, lr=6e-4, warmup=1000, steps=20_000),
    "1b": Size(dict(_LLAMA2, embed=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                    head_dim=64, mlp=8192, max_len=2048, rope_theta=500000.0),
               "fsdp", "full", seq_len=2048, batch=256, lr=3e-4, warmup=2000, steps=50_000),
    "7b": Size(dict(_LLAMA2, embed=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                    head_dim=128, mlp=11008, max_len=4096),
               "fsdp", "full", seq_len=2048, batch=512, lr=3e-4, warmup=2000, steps=100_000),
}
# The v4 suffix counts TensorCores (2 per chip), so v4-8 is 4 chips.
TARGETS: dict[str, Target] = {
    "v4-8": Target(4, 1, "v4", topology="v4:2x2x1"),
    "v4-32": Target(16, 1, "v4", topology="v4:2x2x4"),
    "v5e-8": Target(8, 1, "v5e", topology="v5e:2x4"),
    "v5e-16": Target(16, 1, "v5e", topology="v5e:4x4"),
    "v5e-64": Target(64, 1, "v5e", topology="v5e:8x8"),
    "v5e-256": Target(256, 1, "v5e", topology="v5e:16x16"),
    "h100x8": Target(8, 1, "h100"), "2xh100x8": Target(8, 2, "h100"),
}


# Printed by `python bench/presets.py` (libtpu 0.0.52); `python bench/presets.py --check`
# compiles every preset against it, `make test` the tightest of each size (tests/test_presets.py).
COMPILED: dict[tuple[str, str], Compiled] = {
    ("tiny", "v4-8"): Compiled(4, 0.00, (0.005211, 0.005806)),
    ("tiny", "v4-32"): Compiled(1, 0.00, (0.007359, 0.007508)),
    ("tiny", "v5e-8"): Compiled(2, 0.00, (0.00651, 0.006925)),
    ("tiny", "v5e-16"): Compiled(1, 0.00, (0.007359, 0.007567)),
    ("tiny", "v5e-64"): Compiled(1, 0.00, (0.01132, 0.01152)),
    ("125m", "v4-8"): Compiled(16, 15.54, (183.6, 191.6)),
    ("125m", "v4-32"): Compiled(16, 13.73, (45.89, 52.77)),
    ("125m", "v5e-8"): Compiled(8, 9.13, (128.1, 137.5)),
    ("125m", "v5e-16"): Compiled(8, 9.13, (64.06, 74.12)),
    ("125m", "v5e-64"): Compiled(4, 4.86, (16.02, 23.23)),
    ("125m", "v5e-256"): Compiled(1, 2.74, (7.302, 11.31)),
    ("1b", "v4-8"): Compiled(32, 19.10, (4154, 4257)),
    ("1b", "v4-32"): Compiled(16, 9.16, (1038, 1159)),
    ("1b", "v5e-8"): Compiled(16, 10.77, (2899, 3149)),
    ("1b", "v5e-16"): Compiled(16, 9.31, (1450, 1570)),
    ("1b", "v5e-64"): Compiled(4, 2.18, (362.4, 449.2)),
    ("1b", "v5e-256"): Compiled(1, 1.06, (90.6, 177.6)),
    ("7b", "v4-8"): Compiled(0, 35.30, (0, 0)),
    ("7b", "v4-32"): Compiled(16, 24.29, (12870, 14344)),
    ("7b", "v5e-8"): Compiled(0, 18.42, (0, 0)),
    ("7b", "v5e-16"): Compiled(4, 12.77, (17965, 23739)),
    ("7b", "v5e-64"): Compiled(8, 11.46, (4491, 5018)),
    ("7b", "v5e-256"): Compiled(2, 2.98, (1123, 1653)),
}
# bf16-mixed with Adam, counted as accumulating: the estimate comes before the micro-batch.
STATE_BYTES_PER_PARAM = state_bytes_per_param(accumulate=True)
HBM_FRACTION = 0.8          # headroom for XLA's own buffers, collectives and fragmentation


_LLAMA31_8B = dict(vocab_size=128256, embed=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, mlp=14336, max_len=131072, rope_theta=500000.0, norm_eps=1e-5,
                   tie_embeddings=False, rope_scaling="llama3", rope_factor=8.0,
                   rope_original_max_len=8192, attention="einsum", loss_chunks=16,
                   context_attention="ring_vjp", context_order="auto")
# `jaxscale compile --topology=TOPOLOGY --config=llama:8b-128k,TARGET` (libtpu 0.0.52,
# nothing runs), each target's topology: bench/RESULTS.md.
LONG_CONTEXT: dict[str, LongContext] = {
    "8b-128k": LongContext(
        Size(_LLAMA31_8B, "fsdp", "full", seq_len=131072, batch=32, lr=1e-5, warmup=50,
             steps=1000),
        {"v5p-32": (Target(16, 1, "v5p", topology="v5p:2x2x4"), 4,
                    Compiled(1, 55.92, (208754, 213731))),
         # v6e (31.24 GiB usable): fsdp=16 keeps the Adam state at 5.61 GiB per chip
         "v6e-128": (Target(128, 1, "v6e", topology="v6e:8x16"), 8,
                     Compiled(1, 19.03, (13047, 14994)))}),
}


def build_long(name: str, target_name: str) -> mlc.ConfigDict:
    """The long-context preset `name` on `target_name`: a sequence per `context` chips, FSDP
    over the rest, accumulation up to the size's global batch."""
    preset = LONG_CONTEXT[name]
    target, context, _ = preset.targets[target_name]
    c = build(name, None, sizes={name: preset.size})
    fsdp = target.devices // context
    c.mesh.update(data=1, fsdp=fsdp, context=context, dcn_data=target.slices)
    c.train.update(grad_accum=preset.size.batch // (fsdp * target.slices), eval_every=0)
    return c


def num_params(size: str, sizes: Mapping[str, Size] = SIZES) -> int:
    """SIZE's parameter count as its model table entry's config class has it (`model.name`:
    a Qwen2 counts its q/k/v biases, a Qwen3 its q/k norms)."""
    from jaxscale.models import entry_of  # lazy: loading a config stays light
    model = sizes[size].model
    return entry_of(model).config_cls.from_config(model).num_params()


def memory_estimate(size: str, target: Target, micro_batch: int,
                    sizes: Mapping[str, Size] = SIZES) -> int:
    """Estimated peak bytes per device (`jaxscale.aot.memory`, the planner's model too):
    sharded state, one gathered layer, activations under the size's remat policy. The float32
    attention scores vanish with fused attention (GPUs). `sizes`: the table SIZE is in
    (`configs/finetune_lm.py` passes its other families')."""
    s = sizes[size]
    dims = Dims.from_model(s.model, num_params(size, sizes))
    return int(step_bytes(dims, tokens=micro_batch * s.seq_len, seq_len=s.seq_len,
                          state_bytes=STATE_BYTES_PER_PARAM,
                          param_shards=target.devices if s.strategy == "fsdp" else 1,
                          remat=s.remat,
                          einsum_scores=not target.gpu or mixed_pattern(s.model)))


def mixed_pattern(model: Mapping[str, Any]) -> bool:
    """Does the model mix local and global layers (Gemma's `layer_types`)? Then each layer's
    window is a traced value that cuDNN's fused kernel cannot take (`models/decoder/config.py`
    `check_layer_pattern`): a GPU target keeps `model.attention=einsum` and its scores count
    (TPUs run splash, which picks its local or global kernel per layer)."""
    return len(set(model.get("layer_types") or ())) > 1


def micro_batch(size: str, target: str, sizes: Mapping[str, Size] = SIZES) -> int:
    """Sequences per device at once on TARGET: the TPU compiler's choice (`COMPILED`), else the
    largest power of two whose estimate fits, at most the device's share of the global batch
    (0: not even one fits)."""
    if (size, target) in COMPILED:
        return COMPILED[(size, target)].micro_batch
    t = TARGETS[target]
    limit = sizes[size].batch // min(t.total, sizes[size].batch)
    budget = HBM_FRACTION * t.hbm_gib * 2**30
    b = 1 << int(math.log2(limit))
    while b and memory_estimate(size, t, b, sizes) > budget:
        b //= 2
    return b


def why_not(size: str, target: str, sizes: Mapping[str, Size] = SIZES) -> str | None:
    """Why SIZE cannot train on TARGET (memory, or FSDP shards that do not divide), or None."""
    s, t = sizes[size], TARGETS[target]
    if s.strategy == "fsdp" and s.model["embed"] % t.devices:
        return (f"FSDP over its {t.devices} devices would split the {s.model['embed']}-wide embed "
                "dimension unevenly")
    if micro_batch(size, target, sizes) == 0:
        compiled = COMPILED.get((size, target))
        if compiled:
            return (f"its training state and one sequence need {compiled.gib:.1f} GiB per chip "
                    f"or more as the TPU compiler has it, over the {t.budget_gib:.1f} GiB it may "
                    f"fill ({HBM_MARGIN:.0%} of the HBM libtpu lets a program use kept free)")
        return (f"its training state and one sequence need about "
                f"{memory_estimate(size, t, 1, sizes) / 2**30:.0f} GiB per device, more than "
                f"{HBM_FRACTION:.0%} of the {t.hbm_gib:.0f} GiB of HBM")
    return None


def _fits(size: str, target: str) -> bool:
    return why_not(size, target) is None


VARIANTS: tuple[str, ...] = tuple(SIZES) + tuple(
    f"{s},{t}" for s in SIZES for t in TARGETS if _fits(s, t))


def parse_arg(arg: str | None) -> tuple[str, str | None]:
    """'1b,v5e-16' -> ('1b', 'v5e-16'); None / '' -> ('tiny', None). Raises on unknown names."""
    parts = [p.strip() for p in (arg or "tiny").split(",")]
    size, target = parts[0], (parts[1] if len(parts) > 1 else None)
    if size in LONG_CONTEXT:
        if len(parts) != 2 or target not in LONG_CONTEXT[size].targets:
            raise ConfigError(paragraph(
                f"configs/llama.py: the long-context preset {size} needs one of its targets:",
                f"{', '.join(f'{size},{t}' for t in LONG_CONTEXT[size].targets)}.",
            ))
        return size, target
    if size not in SIZES or len(parts) > 2 or (target is not None and target not in TARGETS):
        raise ConfigError(paragraph(
            f"configs/llama.py: cannot read the argument {arg!r}. Use SIZE or SIZE,TARGET",
            f"with SIZE in {', '.join(SIZES)} and TARGET in {', '.join(TARGETS)},",
            "e.g. --config=configs/llama.py:1b,v5e-16.",
        ))
    if target is not None and not _fits(size, target):
        fits = [t for t in TARGETS if _fits(size, t)]
        raise ConfigError(paragraph(
            f"configs/llama.py:{size},{target}: the {size} model does not fit {target}:",
            f"{why_not(size, target)}. Targets that fit {size}: {', '.join(fits)}.",
        ))
    return size, target


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    size, target = parse_arg(arg)
    return build_long(size, target) if size in LONG_CONTEXT else build(size, target)


def build(size_name: str, target_name: str | None = None, micro: int | None = None,
          sizes: Mapping[str, Size] = SIZES) -> mlc.ConfigDict:
    """The config of SIZE on TARGET with `micro` sequences per device at once (default: the
    target's `micro_batch`). Unchecked: `get_config` refuses combinations that do not fit;
    `bench/presets.py` calls this to find out which do; `configs/finetune_lm.py` with its
    other families' `sizes`."""
    s = sizes[size_name]
    c = base_config()
    c.model.update(s.model, remat=s.remat)
    c.precision = s.precision
    c.rules_preset = s.strategy
    c.data.update(seq_len=s.seq_len, batch_size=s.batch, max_bytes=s.max_bytes, eval_batches=4)
    c.optim.update(lr=s.lr, warmup_steps=s.warmup, min_lr_ratio=0.1, weight_decay=0.1)
    c.train.update(steps=s.steps, log_every=10, eval_every=1000)
    c.checkpoint.update(every=1000, keep=3)
    if s.strategy == "dp":
        c.mesh.update(data=-1, fsdp=1)
    else:
        c.mesh.update(data=1, fsdp=-1)
    if size_name == "tiny":  # the small-run mode: seconds on CPU, nothing written but metrics
        c.train.update(log_every=1, eval_every=5)
        c.checkpoint.every = 0
        c.data.eval_batches = 2
    if target_name is not None:
        _apply_target(c, size_name, target_name, micro, sizes)
    return c


def _apply_target(c: mlc.ConfigDict, size_name: str, target_name: str,
                  micro: int | None, sizes: Mapping[str, Size]) -> None:
    """What a hardware target sets: mesh, micro-batch and accumulation, precision, attention."""
    from jaxscale.models.attention.splash import block_size  # lazy: loading a config stays light

    s, t = sizes[size_name], TARGETS[target_name]
    b = micro_batch(size_name, target_name, sizes) if micro is None else micro
    batch = max(s.batch, t.total)
    axis = "data" if s.strategy == "dp" else "fsdp"
    c.mesh.update(data=1, fsdp=1, dcn_data=t.slices)
    c.mesh[axis] = t.devices
    c.data.batch_size = batch
    c.train.grad_accum = batch // (b * t.total)
    if c.train.grad_accum > 1:
        # The eval step runs the whole global batch in one forward pass (it does not
        # accumulate), i.e. grad_accum times a micro-batch's logits and attention scores:
        # off by default here; lower data.batch_size to evaluate.
        c.train.eval_every = 0
    c.precision = "bf16-mixed"
    # `COMPILED`'s micro-batches were sized with the LM head and loss whole: the presets keep
    # it so (not the automatic `model.loss_chunks=0`) until bench/presets.py re-sizes them.
    c.model.loss_chunks = 1
    if t.gpu:  # Gemma's mixed pattern: the einsum kernel (`mixed_pattern`)
        c.model.attention = "einsum" if mixed_pattern(s.model) else "dot_product_attention"
    elif block_size(s.seq_len) is not None:  # a length on the kernel's 128 grid
        # TPU: the Pallas splash kernel never holds the (B, H, T, T) float32 scores that
        # einsum keeps in HBM (bench/RESULTS.md compares their temporaries); the planner picks
        # it on every slice it was run for (bench/RESULTS.md).
        c.model.attention = "splash"


def plan_table() -> str:
    """One line per SIZE,TARGET: what the target sets, and the per-chip memory with its source:
    the TPU compiler's (`COMPILED`, with the step-time estimate) or the estimate's."""
    lines = []
    for v in VARIANTS:
        size, target = parse_arg(v)
        if target is None:
            continue
        c, t = get_config(v), TARGETS[target]
        b = micro_batch(size, target)
        mesh = " ".join(f"{k}={c.mesh[k]}" for k in ("data", "fsdp", "dcn_data") if c.mesh[k] > 1)
        compiled = COMPILED.get((size, target))
        ms = lambda x: f"{x:,.0f}" if x >= 10 else f"{x:.2g}"
        memory = (f"{compiled.gib:5.1f} of {t.hbm_gib:4.1f} GiB compiled, step "
                  f"{ms(compiled.step_ms[0])}..{ms(compiled.step_ms[1])} ms ESTIMATE"
                  if compiled else f"~{memory_estimate(size, t, b) / 2**30:5.1f} of "
                  f"{t.hbm_gib:4.1f} GiB estimated")
        lines.append(f"{v:<16} {c.rules_preset:<5} {mesh:<22} micro-batch {b:>2} x "
                     f"{c.train.grad_accum:>2} accumulation = {c.data.batch_size:>3} x "
                     f"{c.data.seq_len}  {memory}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(plan_table())
