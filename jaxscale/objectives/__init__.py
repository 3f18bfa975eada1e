"""Training objectives by name (`config.objective.name`): the table and the checks of a config.

| name | trains on | loss | reference |
|---|---|---|---|
| `lm` | token rows (text, chat with its loss mask) | the model's own task: next token | none |
| `dpo` | preference pairs | DPO, `beta`, `label_smoothing` (conservative DPO) | yes |
| `ipo` | preference pairs | IPO, `beta` | yes |
| `simpo` | preference pairs | SimPO, `beta`, `gamma`, length-normalised | none |
| `grpo` | rollouts of `prompts=GLOB` | GRPO / DAPO / Dr. GRPO / GSPO policy gradient | if `beta` > 0 |

Each names its batch layout, loss and held-out sums (`base.Objective`); `sft_weight` adds the
chosen response's NLL to the preference objectives. Objectives sit above the models (they use a
model's task and, for `dpo` / `ipo`, a second, frozen model) and below the training side, which
holds the reference's weights (`jaxscale/train/reference.py`). An explicit table: a new
objective is a module here and one line in `OBJECTIVES`. `grpo` trains on batches a rollout
samples (`jaxscale/rl/`, above the training side), never on the data pipeline's rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models import task_of
from jaxscale.models.task import Task
from jaxscale.objectives.base import LMObjective, Objective, Settings
from jaxscale.objectives.grpo import GRPOObjective, check_grpo
from jaxscale.objectives.preference import PreferenceObjective

__all__ = ["OBJECTIVES", "Objective", "Settings", "check_data_kind", "check_objective",
           "holds_reference", "make_objective", "objective_of"]

# name -> (task, settings) -> the objective
OBJECTIVES: dict[str, Callable[[Task, Settings], Objective]] = {
    "lm": lambda task, s: LMObjective(task),
    "dpo": lambda task, s: PreferenceObjective(task, s, "dpo"),
    "ipo": lambda task, s: PreferenceObjective(task, s, "ipo"),
    "simpo": lambda task, s: PreferenceObjective(task, s, "simpo"),
    "grpo": lambda task, s: GRPOObjective(task, s),
}
PREFERENCE = ("dpo", "ipo", "simpo")


def make_objective(objective_cfg: Mapping[str, Any] | None, task: Task) -> Objective:
    """The objective a `config.objective` section names, on the model's `task`."""
    s = Settings.from_config(objective_cfg)
    _check_name(s.name)
    return OBJECTIVES[s.name](task, s)


def objective_of(config: Any) -> Objective:
    """The objective of a whole config (its model's task)."""
    return make_objective(config.get("objective"), task_of(config.model))


def holds_reference(config: Any) -> bool:
    """Whether a run of `config` holds reference weights of its own (a copy of the model's, or
    weights from a path): `dpo` / `ipo`, except `reference="init"` under LoRA, whose reference is
    the frozen base with the adapters off (no extra weights)."""
    s = Settings.from_config(config.get("objective"))
    if s.name not in OBJECTIVES or not OBJECTIVES[s.name](task_of(config.model),
                                                          s).uses_reference:
        return False
    lora = config.get("lora") or {}
    return not (s.reference == "init" and lora.get("rank", 0))


def _check_name(name: str) -> None:
    if name not in OBJECTIVES:
        raise ConfigError(paragraph(
            f"objective.name={name!r} is not an objective. Use one of {', '.join(OBJECTIVES)}:",
            "'lm' (the model's own loss; chat data trains on its assistant tokens), 'dpo',",
            "'ipo' or 'simpo' (preference pairs), 'grpo' (RL on prompts=GLOB with rewards)."))


# Which objectives read each setting of `config.objective` (`name` aside): one set to another
# value than its default under an objective that ignores it is refused, not silently unused.
_GRPO_ONLY = ("rewards", "num_generations", "max_new_tokens", "temperature", "top_p", "top_k",
              "epsilon", "epsilon_high", "updates_per_rollout", "loss_norm", "scale_rewards",
              "ratio_level")
