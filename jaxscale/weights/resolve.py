"""`config.init_from` supplies the model: the run's `config.model` and `data.tokenizer` resolved
against what its weights record.

The weights know what they compute: a conversion records its `model_config.json`, a training
workdir or Lo-Fi job its `config.json`, a Hugging Face directory its `config.json`
(`weights.sources.recorded` reads them, never a weight). Asking a user to paste a dozen
`--config.model.*` flags that only restate those files invites a mistake that changes nothing
in the shapes (a `rope_theta`, a `norm_eps`) and silently trains another model, so:

  * A config whose model is a stand-in (`config.model_from_weights=True`: `finetune_lm:test`,
    `finetune_lm[:lora]`, or any config with that flag) takes the model from the weights. Every
    field that decides what the weights compute is theirs (a field they do not record is their
    family's default); the fields of `SAFE` keep the run's value or take the weights' as the
    table says, and a `--config.model.*` flag on the command line sets them.
  * A flag that sets any other field to something else than the weights' value is refused in
    one paragraph naming each such field with both values (the flag may repeat the weights'
    value: the long commands `launch.convert` used to print still run).
  * A config that names its model (`model_from_weights=False`: `finetune_lm:1b`, `tiny_lm`, a
    resolved run's config.json) must agree with the weights on every field outside `SAFE`;
    where it does not, the run is refused with each field's two values.

"Set by the user" is therefore: named by the config file (a config that names its model), or
given by a `--config.model.*` flag (`flagged`, which `jaxscale.cli.resolved` reads off the
command line). Once resolved, the config names its model (`model_from_weights=False`), so the
run's `config.json` records the exact fields and resolving it again only checks them: resume,
`evaluate`, `generate` and `convert --to_hf` read the model from there.

`data.tokenizer` comes along: left at `bytes` and not flagged, it becomes the tokenizer the
weights record (an HF directory's or conversion's `tokenizer.json` / `tokenizer.model`, whose
directory also holds `tokenizer_config.json` and its chat template, or a workdir's own
`data.tokenizer`). A vocabulary smaller than that tokenizer's is refused when the data is
built (`data.tokenizer.check_vocab`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import ml_collections as mlc

from jaxscale.config import MODEL_COMMON
from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.models import DEFAULT_MODEL, entry
from jaxscale.storage import locations
from jaxscale.weights.sources import recorded

WEIGHTS, RUN = "weights", "run"
# The model fields a run may set to other values than its weights' without changing what the
# weights compute, and whose value a run that takes its model from the weights keeps when no
# flag sets it: the weights' (WEIGHTS, when they record it) or the run config's own (RUN: how
# this run computes, on its hardware). Every other model field is the weights'. `config.lora`
# (rank, targets, dropout) is never the weights': it is how this run trains them.
SAFE: dict[str, str] = {
    "max_len": WEIGHTS,              # the longest sequence: positions only, no parameter
    "remat": RUN,                    # what the backward pass recomputes
    "attention": RUN,                # the attention kernel (einsum, splash, cuDNN)
    "context_attention": RUN,        # attention across sequence shards
    "context_order": RUN,            # the sequence's order over its shards
    "loss_chunks": RUN,              # the LM head and loss computed in chunks
    "moe.capacity_factor": WEIGHTS,  # expert buffers: tokens past them are dropped (0: none)
    "moe.grouped_matmul": RUN,       # the experts' matmul kernel
    "moe.dispatch": RUN,             # how tokens reach experts on other devices
    "moe.router_aux_loss_coef": WEIGHTS,  # the router's load-balancing loss
    "moe.router_z_loss_coef": WEIGHTS,    # the router's logit-size loss
    "mtp_loss_weight": WEIGHTS,      # the MTP module's weight in the training loss
}


class InitFromError(JaxscaleError):
    """`config.init_from` does not point at usable weights, or at weights of another model."""


def resolve(config: mlc.ConfigDict, flagged: Collection[str] = ()) -> mlc.ConfigDict:
    """`config` (changed in place and returned) with the model and tokenizer its
    `config.init_from` supplies; `flagged`: the dotted fields the command line set
    (`model.num_layers`, `data.tokenizer`). Reads small files only (`sources.recorded`)."""
    path = config.get("init_from")
    if not path:
        return config
    if locations.is_remote(path):  # the run's S3 endpoint / region, as the loop sets them
        locations.configure(config.get("storage"))
    found = recorded(path)
    if found.model is not None:
        if config.get("model_from_weights", False):
            flags = {f.removeprefix("model.") for f in flagged if f.startswith("model.")}
            config.model = mlc.ConfigDict(_nested(from_weights(
                _flat(config.model.to_dict()), found.model, flags, path)))
            config.model_from_weights = False  # named now: resolving again only checks
        else:
            check_model(config.model.to_dict(), found.model, path)
    data = config.get("data")
    if (found.tokenizer and data is not None and "data.tokenizer" not in flagged
            and data.get("tokenizer", "bytes") in ("", "bytes")):
        data.tokenizer = found.tokenizer
    return config


def from_weights(run: Mapping[str, Any], saved: Mapping[str, Any], flags: Collection[str],
                 path: str) -> dict[str, Any]:
    """The flat model section of a run whose model is the weights': `run` is the config's
    (flat, dotted keys), `saved` what the weights record, `flags` the fields the command line
    set. Raises naming every flag that contradicts the weights."""
    saved_flat, name = _flat(saved), saved.get("name", DEFAULT_MODEL)
    family = family_defaults(name)
    known = set(family) | set(MODEL_COMMON)
    out, wrong = {}, []
    for key in dict.fromkeys([*saved_flat, *(k for k in run if k in known)]):
        if key in SAFE:
            weights_first = SAFE[key] == WEIGHTS and key in saved_flat
            out[key] = (run[key] if key in flags or (key in run and not weights_first)
                        else saved_flat[key])
            continue
        out[key] = saved_flat.get(key, family.get(key, run.get(key)))
        if key in flags and _plain(run[key]) != _plain(out[key]):
            wrong.append(f"--config.model.{key}={run[key]} where the weights have {out[key]!r}")
    wrong += [f"--config.model.{k}={run[k]}, a field the {name} model does not have"
              for k in sorted(flags) if k in run and k not in out]
    if wrong:
        raise InitFromError(paragraph(
            f"config.init_from={path!r} holds a {name} model, and the command line sets fields",
            f"that would change what its weights compute: {'; '.join(wrong)}. The model comes",
            "from the weights: drop those flags (of the model fields only",
            f"{', '.join(SAFE)} may differ from the weights'), or point config.init_from at",
            "weights of the model you mean.",
        ))
    return out


def mismatches(model: Mapping[str, Any], saved: Mapping[str, Any]
               ) -> list[tuple[str, Any, Any]]:
    """(field, config's value, weights' value) of every model field outside `SAFE` on which a
    config that names its model disagrees with the weights (a field one side leaves out is its
    family's default)."""
    mine, theirs = _flat(model), _flat(saved)
    mine.setdefault("name", DEFAULT_MODEL)
    theirs.setdefault("name", DEFAULT_MODEL)
    my_family, family = family_defaults(mine["name"]), family_defaults(theirs["name"])
    keys = [k for k in dict.fromkeys([*theirs, *mine]) if k not in SAFE
            and (k == "name" or k in family)]
    out = []
    for key in keys:
        a, b = mine.get(key, my_family.get(key)), theirs.get(key, family.get(key))
        if _plain(a) != _plain(b):
            out.append((key, a, b))
    return out


def check_model(model: Mapping[str, Any], saved: Mapping[str, Any], path: str) -> None:
    """Refuses a config that names a model other than the one the weights at `path` record."""
    wrong = mismatches(model, saved)
    if wrong:
        raise InitFromError(paragraph(
            f"config.init_from={path!r} holds weights of another model than config.model names:",
            "; ".join(f"model.{k} is {a!r} in the config but {b!r} in the weights"
                      for k, a, b in wrong) + ",",
            "so the run would compute a different model. Take the model from the weights",
            "with --config.model_from_weights=true (finetune_lm:test and finetune_lm[:lora] do),",
            "or give the weights' values:",
            " ".join(f"--config.model.{k}={_flag_value(b)}" for k, _, b in wrong) + ".",
        ))


def family_defaults(name: str) -> dict[str, Any]:
    """{dotted field: default} of the config class of the model table's family `name` (a
    nested dataclass, `moe`, as `moe.*`), with `name` itself."""
    def walk(obj: Any, prefix: str) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(obj):
            value = f.default if f.default is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(value):
                out.update(walk(value, f"{prefix}{f.name}."))
            else:
                out[prefix + f.name] = value
        return out
    return {"name": name, **walk(entry(name).config_cls, "")}


def _flat(fields: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested model section as dotted keys (`moe.num_experts`)."""
    out = {}
    for k in fields.keys():  # a dict or a ConfigDict (which is no `Mapping`)
        v = fields[k]
        out.update(_flat(v, f"{prefix}{k}.") if hasattr(v, "keys") else {prefix + k: v})
    return out


def _nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys back to sections; JSON's lists as the tuples config files use."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *groups, leaf = key.split(".")
        node = out
        for g in groups:
            node = node.setdefault(g, {})
        node[leaf] = tuple(value) if isinstance(value, list) else value
    return out


def _plain(value: Any) -> Any:
    """A sequence as a list: JSON keeps a tuple field (Gemma's `layer_types`) as a list."""
    return list(value) if isinstance(value, (list, tuple)) else value


def _flag_value(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
