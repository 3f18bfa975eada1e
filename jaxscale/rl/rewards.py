"""Reward functions by name (`objective.rewards = "module:function[@weight],..."`), as in TRL.

A reward function is batched: `fn(prompts, completions, records) -> list[float]`, one number
per completion. `prompts[i]` is completion i's prompt as its record gives it (a string, or the
chat messages), `completions[i]` the decoded completion (a string; for a chat prompt the list
`[{"role": "assistant", "content": text}]`, TRL's conversational form) and `records[i]` the
prompt's whole jsonl record (an answer to check against, a test to run). The module is
imported from the run's directory (the working directory) or `PYTHONPATH`. A run's reward is the
weighted sum of its functions' rewards; each function's mean is reported as `reward/<name>`.

Every way a user's function can go wrong stops the run with one paragraph naming the function:
a module or function that is not there, an exception inside it, a result of the wrong length, a
value that is not a number, a NaN.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxscale.errors import JaxscaleError, paragraph, short_error
from jaxscale.objectives.grpo import reward_specs


class RewardError(JaxscaleError):
    """A reward function cannot be found, or its result is not one number per completion."""


@dataclass(frozen=True)
class Reward:
    """One entry of `objective.rewards`: `name` (the function's, or module.function when two
    share it) is what `reward/<name>` reports."""

    name: str
    spec: str
    fn: Callable[..., Any]
    weight: float


def _import(module: str, spec: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # `jaxscale train` is a console script
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module and not module.startswith(f"{e.name}."):
            raise RewardError(paragraph(
                f"objective.rewards={spec!r}: importing {module!r} failed inside it:",
                f"{short_error(e)}. Install what it imports, or fix the module.")) from None
        raise RewardError(paragraph(
            f"objective.rewards={spec!r}: there is no module {module!r} (looked in {cwd} and",
            "PYTHONPATH). Put FILE.py with the function in the directory you run from (the",
            "module is FILE), or add its directory to PYTHONPATH.")) from None
    except Exception as e:  # a syntax error, an exception at import
        raise RewardError(paragraph(
            f"objective.rewards={spec!r}: importing {module!r} raised",
            f"{type(e).__name__}: {short_error(e)}. Fix the module.")) from None


def load_rewards(text: str) -> list[Reward]:
    """The functions `objective.rewards` names, imported and checked to be callable."""
    specs = reward_specs(text)
    out = []
    for module, function, weight in specs:
        fn = getattr(_import(module, text), function, None)
        if not callable(fn):
            raise RewardError(paragraph(
                f"objective.rewards={text!r}: module {module!r} has no function {function!r}",
                f"(found {type(fn).__name__}). Define `def {function}(prompts, completions,",
                "records) -> list[float]` there, or fix the name."))
        out.append((module, function, fn, weight))
    clash = {f for _, f, _, _ in out if sum(g == f for _, g, _, _ in out) > 1}
    return [Reward(f"{m}.{f}" if f in clash else f, f"{m}:{f}", fn, w)
            for m, f, fn, w in out]


def _checked(reward: Reward, values: Any, count: int) -> np.ndarray:
    """`values` as `count` finite floats, or one paragraph saying what is wrong."""
    what = f"The reward function {reward.spec}"
    try:
        n = len(values)
    except TypeError:
        raise RewardError(paragraph(
            f"{what} returned {type(values).__name__}, not a list: it is called on a batch",
            f"of {count} completions and returns one number per completion.")) from None
    if n != count:
        raise RewardError(paragraph(
            f"{what} returned {n} values for {count} completions: it is called on the",
            "whole batch (prompts, completions and records are lists of the same length) and",
            "returns one number per completion."))
    out = np.empty(count, np.float64)
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise RewardError(paragraph(
                f"{what} returned {v!r} ({type(v).__name__}) for completion {i}, not a number.",
                "Return an int or a float for every completion (0.0 for one it cannot score)."))
        if not math.isfinite(float(v)):
            raise RewardError(paragraph(
                f"{what} returned {float(v)} for completion {i}. Rewards must be finite: a",
                "NaN or infinite reward would turn every advantage of the batch into NaN."))
        out[i] = float(v)
    return out


def score(rewards: Sequence[Reward], prompts: list, completions: list, records: list
          ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(the weighted sum of every function's rewards (n,), each function's own rewards)."""
    per_function = {}
    for reward in rewards:
        try:
            values = reward.fn(prompts, completions, records)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(paragraph(
                f"The reward function {reward.spec} raised {type(e).__name__}:",
                f"{short_error(e)}. Fix it; it is called as fn(prompts, completions, records),",
                "each a list with one entry per completion.")) from None
        per_function[reward.name] = _checked(reward, values, len(completions))
    total = sum(r.weight * per_function[r.name] for r in rewards)
    return np.asarray(total, np.float64), per_function
