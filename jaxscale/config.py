"""The experiment config: every field with its default, and validation before anything compiles.

Config files in `configs/` start from `base_config()` and change what they need. ml_collections
locks the dict, so a typo'd override (`--config.train.stepz=3`) fails at parse time and a value
of the wrong type is rejected (`jaxscale.cli` words both as one paragraph). `validate` then
checks the same for the config file itself (`check_fields`: it may only change existing fields,
keeping their types), names that would fail deep inside the build (precision, optimizer, remat,
rules preset), and values and cross-field consistency, all before anything compiles.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import ml_collections as mlc

from jaxscale.config_fields import as_field, check_group
from jaxscale.errors import ConfigError, paragraph
from jaxscale.mesh import MESH_AXES
from jaxscale.rules import PRESETS, check_mesh_use
from jaxscale.storage import locations as storage
from jaxscale.storage import workdir_files
from jaxscale.storage.diskfull import naming_a_full_disk

LOFI_SYNC_MODES = ("end", "periodic", "diloco")  # config.lofi.sync

# The default rules are the `fsdp_tp` preset (jaxscale/rules.py): a batch sharded over
# data+fsdp, FSDP on the embed dimension of weights (falling back to mlp/vocab), tensor
# parallelism over heads, kv and mlp, and the stacked layer dimension over pipeline stages (free
# when mesh.pipeline is 1). Every mesh shape works with them.
DEFAULT_RULES: list[tuple[str, Any]] = PRESETS["fsdp_tp"]


def base_config() -> mlc.ConfigDict:
    c = mlc.ConfigDict()
    c.seed = 0
    c.init_from = ""
    # True: `config.model` is a stand-in that `init_from` replaces with the model its weights
    # record (fields of `jaxscale.weights.resolve.SAFE` may still be set by flags); False: the
    # config names its model, and weights that contradict it are refused (`weights/resolve.py`).
    c.model_from_weights = False
    c.mesh = mlc.ConfigDict(dict(data=-1, pipeline=1, fsdp=1, tensor=1,
                                 dcn_data=1, dcn_pipeline=1, dcn_fsdp=1, dcn_tensor=1,
                                 context=1, dcn_context=1,  # context: sequence shards
                                 expert=1, dcn_expert=1))  # expert: MoE experts (models/moe/)
    c.rules = [tuple(r) for r in DEFAULT_RULES]
    c.rules_preset = ""  # a name in jaxscale.rules.PRESETS replaces `rules` (dp, fsdp, pp, ...)
    c.rules_strict = False
    c.rules_indivisible = "error"
    c.precision = "32-true"
    # 16-mixed only: dynamic loss scaling (see precision.DynamicLossScale).
    c.loss_scale = mlc.ConfigDict(dict(init=2.0 ** 15, growth_interval=2000, min_scale=1.0,
                                       max_skips_at_min=20))
    # LoRA: rank 0 = off; targets are regular expressions searched in '/'-joined parameter paths.
    c.lora = mlc.ConfigDict(dict(rank=0, alpha=16.0, targets=("attn/w[qv]$",), dropout=0.0,
                                 save_adapters_only=True))
    c.model = mlc.ConfigDict(dict(
        name="llama", vocab_size=256, embed=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=32, mlp=512, max_len=2048, rope_theta=10000.0, norm_eps=1e-5,
        tie_embeddings=False, remat="none",
        attention_kind="grouped_query",  # the attention component (models/attention/kinds.py)
        attention="einsum",  # its kernel: einsum | dot_product_attention | splash
        context_attention="allgather",  # across sequence shards (mesh.context > 1): ring, ring_vjp
        context_order="auto",  # training sequence over its shards: auto | zigzag | natural
        loss_chunks=0,  # LM head + loss in this many chunks (less memory); 0: automatic (lm_task)
        # rotary scaling as HF `rope_scaling` (none | linear | llama3 | yarn), see
        # models/nn/rope.py; the beta / mscale / truncate / attention_factor fields are yarn's
        rope_scaling="none", rope_factor=1.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_len=8192, rope_beta_fast=32.0,
        rope_beta_slow=1.0, rope_mscale=0.0, rope_mscale_all_dim=0.0, rope_truncate=True,
        rope_attention_factor=0.0,
        sliding_window=0,  # > 0: attend to that many latest positions only (Mistral)
        # Gemma's local/global pattern: per layer "sliding_attention" (the window, rotary base
        # rope_local_theta when > 0) or "full_attention"; () every layer alike
        # (models/decoder/gemma.py)
        layer_types=(), rope_local_theta=0.0,
        query_pre_attn_scalar=0.0,  # attention scores times 1/sqrt(this); 0: head_dim (Gemma)
        attn_softcap=0.0, final_softcap=0.0,  # > 0: cap * tanh(x / cap) (Gemma 2); einsum or splash
        mtp_depth=0, mtp_loss_weight=0.3,  # DeepSeek-V3's multi-token prediction (decoder/mtp.py)
        # mixture of experts in place of the dense MLP when num_experts > 0 (models/moe/layer.py):
        # capacity_factor 0 = dropless; every = MoE on every n-th layer, dense MLPs between
        # router: models/moe/routers.py's ROUTERS
        moe=mlc.ConfigDict(dict(num_experts=0, router="softmax_topk", experts_per_token=2,
                                norm_topk_prob=True, mlp=0, shared_experts=0, capacity_factor=0.0,
                                router_aux_loss_coef=0.01, router_z_loss_coef=0.0, every=1,
                                grouped_matmul="auto", dispatch="auto",
                                # GPT-OSS: router / expert biases, clamped SwiGLU (limit > 0)
                                router_bias=False, expert_bias=False, swiglu_limit=0.0,
                                swiglu_alpha=1.702,
                                # DeepSeek-V3's routing (router=sigmoid_group, routers.py)
                                n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                bias_update_rate=0.0, first_k_dense_replace=0,
                                aux_per_sequence=False)),
        # multi-head latent attention's widths (attention_kind=latent; models/attention/latent.py)
        mla=mlc.ConfigDict(dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                                qk_nope_head_dim=128, v_head_dim=128))))
    c.data = mlc.ConfigDict(dict(
        corpus="stdlib",           # stdlib | digits | files (implied by a non-empty `sources`)
        max_bytes=4_000_000, seq_len=128, batch_size=32, eval_batches=4, part="all",
        sources="",                # 'FORMAT=GLOB[@WEIGHT];...', formats text|jsonl|parquet|chat|preference|array_record|tokens
        eval_sources="",           # held-out sources; empty: a stable-hash eval_fraction of documents
        eval_fraction=0.05,
        tokenizer="bytes",         # bytes | path to tokenizer.json (or a dir holding one) | .model
        text_field="text",         # the text field of jsonl records / parquet rows
        token_dtype="uint16",      # element type of `tokens` files
        packing="concat",          # concat | pack (first-fit, segment ids) | none (one doc per row)
        skip_bad_records=False,    # skip and count bad jsonl / parquet records instead of failing
        index_cache="",            # directory keeping each process's text/jsonl/parquet length index
        chat_template="",          # chat / preference: a Jinja template file; '': the tokenizer's own
        train_on="assistant",      # chat: the loss counts assistant tokens | all tokens
        # A resume onto another process count with a source whose position is per process
        # (`Dataset.elastic=False`) is refused; True restarts that source's position instead.
        restart_position_on_resize=False,
    ))
    # The training objective (jaxscale/objectives/): lm (the model's own task; chat data trains
    # on its loss mask), or a preference objective on preference pairs: dpo (beta,
    # label_smoothing), ipo (beta), simpo (beta, gamma; no reference). sft_weight adds the
    # chosen response's NLL. reference: "init" (the weights training starts from; with LoRA the
    # base with the adapters off) or a jaxscale checkpoint / Hugging Face directory.
    # grpo (prompts=GLOB data; docs/rl.md): rewards "module:function[@weight],...",
    # num_generations per prompt, max_new_tokens, the sampling (temperature, top_p, top_k),
    # beta (KL to the reference, k3; 0: none held), epsilon / epsilon_high (clip, DAPO's
    # clip-higher), updates_per_rollout, loss_norm (token | sequence | constant),
    # scale_rewards (group | batch | none), ratio_level (token | sequence: GSPO).
    c.objective = mlc.ConfigDict(dict(
        name="lm", beta=0.1, label_smoothing=0.0, gamma=0.5, sft_weight=0.0, reference="init",
        rewards="", num_generations=4, max_new_tokens=32, temperature=1.0, top_p=1.0, top_k=0,
        epsilon=0.2, epsilon_high=0.2, updates_per_rollout=1, loss_norm="sequence",
        scale_rewards="group", ratio_level="token"))
    c.optim = mlc.ConfigDict(dict(name="adamw", lr=3e-3, warmup_steps=20, min_lr_ratio=0.1,
                                  weight_decay=0.01, b1=0.9, b2=0.95, eps=1e-8,
                                  clip_norm=1.0, momentum=0.9, nesterov=False,
                                  offload_state=False))  # optimizer state in host memory
    c.train = mlc.ConfigDict(dict(
        steps=200, log_every=10, eval_every=100, grad_accum=1, skip_nonfinite=False,
        loggers=("jsonl", "tensorboard"),  # names in jaxscale.observe.loggers.LOGGERS (+ "wandb")
        # jax.profiler trace of num_steps steps from start_step into WORKDIR/profile (0: off);
        # host_tracing: host tracer level 0-3; all_processes: every process, not only process 0.
        profile=dict(start_step=3, num_steps=0, host_tracing=2, all_processes=False)))
    c.pipeline = mlc.ConfigDict(dict(microbatches=1, repeats=1, schedule="gpipe"))
    # every: steps between saves (0: none); every_minutes: minutes of training between saves
    # (0: none; either interval triggers a save, and the timer restarts at every save).
    # local_dir: a fast per-host tier ("{process}": the process index) saved every local_every
    # steps / local_every_minutes, keeping local_keep (jaxscale/train/local_tier.py).
    c.checkpoint = mlc.ConfigDict(dict(every=0, keep=3, every_minutes=0.0, local_dir="",
                                       local_every=0, local_every_minutes=0.0, local_keep=2))
    # Object stores (jaxscale/storage/locations.py): empty = AWS_ENDPOINT_URL_S3 / AWS_REGION / AWS.
    # Credentials never go here: they come from the standard AWS / Google credential chains.
    c.storage = mlc.ConfigDict(dict(s3_endpoint="", s3_region="", timeout_s=30.0,
                                     retry_s=300.0))
    c.lofi = mlc.ConfigDict(dict(
        enabled=False,
        store="",                  # local path, file://, gs://bucket/prefix, s3://..., memory://
        worker_id=0,
        num_workers=1,
        push_every="100",          # steps ("100") or minutes ("30m")
        sync="end",                # end | periodic | diloco
        sync_every=100,            # H: steps between averages for periodic / diloco
        reset_optimizer_on_sync=False,
        push_ema=0.0,              # > 0: push an EMA of the weights with this decay
        allowed_workers="",        # comma-separated ids; empty = 0..num_workers-1
        min_workers=1,             # quorum for a round
        max_staleness=0,           # rounds behind the base average; 0 = no limit
        compress=False,            # push 8-bit block-quantized deltas from the last average
        sync_timeout_s=600.0,      # how long a worker waits for an average at a sync point
    ))
    return c


def _require(ok: bool, *sentences: str) -> None:
    if not ok:
        raise ConfigError(paragraph(*sentences))


def validate(c: mlc.ConfigDict) -> None:
    """Checks fields, values and cross-field consistency; raises one-paragraph ConfigErrors.

    Each subsystem below the config checks its own section (the model table its `model`, storage
    its `storage`, the observers their `train.loggers` / `train.profile`); what is left here is
    the sections of the layers above (train, checkpoint, Lo-Fi) and what crosses sections."""
    from jaxscale.models import check_model  # lazy: importing the models pulls in jax
    from jaxscale.precision import check_quantized

    check_fields(c)
    d, t = c.data, c.train
    # The model's own fields, and against the mesh: sequence shards, experts, stages.
    check_model(c.model, d.seq_len, c.mesh, c.pipeline.get("repeats", 1))
    check_quantized(c.precision, c.model, c.lora)  # int8: what it cannot quantize is refused
    rate = (c.model.get("moe") or {}).get("bias_update_rate", 0.0)
    _require(not (rate and c.lora.rank and c.lora.save_adapters_only),
             f"model.moe.bias_update_rate={rate} moves the routers' balancing bias, a frozen",
             "parameter, while lora.save_adapters_only=True saves the adapters alone: a resumed",
             "run would lose the bias's moves. Set model.moe.bias_update_rate=0 (the bias fixed,",
             "as fine-tuning usually keeps it) or lora.save_adapters_only=False.")
    for name, value in (("steps", t.steps), ("log_every", t.log_every)):
        _require(value > 0, f"train.{name}={value}: it must be positive (e.g. "
                            f"--config.train.{name}={100 if name == 'steps' else 10}).")
    micro = c.pipeline.microbatches
    for name, value in (("train.grad_accum", t.grad_accum), ("pipeline.microbatches", micro)):
        _require(value >= 1, f"{name}={value}: it must be at least 1 (1: the whole batch at",
                 f"once; e.g. --config.{name}=4 splits it into 4 parts).")
    _require(d.batch_size % t.grad_accum == 0,
             f"data.batch_size={d.batch_size} must be divisible by train.grad_accum="
             f"{t.grad_accum}: each accumulation step takes batch_size/grad_accum rows.")
    _require((d.batch_size // t.grad_accum) % micro == 0,
             f"The per-step batch {d.batch_size // t.grad_accum} is not divisible by "
             f"pipeline.microbatches={micro}; choose a batch that the microbatches divide.")
    _require(c.rules_indivisible in ("error", "replicate"),
             f"rules_indivisible={c.rules_indivisible!r}: use 'error' or 'replicate'.")
    _validate_train_extras(t)
    _validate_lofi(c.lofi)
    storage.check_settings(c.get("storage", {}))
    _require(d.part in ("all", "a", "b"),
             f"data.part={d.part!r}: use 'all', or 'a'/'b' for the two disjoint halves.")
    _validate_choices(c)
    sizes = {axis: max(c.mesh.get(axis, 1), 1) * c.mesh.get(f"dcn_{axis}", 1)
             for axis in MESH_AXES}
    check_mesh_use(PRESETS[c.rules_preset] if c.rules_preset else c.rules, sizes, c.rules_preset)
    _validate_objective(c)


def _validate_objective(c: mlc.ConfigDict) -> None:
    """The objective against its own fields, the model, the data's kind and the schedule."""
    from jaxscale.data.mixture import configured_kind  # lazy: keeps `import config` light
    from jaxscale.objectives import check_objective

    check_objective(c, configured_kind(c.data) if c.data.get("sources") else "text")


