"""Held-out evaluation of a workdir's newest weights: loss, perplexity and accuracy, or a
preference objective's rewards and reward accuracy (a grpo policy on text: the lm metrics).

Rebuilds the run from `WORKDIR/config.json` (mesh, rules, precision, model, data), loads the
newest checkpoint's parameters (LoRA adapters folded in) onto the mesh by the rules, and
evaluates the held-out split of its dataset (`jaxscale.data.registry.heldout_batches`: every test image
for image datasets, padded and masked; the run's own held-out batches for text), or every row
of other text files (`eval_sources`, tokenized with the run's tokenizer, the last batch padded
with masked rows). The metrics are the training loop's `eval_*` (`jaxscale.train.heldout`):
summed per example/token (per pair) by the run's objective and divided once at the end, so they
do not depend on the batch split or the mesh. A `dpo` / `ipo` run is scored against its
reference model, rebuilt as the run built it (`train.reference.host_reference`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import ml_collections as mlc

from jaxscale.data.mixture import configured_kind
from jaxscale.data.registry import heldout_batches
from jaxscale.errors import JaxscaleError
from jaxscale.mesh import make_mesh
from jaxscale.models import ModelDef
from jaxscale.objectives import Settings, check_data_kind, objective_of
from jaxscale.precision import get_policy
from jaxscale.rules import AxisRules
from jaxscale.storage import workdir_files
from jaxscale.train.heldout import HeldOut
from jaxscale.train.reference import host_reference
from jaxscale.train.step import global_batch
from jaxscale.weights.place import named_shardings, param_specs, place
from jaxscale.weights.tree import flatten, unflatten

_OTHER_SOURCES = ("Give --eval_sources of what the run's objective scores (preference pairs for "
                  "dpo, ipo and simpo; text or chat otherwise), or drop the flag to evaluate the "
                  "run's own held-out split.")


def read_config(workdir: str) -> mlc.ConfigDict:
    config = workdir_files.read_json(os.path.join(workdir, "config.json"))
    if config is None:
        raise JaxscaleError(f"{workdir} has no config.json; evaluate a directory written by "
                            "`jaxscale train` (its --workdir).")
    return mlc.ConfigDict(config)


def evaluate_params(config: mlc.ConfigDict, params: Mapping, max_batches: int = 0,
                    eval_sources: str = "") -> dict[str, float]:
    """Metrics of `params` (flat or nested, host or device) on the config's held-out data, or
    on every row of `eval_sources` (`FORMAT=GLOB;...`, read with the run's tokenizer)."""
    if eval_sources:  # training's check, blaming the flag: the run's objective is fixed
        check_data_kind(Settings.from_config(config.get("objective")).name,
                        configured_kind({"sources": eval_sources}),
                        f"--eval_sources={eval_sources}", _OTHER_SOURCES, rollouts=False)
    mesh, rules = make_mesh(config.mesh), AxisRules.from_config(config)
    policy = get_policy(config.precision)
    model_def = ModelDef.build(config.model, policy)
    shardings = named_shardings(mesh, param_specs(model_def, rules, mesh))
    placed = unflatten(place(flatten(params), shardings, policy.param))
    reference = host_reference(config)
    if reference is not None:
        reference = unflatten(place(reference, shardings, policy.param))
    evals = heldout_batches(config, jax.process_index(), jax.process_count(), eval_sources)
    if max_batches:
        evals = evals[:max_batches]
    batches = (global_batch(local, rules, mesh, config.data.batch_size) for local in evals)
    held = HeldOut(model_def, rules, mesh, objective_of(config),
                   None if reference is None else model_def)
    return held.metrics(placed, batches, reference)


def evaluate_workdir(workdir: str, max_batches: int = 0, eval_sources: str = "",
                     skip_bad_records: bool = False) -> dict[str, float]:
    """Metrics of the newest checkpoint (or params export) in `workdir`, on its held-out split
    or on `eval_sources` (bad records skipped and counted if `skip_bad_records` or the run's
    config says so)."""
    from jaxscale.weights.sources import merged_params, open_weights
    config = read_config(workdir)
    if skip_bad_records:
        config.data.skip_bad_records = True
    params = merged_params(open_weights(workdir))  # LoRA adapters folded in (config.json)
    return evaluate_params(config, params, max_batches, eval_sources)
