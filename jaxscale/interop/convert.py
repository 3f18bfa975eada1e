"""Hugging Face directory <-> jaxscale workdir, behind `jaxscale convert`.

`hf_to_workdir` writes the converted parameters as a params export (`WORKDIR/params/`, the
checksummed format `config.init_from` reads first) plus `WORKDIR/model_config.json`, the
`config.model` fields the weights need, and the tokenizer files; `finetune_command` is the one
line that fine-tunes it. `workdir_to_hf` reads the newest weights of a workdir (a conversion
output, or a training workdir's newest restorable checkpoint) through
`weights.sources.open_weights`, folds LoRA adapters in, and writes the Hugging Face layout back
with the tokenizer files the weights came with. Model families are dispatched on HF `model_type` / jaxscale `model.name` through the model
table, as `interop.hf.load` / `hf.save` do (`weights.sources.open_huggingface`, `hf.save`).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxscale.errors import paragraph
from jaxscale.interop import hf
from jaxscale.models import entry_of, hf_saver
from jaxscale.storage import locations, workdir_files
from jaxscale.weights.sources import (
    MODEL_CONFIG,
    WeightsError,
    merged_params,
    open_huggingface,
    open_weights,
    recorded,
)


def check_output_dir(path: str, flag: str, overwrite: bool = False) -> None:
    """An output directory must be new or empty (its files would be replaced without a word),
    unless `overwrite` (`--overwrite`, as `prepare-data` has it); never a regular file, nor
    below one."""
    if locations.is_remote(path):  # gs:// / s3:// prefixes: no files in the way of a prefix
        if not overwrite and any(workdir_files.read_bytes(locations.join(path, name))
                                 is not None for name in (MODEL_CONFIG, "config.json")):
            raise hf.ConversionError(paragraph(
                f"{flag}={path} already holds a model (config.json or {MODEL_CONFIG}); it is",
                "not replaced unless you pass --overwrite. Give a new prefix, or add",
                "--overwrite to replace it. Nothing was written."))
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise hf.ConversionError(paragraph(
            f"{flag}={path} names an existing file, not a directory. Give a new or existing",
            "directory path for the output (the file is left untouched).",
        ))
    check_not_empty(path, flag, overwrite)
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    target = path if os.path.isdir(path) else parent
    if not os.path.isdir(parent) or not os.access(target, os.W_OK | os.X_OK):
        why = ("a regular file" if not os.path.isdir(parent) else
               "not writable (a read-only filesystem, or no permission)")
        raise hf.ConversionError(paragraph(
            f"{flag}={path} cannot be written: {target} is {why}. Give a writable directory",
            "path. Nothing was written."))


def check_not_empty(path: str, flag: str, overwrite: bool = False) -> None:
    """Refuses a local output directory that holds files, unless `overwrite` (`--overwrite`):
    converting into it would replace a model's files without a word."""
    entries = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if entries and not overwrite:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3
                                          else "")
        raise hf.ConversionError(paragraph(
            f"{flag}={path} is not empty (it holds {shown}); converting into it would replace",
            "those files. Give a new or empty directory, or add --overwrite to replace them.",
            "Nothing was written."))


def hf_to_workdir(hf_dir: str, workdir: str, dtype: Any = None, overwrite: bool = False,
                  mtp: bool = False) -> dict:
    """Converts a HF checkpoint directory leaf by leaf; returns the model config written. A
    non-empty `workdir` is refused unless `overwrite`; `mtp`: DeepSeek-V3's
    multi-token-prediction layer too (`hf_deepseek.py`)."""
    from jaxscale.weights.init_from import export_params

    local_only(hf_dir, "--from_hf")
    check_output_dir(workdir, "--out", overwrite)
    source = open_huggingface(hf_dir, **({"mtp": True} if mtp else {}))
    source.check_tensors(finite=True)  # every name, shape and value, before anything is written
    params = source.lazy_leaves(hf.parse_dtype(dtype) or np.dtype(np.float32))
    if not locations.is_remote(workdir):
        try:
            os.makedirs(workdir, exist_ok=True)
        except OSError as e:
            raise hf.ConversionError(paragraph(
                f"--out={workdir} cannot be created ({e.strerror or e}): a read-only",
                "filesystem, a path below a regular file, or no permission. Give a writable",
                "directory path.")) from None
    export_params(workdir, params, {"source": os.path.abspath(hf_dir)})
    workdir_files.write_text(locations.join(workdir, MODEL_CONFIG),
                             json.dumps(source.model_cfg, indent=2))
    copy_tokenizer(hf_dir, workdir)  # the converted model carries its tokenizer
    return source.model_cfg


