"""A resume trains the model its checkpoints hold: the run's `config.model` must equal the one
the workdir's `config.json` recorded, except for the fields of `RESUME_SAFE`.

Changing, say, `moe.experts_per_token` between a save and a resume keeps every parameter's
shape, so orbax would restore the weights into another model without a word, and the workdir's
`config.json` would be rewritten to the new one (`evaluate`, `generate` and `convert --to_hf`
would then read a model the weights were not trained as). A shape-changing field
(`moe.num_experts`) would fail inside orbax with advice about `strict=False` that does not
apply. `check_resumed_model` refuses both before anything is restored or rewritten, in one
paragraph naming each field with its saved and its new value.
"""

from __future__ import annotations

import json
from typing import Any

from jaxscale.errors import ConfigError, JaxscaleError, paragraph

# The `config.model` fields a resume may change (documented in docs/faults.md): how the same
# parameters are computed (kernels, recomputation, chunking), the positions the model is run
# at, and the MoE training knobs that change no parameter (capacity and the router's losses).
RESUME_SAFE: dict[str, str] = {
    "max_len": "the longest sequence: positions only, no parameter",
    "remat": "what the backward pass recomputes",
    "attention": "the attention kernel (einsum, splash, cuDNN)",
    "context_attention": "attention across sequence shards",
    "context_order": "the sequence's order over its shards",
    "loss_chunks": "the LM head and loss computed in chunks",
    "moe.capacity_factor": "expert buffers (tokens past them are dropped)",
    "moe.grouped_matmul": "the experts' matmul kernel",
    "moe.dispatch": "how tokens reach experts on other devices",
    "moe.router_aux_loss_coef": "the router's load-balancing loss",
    "moe.router_z_loss_coef": "the router's logit-size loss",
}


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (tree or {}).items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_fields(saved: dict, model: dict) -> list[tuple[str, Any, Any]]:
    """(field, saved value, this run's value) of every `config.model` field both record with
    different values, outside `RESUME_SAFE` (a field only one of them has is a newer or older
    jaxscale's, not a change)."""
    norm = lambda d: _flat(json.loads(json.dumps(d, default=str)))  # tuples as the file has them
    old, new = norm(saved), norm(model)
    return [(k, old[k], new[k]) for k in sorted(set(old) & set(new))
            if old[k] != new[k] and k not in RESUME_SAFE]


def check_resumed_model(config: Any, workdir: str) -> None:
    """Refuses a run whose `config.model` differs from the one `workdir`'s checkpoints were
    saved with (its `config.json`) outside `RESUME_SAFE`; a workdir without a complete
    checkpoint (or without a readable config.json) is a fresh start and is not checked."""
    from jaxscale.storage import locations, workdir_files
    from jaxscale.weights.restore import saved_steps

    try:
        saved = workdir_files.read_json(locations.join(workdir, "config.json"))
    except JaxscaleError:  # cut short: the run rewrites it (the checkpoints are checked)
        return
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        return
    changed = changed_fields(saved["model"], config.model.to_dict())
    if not changed or not saved_steps(locations.join(workdir, "checkpoints")):
        return
    shown = "; ".join(f"model.{k}: saved {old!r}, now {new!r}" for k, old, new in changed[:6])
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    raise ConfigError(paragraph(
        f"--workdir={workdir} holds checkpoints of another model than this run's: {shown}{more}.",
        "Resuming would restore those weights into a different model (and rewrite the",
        "workdir's config.json). Resume with the saved values (drop the flags or config edits",
        "that changed them), or train the changed model in a new workdir. Fields a resume may",
        "change:",
        ", ".join(f"model.{k}" for k in RESUME_SAFE) + ". Nothing was restored or written.",
    ))
