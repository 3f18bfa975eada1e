"""Held-out evaluation of a workdir's newest weights: loss, perplexity and accuracy.

Rebuilds the run from `WORKDIR/config.json` (mesh, rules, precision, model, data), loads the
newest checkpoint's parameters (LoRA adapters folded in) onto the mesh by the rules, and
evaluates the held-out split of its dataset (`jaxscale.data.registry.heldout_batches`: every test image
for image datasets, padded and masked; the run's own held-out batches for text), or every row
of other text files (`eval_sources`, tokenized with the run's tokenizer, the last batch padded
with masked rows). Metrics are summed
per example/token and divided once at the end, so they do not depend on the batch split or the
mesh.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections as mlc
import optax

from jaxscale.data.registry import heldout_batches
from jaxscale.errors import JaxscaleError
from jaxscale.mesh import make_mesh
from jaxscale.precision import get_policy
from jaxscale.rules import AxisRules, constrain, use_rules
from jaxscale.models import ModelDef
from jaxscale.train.state import param_specs
from jaxscale.weights.place import named_shardings, place
from jaxscale.weights.tree import flatten, unflatten
from jaxscale.train.step import batch_sharding


def _sums(model: Any, batch: Mapping[str, jax.Array], task: str) -> dict[str, jax.Array]:
    """Summed loss, correct predictions and count for one batch (masked rows excluded)."""
    if task == "classify":
        logits, targets = model(batch["images"]), batch["labels"]
    else:
        tokens = constrain(batch["tokens"], "batch", "length")
        segments = batch.get("segment_ids")
        if segments is not None:  # packed rows: each document alone, padding not counted
            segments = constrain(segments, "batch", "length")
            positions = constrain(batch["positions"], "batch", "length")[:, :-1]
            logits = model(tokens[:, :-1], positions, segments_BT=segments[:, :-1])
            batch = {**batch, "mask": ((segments[:, 1:] == segments[:, :-1])
                                       & (segments[:, 1:] > 0)).astype(jnp.float32)}
        else:
            logits = model(tokens[:, :-1])
        targets = tokens[:, 1:]
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    mask = batch.get("mask")
    if mask is None:
        mask = jnp.ones(targets.shape, jnp.float32)
    elif mask.ndim < targets.ndim:  # one mask value per example
        mask = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (targets.ndim - mask.ndim)),
                                targets.shape)
    return {"loss": (losses * mask).sum(), "correct": (correct * mask).sum(),
            "count": mask.sum()}


def read_config(workdir: str) -> mlc.ConfigDict:
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise JaxscaleError(f"{workdir} has no config.json; evaluate a directory written by "
                            "launch.train (--workdir).")
    with open(path) as f:
        return mlc.ConfigDict(json.load(f))


def evaluate_params(config: mlc.ConfigDict, params: Mapping, max_batches: int = 0,
                    eval_sources: str = "") -> dict[str, float]:
    """Metrics of `params` (flat or nested, host or device) on the config's held-out data, or
    on every row of `eval_sources` (`FORMAT=GLOB;...`, read with the run's tokenizer)."""
    mesh, rules = make_mesh(config.mesh), AxisRules.from_config(config)
    policy = get_policy(config.precision)
    model_def = ModelDef.build(config.model, policy)
    task = config.model.get("task", "lm")
    shardings = named_shardings(mesh, param_specs(model_def, rules, mesh))
    placed = unflatten(place(flatten(params), shardings, policy.param))
    evals = heldout_batches(config, jax.process_index(), jax.process_count(), eval_sources)
    if max_batches:
        evals = evals[:max_batches]
    shapes = {k: (config.data.batch_size,) + v.shape[1:] for k, v in evals[0].items()}
    sharding = batch_sharding(rules, mesh, shapes)

    @jax.jit
    def sums(p, batch):
        with use_rules(rules, mesh):
            return _sums(model_def.module(p), batch, task)

    total = {"loss": 0.0, "correct": 0.0, "count": 0.0}
    for local in evals:
        batch = {k: jax.make_array_from_process_local_data(sharding[k], v, shapes[k])
                 for k, v in local.items()}
        for k, v in jax.device_get(sums(placed, batch)).items():
            total[k] += float(v)
    loss = total["loss"] / total["count"]
    if task == "lm":  # accuracy: of next-token predictions
        return {"loss": loss, "perplexity": math.exp(loss),
                "accuracy": total["correct"] / total["count"], "tokens": int(total["count"])}
    return {"loss": loss, "accuracy": total["correct"] / total["count"],
            "examples": int(total["count"])}


def evaluate_workdir(workdir: str, max_batches: int = 0, eval_sources: str = ""
                     ) -> dict[str, float]:
    """Metrics of the newest checkpoint (or params export) in `workdir`, on its held-out split
    or on `eval_sources`."""
    from jaxscale.weights.sources import merged_params, open_weights
    config = read_config(workdir)
    params = merged_params(open_weights(workdir))  # LoRA adapters folded in (config.json)
    return evaluate_params(config, params, max_batches, eval_sources)