READ_BY: dict[str, tuple[str, ...]] = {
    "beta": (*PREFERENCE, "grpo"), "label_smoothing": ("dpo", "simpo"), "gamma": ("simpo",),
    "sft_weight": PREFERENCE, "reference": ("dpo", "ipo", "grpo"),
    **{field: ("grpo",) for field in _GRPO_ONLY},
}


def _check_unused(s: Settings) -> None:
    default = Settings()
    unused = [f"objective.{field}={getattr(s, field)!r} (read by {', '.join(names)})"
              for field, names in READ_BY.items()
              if s.name not in names and getattr(s, field) != getattr(default, field)]
    if unused:
        raise ConfigError(paragraph(
            f"objective.name={s.name!r} does not read {'; '.join(unused)}: the run would",
            "ignore it. Drop the override, or choose the objective that reads it.",
        ))


def check_objective(config: Any, data_kind: str) -> None:
    """`config.objective` against itself, the model's task, the data (`data_kind`: text, chat,
    preference or prompts, `data.mixture.configured_kind`) and the pipeline schedule; one
    paragraph for the first mismatch."""
    s = Settings.from_config(config.get("objective"))
    _check_name(s.name)
    check_data_kind(s.name, data_kind)
    if s.name == "grpo":
        _check_unused(s)
        return _check_grpo(config, s)
    _check_values(s)  # first: its messages say why a value means nothing to the objective
    _check_unused(s)
    preference = s.name in PREFERENCE
    if preference and task_of(config.model).sequence_logps is None:
        raise ConfigError(paragraph(
            f"objective.name={s.name!r} compares the log-probabilities of whole responses,",
            f"which model.name={config.model.get('name', 'llama')!r} does not give (its task",
            "scores no sequences). Use a decoder language model."))
    stages = config.mesh.get("pipeline", 1) * config.mesh.get("dcn_pipeline", 1)
    if preference and stages > 1 and config.pipeline.get("schedule", "gpipe") == "1f1b":
        raise ConfigError(paragraph(
            f"objective.name={s.name!r} scores chosen and rejected responses together (and",
            "against a reference model), but pipeline.schedule='1f1b' runs a next-token loss",
            "inside its schedule, microbatch by microbatch. Use --config.pipeline.schedule=gpipe",
            "(or circular) with pipeline stages for preference objectives."))


def check_data_kind(name: str, data_kind: str, where: str = "data.sources",
                    fix: str | None = None, rollouts: bool = True) -> None:
    """The kind of data `where` holds (text, chat, preference or prompts, as
    `data.mixture.configured_kind` says) against what objective `name` reads: pairs for the
    preference objectives, prompts for grpo where the command samples rollouts (training),
    else token rows. One check for every command that feeds a run's objective data: `where`
    is the field or flag to blame and `fix` replaces the training fixes, which change the
    config. `evaluate --eval_sources` scores rows and samples nothing (`rollouts=False`): there
    prompts are refused for every objective and a grpo run is scored on token rows."""
    samples = rollouts and name == "grpo"
    verb = "train on" if rollouts else "score"
    if samples and data_kind != "prompts":
        raise ConfigError(paragraph(
            f"objective.name='grpo' samples completions of prompts, but {where} holds",
            f"{data_kind} data.", fix or "Give prompts (--config.data.sources='prompts=FILE.jsonl',"
            " one {\"prompt\": ...} per line), or use objective.name=lm for text and chat."))
    if not samples and data_kind == "prompts":
        raise ConfigError(paragraph(
            f"{where} holds prompts=GLOB, which objective.name={name!r} cannot {verb} (prompts",
            "have no answers; an RL run samples them and scores them with reward functions).",
            fix or "Use --config.objective.name=grpo with objective.rewards."))
    if name in PREFERENCE and data_kind != "preference":
        raise ConfigError(paragraph(
            f"objective.name={name!r} trains on preference pairs, but {where} holds",
            f"{data_kind} data.", fix or "Give pairs (--config.data.sources='preference="
            "FILE.jsonl', or prepared pairs), or use --config.objective.name=lm for text and chat."))
    if data_kind == "preference" and name not in PREFERENCE:
        raise ConfigError(paragraph(
            f"{where} holds preference pairs, which objective.name={name!r} cannot {verb} (a",
            "pair is two responses to compare, not one sequence).", fix or "Choose a preference"
            f" objective: --config.objective.name={'|'.join(PREFERENCE)}."))


