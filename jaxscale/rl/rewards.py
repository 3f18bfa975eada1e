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

On several processes (a multi-host run) only process 0 calls the functions, and its rewards are
broadcast to the others (`score_everywhere`): a reward function may be non-deterministic (a
sandbox with a timeout, a judge model sampling), and every process must train on the same
advantages. A failure on process 0 is broadcast too, so every process stops with its paragraph
instead of waiting in a collective for rewards that never come.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

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


MESSAGE_BYTES = 4096  # the longest error paragraph broadcast from process 0


def score_everywhere(rewards: Sequence[Reward], prompts: list, completions: list, records: list
                     ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """`score`'s result on every process: computed by process 0 alone and broadcast (exactly:
    the float64 rewards travel as their bytes), or process 0's RewardError raised everywhere."""
    if jax.process_count() == 1:
        return score(rewards, prompts, completions, records)
    values_FN = np.zeros((len(rewards) + 1, len(completions)), np.float64)
    message = b""
    if jax.process_index() == 0:
        try:
            total, per_function = score(rewards, prompts, completions, records)
            values_FN = np.stack([total, *(per_function[r.name] for r in rewards)])
        except RewardError as e:
            message = str(e).encode()[:MESSAGE_BYTES] or b"RewardError"
    text = np.zeros(MESSAGE_BYTES, np.uint8)
    text[:len(message)] = np.frombuffer(message, np.uint8)
    values, text = multihost_utils.broadcast_one_to_all(
        (values_FN.view(np.int32), text.astype(np.int32)))
    if text.any():
        raise RewardError(paragraph(
            f"On process 0 (which scores the rewards for all {jax.process_count()}):",
            bytes(np.asarray(text, np.uint8)).rstrip(b"\0").decode(errors="replace")))
    values_FN = np.ascontiguousarray(values).view(np.float64)
    return values_FN[0], {r.name: values_FN[i + 1] for i, r in enumerate(rewards)}