def _validate_choices(c: mlc.ConfigDict) -> None:
    """Names that would otherwise only fail deep inside the optimizer or the rules."""
    from jaxscale.optim import OPTIMIZERS
    from jaxscale.optim import check_settings as check_optim_settings
    from jaxscale.precision import get_policy  # lazy: keeps `import config` light

    m, d = c.model, c.data
    get_policy(c.precision)  # raises a ConfigError listing the valid policies
    _require(c.rules_preset in ("", *PRESETS),
             f"rules_preset={c.rules_preset!r}: use one of {', '.join(PRESETS)} (see",
             "jaxscale/rules.py), or '' to use config.rules.")
    _require(c.optim.name in OPTIMIZERS,
             f"optim.name={c.optim.name!r}: use one of {', '.join(OPTIMIZERS)}.")
    check_optim_settings(c.optim)
    chunks = m.get("loss_chunks", 0) or 1  # the automatic choice always divides
    stages = c.mesh.pipeline
    if c.pipeline.schedule == "1f1b" and stages > 1:  # the head's positions split over stages
        _require(d.seq_len % stages == 0,
                 f"pipeline.schedule='1f1b' splits the LM head's data.seq_len={d.seq_len}",
                 f"positions over the mesh.pipeline={stages} stages (so that the head is",
                 "computed once, not once per stage), which needs a sequence length divisible",
                 "by the stage count. Use such a data.seq_len, or --config.pipeline.schedule=gpipe.")
        _require((d.seq_len // stages) % chunks == 0,
                 f"model.loss_chunks={chunks} must divide the {d.seq_len // stages} positions",
                 f"each of the mesh.pipeline={stages} stages computes the 1F1B head for",
                 f"(data.seq_len={d.seq_len} / {stages}). Use fewer loss chunks (a divisor of",
                 f"{d.seq_len // stages}) or a longer sequence.")
    _require(d.seq_len > 0 and d.batch_size > 0,
             f"data.seq_len={d.seq_len} and data.batch_size={d.batch_size} must be positive.")
    if d.get("sources") or d.corpus == "files":
        from jaxscale.data.mixture import validate_files
        validate_files(c)
    elif d.corpus == "stdlib" and "vocab_size" in m:
        _require(m.vocab_size >= BYTE_VOCAB,
                 f"model.vocab_size={m.vocab_size} is smaller than the {BYTE_VOCAB} byte tokens",
                 f"of data.corpus='stdlib'; use a vocab_size of at least {BYTE_VOCAB}.")
    _require(c.checkpoint.every >= 0 and c.checkpoint.keep >= 1,
             f"checkpoint.every={c.checkpoint.every} must be >= 0 (0: no checkpoints) and",
             f"checkpoint.keep={c.checkpoint.keep} >= 1.")
    _validate_checkpoint(c.checkpoint)
    path = c.init_from
    _require(not path or "://" in path or os.path.exists(path),
             f"config.init_from={path!r} does not exist. Point it at a Hugging Face model",
             "directory, a `launch.convert` output, a training workdir, a params export or a Lo-Fi",
             "store (remote stores as URLs).")


def _validate_checkpoint(k: mlc.ConfigDict) -> None:
    """The time intervals and the local tier (`checkpoint.local_*`)."""
    for name in ("every_minutes", "local_every_minutes"):
        minutes = k.get(name, 0.0)
        _require(math.isfinite(minutes) and minutes >= 0,
                 f"checkpoint.{name}={minutes} must be a finite number >= 0 (0: no time-based",
                 "saves); e.g. 30 saves after every 30 minutes of training.")
    local, every, minutes = k.get("local_dir", ""), k.get("local_every", 0), k.get(
        "local_every_minutes", 0.0)
    _require(every >= 0 and k.get("local_keep", 2) >= 1,
             f"checkpoint.local_every={every} must be >= 0 and checkpoint.local_keep="
             f"{k.get('local_keep', 2)} >= 1.")
    _require(bool(local) == bool(every or minutes),
             f"checkpoint.local_dir={local!r} with local_every={every} and local_every_minutes=",
             f"{minutes}: the local tier needs both a directory and an interval. Set",
             "checkpoint.local_dir to a fast per-host path (it may contain {process}) and",
             "checkpoint.local_every (steps) or local_every_minutes, or none of them.")
    stray = local.replace("{process}", "")
    _require("{" not in stray and "}" not in stray,
             f"checkpoint.local_dir={local!r} holds braces other than {{process}}, the one",
             "field replaced (by the process index, e.g. /ssd/tier-{process}); others would name",
             "a directory literally. Spell it {process} or remove the braces.")
    _require("://" not in local,
             f"checkpoint.local_dir={local!r} is a URL: the local tier is a path on each host's",
             "own disk (local SSD or RAM disk); persistent checkpoints go to the workdir, which",
             "may be a bucket (checkpoint.every).")


BYTE_VOCAB = 256  # the stdlib corpus is byte-level: token ids 0..255
# Fields every model config carries besides its dataclass's: which model, which task.
MODEL_COMMON = dict(name="llama", task="lm")
# How a required field without a value (an ml_collections placeholder) is explained.
_REQUIRED_HINTS = {"init_from": "a Hugging Face model directory, a `launch.convert` output, a "
                                 "training workdir or a params export"}


def check_fields(c: mlc.ConfigDict) -> None:
    """Every field known and of the right type, against `base_config()` and the model's dataclass.

    Command-line overrides are checked by ml_collections at parse time; this catches the same
    mistakes made inside a config file (`c.train.stepz = 3` silently adds a field) or in a config
    built in Python, before anything is built.
    """
    reference = base_config()
    from jaxscale.models import lookup  # lazy: importing the models pulls in jax
    config_cls, _ = lookup(c.model.get("name", "llama"))
    reference.model = mlc.ConfigDict({**MODEL_COMMON, **{
        k: as_field(f.default) for k, f in config_cls.__dataclass_fields__.items()}})
    check_group(c, reference, "config", "config.model", _REQUIRED_HINTS)


def _validate_train_extras(t: mlc.ConfigDict) -> None:
    """The loggers by name, and the profiled step range."""
    from jaxscale.observe.loggers import check_names  # lazy: keeps `import config` light
    from jaxscale.observe.profiling import check_settings

    check_names(list(t.loggers))
    check_settings(t.profile)


def _validate_lofi(lofi: mlc.ConfigDict) -> None:
    if not lofi.enabled:
        return
    _require(bool(lofi.store), "lofi.enabled=True needs lofi.store, e.g. --config.lofi.store="
             "gs://bucket/run1 or a shared local directory.")
    _require(0 <= lofi.worker_id < lofi.num_workers,
             f"lofi.worker_id={lofi.worker_id} must be in [0, lofi.num_workers={lofi.num_workers}).")
    _require(lofi.sync in LOFI_SYNC_MODES,
             f"lofi.sync={lofi.sync!r}: use 'end' (one average at the end), 'periodic' "
             "(average every lofi.sync_every steps) or 'diloco' (periodic + outer optimizer).")
    text = str(lofi.push_every)
    _require(text.rstrip("m").isdigit() and int(text.rstrip("m")) > 0,
             f"lofi.push_every={text!r}: give a number of steps ('100') or minutes ('30m').")
    allowed = [w.strip() for w in str(lofi.allowed_workers).split(",") if w.strip()]
    _require(all(w.isdigit() for w in allowed),
             f"lofi.allowed_workers={lofi.allowed_workers!r}: give comma-separated worker ids "
             "('0,1,3'), or leave it empty to allow 0..num_workers-1.")
    _require(not allowed or str(lofi.worker_id) in allowed,
             f"lofi.worker_id={lofi.worker_id} is not in lofi.allowed_workers="
             f"{lofi.allowed_workers!r}: the averager would ignore every push of this worker.")
    _require(lofi.min_workers >= 1 and lofi.max_staleness >= 0 and lofi.sync_every >= 1,
             f"lofi.min_workers={lofi.min_workers} must be >= 1, lofi.max_staleness="
             f"{lofi.max_staleness} >= 0 (rounds; 0 = no limit), lofi.sync_every="
             f"{lofi.sync_every} >= 1.")
    _require(0.0 <= lofi.push_ema < 1.0,
             f"lofi.push_ema={lofi.push_ema}: use 0 (push the raw weights) or an EMA decay in "
             "(0, 1), e.g. 0.999.")


def check_workdir_path(workdir: str) -> None:
    """A local workdir must be a directory (or not exist yet): checked before a run writes
    anything into it (its event log, its config.json)."""
    if not storage.is_remote(workdir) and os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir={workdir} names an existing file, not a directory. Give "
                          "a new or existing directory path (the file is left untouched).")


def save_config(c: mlc.ConfigDict, workdir: str) -> str:
    """Writes the resolved config as JSON (tuples become lists) and returns its path; a
    gs:// or s3:// workdir gets it as one object."""
    if storage.is_remote(workdir):
        path = storage.join(workdir, "config.json")
        workdir_files.write_text(path, json.dumps(c.to_dict(), indent=2, sort_keys=True,
                                                  default=str))
        return path
    check_workdir_path(workdir)
    storage.make_local_dir(workdir, "--workdir")
    path = os.path.join(workdir, "config.json")
    with naming_a_full_disk(path), open(path, "w") as f:
        json.dump(c.to_dict(), f, indent=2, sort_keys=True, default=str)
    return path


def tokens_per_step(c: mlc.ConfigDict) -> int:
    return c.data.batch_size * c.data.seq_len


def is_power_of_two(n: int) -> bool:
    return n > 0 and math.log2(n).is_integer()