def _check_grpo(config: Any, s: Settings) -> None:
    """`grpo`: a decoder that scores tokens, its settings, no 1F1B."""
    if task_of(config.model).token_logps is None:
        raise ConfigError(paragraph(
            "objective.name='grpo' compares token log-probabilities, which",
            f"model.name={config.model.get('name', 'llama')!r} does not give. Use a decoder",
            "language model."))
    check_grpo(s, config.data.batch_size, config.data.seq_len)
    packing = config.data.get("packing", "concat")
    if packing != "concat":
        raise ConfigError(paragraph(
            f"data.packing={packing!r} arranges documents into token rows, but a grpo run's",
            "rows are its rollouts (one prompt and one sampled completion each), which are",
            "never packed: the setting would be ignored. Drop it for objective.name='grpo'."))
    stages = config.mesh.get("pipeline", 1) * config.mesh.get("dcn_pipeline", 1)
    if stages > 1 and config.pipeline.get("schedule", "gpipe") == "1f1b":
        raise ConfigError(paragraph(
            "objective.name='grpo' weighs each completion token by its advantage and compares",
            "it with the old and reference policies, but pipeline.schedule='1f1b' runs a",
            "next-token loss inside its schedule, microbatch by microbatch. Use",
            "--config.pipeline.schedule=gpipe (or circular) with pipeline stages for grpo."))


def _check_values(s: Settings) -> None:
    if not (math.isfinite(s.beta) and s.beta > 0):
        raise ConfigError(paragraph(
            f"objective.beta={s.beta} must be positive: it scales the log-probability ratios",
            "(dpo, ipo) or the mean log-probabilities (simpo); 0.1 is usual for dpo, 2.0 for",
            "simpo."))
    if not 0.0 <= s.label_smoothing < 0.5:
        raise ConfigError(paragraph(
            f"objective.label_smoothing={s.label_smoothing} must be in [0, 0.5): the assumed",
            "probability that a pair's labels are flipped (conservative DPO); 0 is plain DPO."))
    if s.name == "simpo" and not s.gamma >= 0:
        raise ConfigError(paragraph(
            f"objective.gamma={s.gamma} must be >= 0 for simpo: the target margin by which the",
            "chosen response's reward should beat the rejected one's (0.5 is usual)."))
    if s.label_smoothing and s.name == "ipo":
        raise ConfigError(paragraph(
            f"objective.label_smoothing={s.label_smoothing} has no meaning for ipo, whose loss",
            "is a squared error, not a likelihood. Set it to 0, or use dpo or simpo."))
    if not (math.isfinite(s.gamma) and math.isfinite(s.sft_weight) and s.sft_weight >= 0):
        raise ConfigError(paragraph(
            f"objective.gamma={s.gamma} must be finite and objective.sft_weight={s.sft_weight}",
            "finite and >= 0 (0: no NLL term on the chosen responses)."))
    if s.name in ("dpo", "ipo") and not s.reference:
        raise ConfigError(paragraph(
            f"objective.name={s.name!r} needs a reference model: objective.reference='init'",
            "(the weights training starts from) or the path of a jaxscale checkpoint or a",
            "Hugging Face directory."))