def copy_tokenizer(spec: str | None, out_dir: str) -> list[str]:
    """Copies the tokenizer files (`tokenizer.json` / `.model`, `tokenizer_config.json` with
    its chat template, `special_tokens_map.json`) of a tokenizer location (a directory, or a
    tokenizer file's directory; local or a bucket) into `out_dir`; returns the names copied."""
    from jaxscale.data.tokenizer import TOKENIZER_FILES

    if not spec or spec == "bytes":
        return []
    spec = str(spec).rstrip("/")
    directory = spec.rsplit("/", 1)[0] if spec.endswith((".json", ".model")) else spec
    copied = []
    for name in TOKENIZER_FILES:
        data = workdir_files.read_bytes(locations.join(directory, name))
        if data is not None:
            workdir_files.write_bytes(locations.join(out_dir, name), data)
            copied.append(name)
    return copied


def local_only(path: str, flag: str) -> None:
    """Hugging Face directories are read and written with local file APIs (safetensors maps
    files): a bucket URL there is one paragraph, not an open() traceback."""
    if "://" in str(path) and locations.parse(path).scheme != "file":
        raise hf.ConversionError(paragraph(
            f"{flag}={path} is a bucket URL; Hugging Face model directories must be local.",
            "Copy it first (`gcloud storage cp -r` / `aws s3 cp --recursive`); the jaxscale side",
            "(--out, --from_workdir, --config.init_from) may be gs:// or s3://."))


def read_model_config(workdir: str, flag: str = "--from_workdir") -> tuple[dict, Any]:
    """(config.model fields, config.lora or None) of a conversion output or training workdir;
    `flag`: the command's flag that named `workdir`, for the error."""
    model = workdir_files.read_json(locations.join(workdir, MODEL_CONFIG))
    if model is not None:
        return model, None
    config = workdir_files.read_json(locations.join(workdir, "config.json"))
    if config is None:
        raise hf.ConversionError(paragraph(
            f"{flag}={workdir} has neither {MODEL_CONFIG} (written by `jaxscale convert",
            "--from_hf`) nor config.json (written by `jaxscale train`), so the model's shape is",
            f"unknown. Point {flag} at one of those.",
        ))
    return config["model"], config.get("lora")


def workdir_params(workdir: str, lora_cfg: Mapping | None = None) -> dict:
    """Newest parameters of a workdir as a nested dict, LoRA adapters folded in."""
    weights = open_weights(workdir)
    if lora_cfg is not None:
        weights.lora_cfg = dict(lora_cfg)
    try:
        return merged_params(weights)
    except WeightsError as e:
        raise hf.ConversionError(str(e)) from None


def workdir_to_hf(workdir: str, out_dir: str, dtype: Any = None,
                  max_shard_size: int | str | None = None, overwrite: bool = False,
                  mtp: bool = False) -> str:
    """Writes a workdir's newest weights in the HF layout (sharded past `max_shard_size`); a
    non-empty `out_dir` is refused unless `overwrite`; `mtp`: a DeepSeek-V3 model's
    multi-token-prediction module too (`hf.save`)."""
    local_only(out_dir, "--to_hf")
    if not locations.is_remote(workdir) and os.path.realpath(out_dir) == os.path.realpath(
            workdir):
        raise hf.ConversionError(paragraph(
            f"--to_hf={out_dir} is the --from_workdir itself: its config.json would be replaced",
            "by the Hugging Face one. Give another directory for the export."))
    check_output_dir(out_dir, "--to_hf", overwrite)
    model_cfg, lora_cfg = read_model_config(workdir)
    hf_saver(model_cfg)  # a family without an exporter, or an unsupported dtype, fails
    hf.parse_dtype(dtype)  # before any weights are read
    out = hf.save((model_cfg, workdir_params(workdir, lora_cfg)), out_dir, dtype=dtype,
                  max_shard_size=max_shard_size, mtp=mtp)
    copy_tokenizer(recorded(workdir).tokenizer, out)  # and its chat template: as it came in
    return out


