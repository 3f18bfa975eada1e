"""`open_weights(location)`: the parameters saved anywhere jaxscale writes or reads them.

Recognised, in this order:
  * a training workdir (or its `checkpoints/` directory): the newest orbax checkpoint that
    restores (a truncated or corrupt newer one is skipped with one `BrokenCheckpointWarning`);
    LoRA runs saved adapters-only get their frozen base rebuilt from the run's config.json;
  * a params export, `DIR/params/` (`launch.convert --from_hf`, `launch.lofi_average
    --final=DIR`, `init_from.export_params`): checksummed zarr arrays + JSON manifest;
  * a Lo-Fi store: its newest published average;
  * a Hugging Face directory (config.json + safetensors) of a family with a Hugging Face
    converter in the model table.
Every format yields the same `Weights`: `{path: Leaf}` (shape and dtype up front, values read on
demand, so nothing is loaded whole unless asked) plus the `config.model` fields the weights were
made with when the location records them. No format executes code when read (no pickle).

`recorded(location)` is what a location says about its weights without reading any of them:
the model fields (`model_config.json` of a conversion, a run's or a Lo-Fi job's `config.json`,
a Hugging Face `config.json` through its family's converter, which reads only safetensors
headers), a run's LoRA section and the tokenizer that goes with the weights. `config.init_from`
takes the run's model and tokenizer from it (`weights/resolve.py`); `inspect`, `compile` and
`plan` read nothing else.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxscale.errors import ConversionError, JaxscaleError, paragraph
from jaxscale.models import hf_opener
from jaxscale.storage import locations, workdir_files
from jaxscale.weights import snapshot
from jaxscale.weights.kv import Store
from jaxscale.weights.leaf import Leaf
from jaxscale.weights.legacy import fuse_legacy_leaves
from jaxscale.weights.manifest import StoreError
from jaxscale.weights.tree import flatten, unflatten

MODEL_CONFIG = "model_config.json"  # config.model fields of a launch.convert output


class WeightsError(JaxscaleError):
    """A location holds no weights jaxscale can read."""


@dataclass
class Weights:
    """The parameters at `location`: {path: Leaf}, read on demand."""

    location: str
    kind: str                    # 'checkpoint' | 'params' | 'lofi_average' | 'huggingface'
    leaves: dict[str, Leaf]
    model_cfg: dict | None = None   # config.model fields the weights were made with, if known
    lora_cfg: dict | None = None    # config.lora of a training workdir, if any
    run_config: dict | None = None  # a training workdir's whole config.json
    step: int | None = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: leaf.shape for k, leaf in self.leaves.items()}

    def arrays(self) -> dict[str, np.ndarray]:
        """Every leaf read to the host (small models, tests, LoRA folding)."""
        return {k: np.asarray(leaf) for k, leaf in self.leaves.items()}


def open_weights(location: str) -> Weights:
    """The weights at `location` (see the module docstring for what is recognised)."""
    location = str(location)
    locations.parse(location)  # an unsupported scheme is one paragraph, not an fsspec error
    if _is_dir(locations.join(location, "checkpoints")) or _is_checkpoint_dir(location):
        return _with_configs(_checkpoint_weights(location), location)
    if os.path.isfile(location):
        raise WeightsError(paragraph(
            f"{location!r} is a file, not a directory of weights. Point at a training workdir,",
            "a `launch.convert` output, a `launch.lofi_average --final=DIR` directory, a Lo-Fi",
            "store or a Hugging Face model directory.",
        ))
    store = Store(location)
    try:
        ckpt = snapshot.load_snapshot(store, snapshot.PARAMS)
        kind = "params"
    except StoreError:
        ckpt, kind = snapshot.latest_average_snapshot(store), "lofi_average"
    if ckpt is not None:
        return _with_configs(Weights(location, kind, store_leaves(store, ckpt),
                                     step=ckpt.step), location)
    if _is_huggingface(location):
        return _huggingface_weights(location)
    raise WeightsError(paragraph(
        f"{location!r} holds no weights jaxscale can read: no training checkpoint, no committed",
        "params/ export, no Lo-Fi average and no Hugging Face safetensors were found there.",
        "Point at a training workdir, a `launch.convert` output, a `launch.lofi_average",
        "--final=DIR` directory, a Lo-Fi store, or a Hugging Face model directory.",
    ))


def _epath(path: str) -> Any:
    """The epath of a location, with s3fs / gcsfs pointed at the configured servers."""
    return locations.epath(path)


def _is_dir(path: str) -> bool:
    return not path.startswith("memory://") and _epath(path).is_dir()


def _is_checkpoint_dir(path: str) -> bool:
    """A `WORKDIR/checkpoints` directory itself (numbered step directories, no params/)."""
    if path.startswith("memory://"):
        return False
    p = _epath(path)
    return (p.name == "checkpoints" and p.is_dir()
            and any(c.name.isdigit() for c in p.iterdir()))


def _is_huggingface(path: str) -> bool:
    """config.json beside safetensors files (one, or shards with their index)."""
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        n.endswith(".safetensors") for n in os.listdir(path))


def store_leaves(store: Any, ckpt: Any) -> dict[str, Leaf]:
    """{path: Leaf} of one committed snapshot (`weights/snapshot.py`: a params export, a
    Lo-Fi average, a worker's push), each read whole from the store only when placed or
    converted."""

    def leaf(path: str, entry: dict) -> Leaf:
        def read(index: Any) -> np.ndarray:
            arr = snapshot.read_leaf(store, ckpt, path)  # looked up at read time
            return arr if index is None else arr[index]
        return Leaf(tuple(entry["shape"]), _store_dtype(entry), read)

    return {path: leaf(path, entry) for path, entry in ckpt.leaves.items()}


def _store_dtype(entry: dict) -> np.dtype:
    """The dtype a store leaf was pushed in (float32 when the manifest does not say)."""
    import ml_dtypes
    name = entry.get("dtype", "float32")
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _read_json(path: str) -> dict | None:
    if path.startswith("memory://"):  # an in-process Lo-Fi store records no config files
        return None
    p = _epath(path)
    return json.loads(p.read_text()) if p.exists() else None


def _with_configs(weights: Weights, location: str) -> Weights:
    """Adds what the location records (`recorded`: the model and LoRA config of a conversion,
    a training workdir or a Lo-Fi export). Llama weights of the pre-fusion layout are
    converted on load (`weights/legacy.py`)."""
    weights.leaves = fuse_legacy_leaves(weights.leaves)
    found = recorded(location)
    weights.run_config, weights.model_cfg, weights.lora_cfg = found.run, found.model, found.lora
    return weights


@dataclass(frozen=True)
class Recorded:
    """What a location records beside its weights, read from small files only."""

    model: dict | None = None      # the config.model fields the weights were made with
    lora: dict | None = None       # a training run's config.lora
    run: dict | None = None        # a training run's (or Lo-Fi job's) whole config.json
    tokenizer: str | None = None   # a data.tokenizer for the weights; None: bytes / unknown


def recorded(location: str) -> Recorded:
    """What `location` records about its weights, without reading a weight: a conversion's
    `model_config.json` (and the tokenizer files it copied), a training workdir's or Lo-Fi
    job's `config.json` (its model, LoRA section and `data.tokenizer`), or a Hugging Face
    directory's `config.json` mapped by its family's converter (safetensors headers only) and
    its tokenizer files. An empty `Recorded` where nothing is recorded (a bare params export,
    an in-process memory:// store)."""
    location = str(location)
    if location.startswith("memory://"):
        return Recorded()
    base = location
    if _is_checkpoint_dir(location):  # WORKDIR/checkpoints: the run's files sit one up
        base = (location.rstrip("/").rsplit("/", 1)[0] if locations.is_remote(location)
                else os.path.dirname(os.path.abspath(location.rstrip("/"))))
    converted = workdir_files.read_json(locations.join(base, MODEL_CONFIG))
    run = workdir_files.read_json(locations.join(base, "config.json"))
    is_run = isinstance(run, dict) and isinstance(run.get("model"), dict)
    if converted is not None:
        return Recorded(converted, None, run if is_run else None, _tokenizer_files(base))
    if is_run:
        spec = (run.get("data") or {}).get("tokenizer", "")
        return Recorded(run["model"], run.get("lora"), run,
                        spec if spec not in ("", "bytes") else None)
    if run is not None and locations.is_remote(base):
        raise WeightsError(paragraph(
            f"{base!r} holds a Hugging Face config.json, and Hugging Face directories are read",
            "with local file APIs (safetensors maps its files). Copy it first (`gcloud storage",
            "cp -r` / `aws s3 cp --recursive`), or convert it (`jaxscale convert --from_hf=DIR",
            "--out=gs://...`: conversions may live in a bucket).",
        ))
    if run is not None and _is_huggingface(base):
        return Recorded(dict(open_huggingface(base).model_cfg), tokenizer=_tokenizer_files(base))
    return Recorded()


def _tokenizer_files(directory: str) -> str | None:
    """`directory` when it holds a tokenizer.json or tokenizer.model (an HF directory, or a
    conversion that copied them), else None."""
    names = ("tokenizer.json", "tokenizer.model")
    return directory if any(_epath(locations.join(directory, n)).exists() for n in names) \
        else None


def _huggingface_weights(location: str) -> Weights:
    """A Hugging Face directory, through the converter of its model_type (lazy leaves in
    float32, each reading only the layers its part covers)."""
    source = open_huggingface(location)
    return Weights(location, "huggingface", source.lazy_leaves(np.float32),
                   model_cfg=dict(source.model_cfg))


def open_huggingface(hf_dir: str, **options: Any) -> Any:
    """The validated `interop.hf.Source` of a HF directory, read by the converter that the
    model table names for its config's `model_type` (`models.hf_opener`); `options` (e.g.
    DeepSeek-V3's `mtp=True`) go to that converter, refused for one that has no such option."""
    hf = read_hf_config(hf_dir)
    opener = hf_opener(hf, hf_dir)
    unknown = sorted(set(options) - set(inspect.signature(opener).parameters))
    if unknown:
        raise ConversionError(paragraph(
            f"{hf_dir}: the {hf.get('model_type')!r} converter has no option {unknown[0]}",
            f"(given {options}); it is a DeepSeek-V3 option (its multi-token-prediction",
            "layer). Convert without it."))
    try:
        return opener(hf_dir, **options)
    except JaxscaleError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        raise ConversionError(paragraph(  # a field of a type or size its converter cannot read
            f"{os.path.join(hf_dir, 'config.json')} has a field its converter cannot read",
            f"({type(e).__name__}: {str(e)[:200]}). Compare the file with the model's original",
            "config.json (a hand edit or a truncated download?), or re-save the model with",
            "`save_pretrained`. Nothing was written.")) from None


def read_hf_config(hf_dir: str) -> dict:
    """A Hugging Face directory's config.json, or one paragraph on why it cannot be read."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir!r} is not a directory; point at a Hugging Face model "
                              "directory written by `save_pretrained`.")
    if not os.path.exists(path):
        raise ConversionError(f"{hf_dir} has no config.json; point at a Hugging Face model "
                              "directory written by `save_pretrained`.")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON ({e}); re-save the model with "
                              "`save_pretrained`.") from None
    check_hf_config(hf, path)
    return hf


# Hugging Face config.json fields that are counts or sizes (a positive integer each, where
# present): checked before any converter does arithmetic with them.
HF_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
             "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
             "decoder_sparse_step", "image_size", "patch_size", "num_channels", "num_labels",
             "sliding_window_pattern")
HF_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "rope_theta", "router_aux_loss_coef")
HF_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob",
            "output_router_logits", "qkv_bias")


def check_hf_config(hf: Any, path: str) -> None:
    """A config.json is an object whose count fields are positive integers and whose float
    fields are numbers: one paragraph naming the file and the field otherwise, not a
    converter's AttributeError / int() traceback."""
    if not isinstance(hf, dict):
        raise ConversionError(paragraph(
            f"{path} holds a JSON {type(hf).__name__}, not an object of model fields (a",
            "Hugging Face config.json is one JSON object: {\"model_type\": ..., ...}). Re-save",
            "the model with `save_pretrained`, or fetch its config.json again."))
    model_type = hf.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ConversionError(paragraph(
            f"{path}: model_type={model_type!r} is not a string (e.g. \"llama\"). Set it to the",
            "model's architecture, or re-save the model with `save_pretrained`."))
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ConversionError(paragraph(
                f"{path}: {key}={hf[key]!r} is neither an object nor null. Set it to the model's",
                "rotary scaling ({\"rope_type\": ..., ...}) or null, or re-save the model with",
                "`save_pretrained`."))
    for key in (*HF_COUNTS, *HF_NUMBERS):
        if key in hf and hf[key] is None:  # null: absent, the converter's default applies
            del hf[key]
    for key in HF_COUNTS:
        value = hf.get(key)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = hf[key] = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
            raise ConversionError(paragraph(
                f"{path}: {key}={value!r} is not a positive integer below 2**31; the conversion sizes the",
                f"model by it. Set {key} in config.json to the model's value (for",
                "num_hidden_layers: the number of model.layers.<i> in the safetensors files).",
                "Nothing was written."))
    for key in HF_BOOLS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise ConversionError(paragraph(
                f"{path}: {key}={hf[key]!r} is not true or false; the conversion decides the",
                f"model's tensors by it. Set {key} in config.json to the model's value. Nothing",
                "was written."))
    for key in HF_NUMBERS:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value != value):
            raise ConversionError(paragraph(
                f"{path}: {key}={value!r} is not a number. Set {key} in config.json to the",
                "model's value (re-save the model with `save_pretrained`). Nothing was written."))



# ----------------------------------------------------------------------------- orbax checkpoints
def _checkpoint_weights(location: str) -> Weights:
    """Trainable + frozen parameters of the newest restorable step, on one device."""
    from jaxscale.weights import restore

    root = location if _is_checkpoint_dir(location) else locations.join(location, "checkpoints")
    step, restored = restore.newest_restorable(
        root, lambda step: restore.restore_params(root, step))
    workdir = (root.rstrip("/").rsplit("/", 1)[0] if locations.is_remote(root)
               else os.path.dirname(os.path.abspath(root)))
    frozen = flatten(restored.get("frozen") or {})
    if "base_fingerprint" in restored:  # LoRA adapters only: rebuild the base the run used
        frozen = _rebuilt_base(workdir, np.asarray(restored["base_fingerprint"]))
    flat = {**frozen, **flatten(restored["params"])}
    leaves = {k: _host_leaf(np.asarray(v)) for k, v in flat.items()}
    return Weights(location, "checkpoint", leaves, step=step)


def _host_leaf(arr: np.ndarray) -> Leaf:
    return Leaf(arr.shape, arr.dtype, lambda index: arr if index is None else arr[index])


def _rebuilt_base(workdir: str, fingerprint: np.ndarray) -> dict:
    """The frozen base of an adapters-only checkpoint, rebuilt from the run's config.json (its
    `init_from` or seed) and checked against the fingerprint saved with the adapters."""
    import ml_collections as mlc

    from jaxscale.weights.restore import base_fingerprint, fingerprints_match

    run = _read_json(locations.join(workdir, "config.json"))
    if run is None:
        raise WeightsError(f"{workdir}'s checkpoint holds LoRA adapters only, and the run's "
                           "config.json (needed to rebuild the frozen base) is missing.")
    config = mlc.ConfigDict(run)
    flat = rebuild_base(config)
    if not fingerprints_match(fingerprint, np.asarray(base_fingerprint(flat))):
        raise WeightsError(paragraph(
            f"{workdir}'s checkpoint holds LoRA adapters only (lora.save_adapters_only), and",
            "the base weights rebuilt from its config.json (init_from",
            f"{config.get('init_from') or '(none)'}, seed {config.get('seed')}) are not the ones",
            "the adapters were trained on: the init_from weights changed or moved. Restore them",
            "at that path, or train with --config.lora.save_adapters_only=False to save the base.",
        ))
    return flat


def rebuild_base(config: Any) -> dict:
    """The frozen LoRA base of a run, rebuilt as the run built it (on one device): its
    `init_from` weights, or the seed's initialisation. What an adapters-only checkpoint needs
    to be exported or evaluated (merge it with the restored adapters, then `lora.merge`)."""
    import jax

    from jaxscale.models import ModelDef
    from jaxscale.models.adapters import lora
    from jaxscale.precision import get_policy
    from jaxscale.weights.tree import split_trainable

    model_def = lora.with_adapters(ModelDef.build(config.model, get_policy(config.precision)),
                                   config.lora)
    params_rng, _ = jax.random.split(jax.random.key(config.seed))  # as train.state._initializer
    trainable = lora.trainable(config.lora)
    shapes = flatten(split_trainable(jax.eval_shape(model_def.init_params, params_rng),
                                     trainable)[1])
    saved = open_weights(config.init_from).leaves if config.get("init_from") else {}
    if set(shapes) <= set(saved):  # the saved weights cover the base: no initialisation to
        # compile (seconds on a CPU), the same arrays the run's init + overwrite gave
        return {k: np.asarray(saved[k].read(), s.dtype) for k, s in shapes.items()}
    _, frozen = split_trainable(jax.jit(model_def.init_params)(params_rng), trainable)
    flat = {k: np.asarray(v) for k, v in flatten(frozen).items()}
    flat.update({k: np.asarray(v, flat[k].dtype) for k, v in saved.items() if k in flat})
    return flat


def merged_params(weights: Weights) -> dict:
    """The nested parameters of `weights` on the host, LoRA adapters folded into the base:
    what evaluation, generation and export use."""
    from jaxscale.models.adapters import lora

    flat = weights.arrays()
    if any(lora.is_adapter(k) for k in flat):
        lora_cfg = weights.lora_cfg
        if not lora_cfg or not lora_cfg.get("rank"):
            raise WeightsError(f"{weights.location} holds LoRA adapters but no lora config; "
                               "export from the training workdir (its config.json).")

        class _Cfg(dict):
            __getattr__ = dict.__getitem__
        return lora.merge(unflatten(flat), _Cfg(lora_cfg))
    return unflatten(flat)