def workdir_to_peft(workdir: str, out_dir: str, dtype: Any = None, base_model: str | None = None,
                    overwrite: bool = False) -> tuple[str, str | None]:
    """Writes a LoRA run's newest adapters as a PEFT adapter directory (`interop/peft.py`):
    (the directory, the `base_model_name_or_path` recorded: `base_model`, else the run's
    Hugging Face `init_from`, or the directory a conversion it started from was made of)."""
    from jaxscale.interop import peft
    from jaxscale.models.adapters import lora

    local_only(out_dir, "--to_peft")
    if os.path.realpath(out_dir) == os.path.realpath(workdir):
        raise hf.ConversionError(paragraph(
            f"--to_peft={out_dir} is the --from_workdir itself: the adapter's files would lie",
            "among the run's. Give another directory for the adapter."))
    peft.check_empty(out_dir, overwrite)
    check_output_dir(out_dir, "--to_peft", overwrite=True)  # a regular file on its path
    model_cfg, lora_cfg = read_model_config(workdir)
    if not lora_cfg or not lora_cfg.get("rank"):
        raise hf.ConversionError(paragraph(
            f"--from_workdir={workdir} is not a LoRA run (it records no lora.rank: a conversion",
            "output or a full fine-tune), so it has no adapters to write as PEFT. Export the",
            "whole model with --to_hf instead."))
    hf_saver(model_cfg)  # a family without an exporter fails before any weights are read
    hf.parse_dtype(dtype)
    weights = open_weights(workdir)
    adapters = {k: np.asarray(v) for k, v in weights.leaves.items() if lora.is_adapter(k)}
    shapes = {k: tuple(v.shape) for k, v in weights.leaves.items()}
    base = base_model or peft_base(recorded(workdir).run or {})
    peft.write_adapter(model_cfg, lora_cfg, adapters, shapes, out_dir, base,
                       hf.parse_dtype(dtype))
    copy_tokenizer(recorded(workdir).tokenizer, out_dir)
    return out_dir, base


def peft_base(run: Mapping[str, Any]) -> str | None:
    """The Hugging Face model a LoRA run's adapters sit on: its `init_from` when that is a
    Hugging Face directory, or the directory a `launch.convert` output was converted from
    (recorded in its params export); None when the base is not a Hugging Face model."""
    from jaxscale.weights import snapshot
    from jaxscale.weights.kv import Store
    from jaxscale.weights.manifest import StoreError

    init_from = run.get("init_from") or ""
    if not init_from:
        return None
    if workdir_files.read_json(locations.join(init_from, MODEL_CONFIG)) is not None:
        try:
            source = snapshot.load_snapshot(Store(init_from), snapshot.PARAMS).manifest.get(
                "source")
        except StoreError:  # an unreadable export records no source
            source = None
        return source if source and os.path.isdir(source) else None
    config = workdir_files.read_json(locations.join(init_from, "config.json"))
    is_run = isinstance(config, dict) and isinstance(config.get("model"), dict)
    return os.path.abspath(init_from) if config is not None and not is_run else None


def finetune_command(out: str, model_cfg: Mapping[str, Any]) -> str:
    """The one line that fine-tunes a conversion output: its model and tokenizer come with the
    weights (`weights/resolve.py`), so a language model needs only its data; another task's
    model (a ViT) goes with the user's config, which takes its model from the weights."""
    where = shlex.quote(str(out))
    config, flags = entry_of(model_cfg).task(None).finetune
    return f"jaxscale train --config={config} --workdir=RUN --config.init_from={where} {flags}"
