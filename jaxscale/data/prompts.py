"""Prompt sources (`prompts=GLOB`): the prompts an RL run samples completions for.

Each jsonl line is a record with a `prompt` and any other fields (an answer to check, a test to
run), which the reward functions receive whole (`jaxscale/rl/rewards.py`). The prompt is either
a string, tokenized as plain text (after the tokenizer's BOS, if it has one; TRL's "standard"
format), or a list of chat messages, rendered with the tokenizer's chat template and its
generation prompt (TRL's "conversational" format; `data.tokenizer` must carry a template, or
`data.chat_template` name one).

Prompt sets are small next to pre-training corpora (thousands of records), so every record is
read and tokenized once, up front, and each bad record is reported in one paragraph naming its
file and line. The order prompts are used in depends only on the seed and the rollout number
(`PromptSet.take`): a new shuffle per pass over the set, so a resumed run draws the prompts
the uninterrupted run drew, with no iterator state.

Held-out prompts (`training_and_heldout`), which a `grpo` run decodes greedily and scores at
each `train.eval_every` (`jaxscale/rl/rollout.py`): the records of `data.eval_sources`
(`prompts=GLOB`), or, when it is empty, the records of `data.sources` whose stable hash falls
below `data.eval_fraction`, as the text pipeline splits documents. The hash is of the record's
content (its JSON with sorted keys), so the split does not depend on file names or order, and
a record repeated in the files is held out with its copies. Held-out records are never trained
on, whether or not the run evaluates, so turning evaluation on or off keeps the training order.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxscale.data.chat import encoder as chat_encoder
from jaxscale.data.readers import DataError
from jaxscale.data.sources import expand, hash_heldout, parse_sources
from jaxscale.data.tokenizer import BYTES, load_tokenizer
from jaxscale.errors import ConfigError, paragraph
from jaxscale.storage import data_files


@dataclass(frozen=True)
class Prompt:
    """One record: its `prompt` as given, the ids the model continues, the whole record."""

    prompt: Any
    ids: tuple[int, ...]
    record: dict

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)


def _records(path: str) -> list[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a jsonl file."""
    with data_files.open_binary(path) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8").read()
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                out.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(paragraph(
                    f"{path} line {n} is not JSON ({e.msg}). A prompts file holds one JSON",
                    "object per line, e.g. {\"prompt\": \"2+2=\", \"answer\": \"4\"}.")) from None
    return out


class PromptSet:
    """Every record of `config.data.sources`'s `prompts=GLOB` entries (or those of the data
    field `field` names), tokenized; prompts longer than `max_prompt_tokens` are refused (they
    would leave no room to answer)."""

    def __init__(self, config: Any, max_prompt_tokens: int, field: str = "sources"):
        d = config.data
        self.tokenizer = load_tokenizer(d.get("tokenizer", BYTES))
        self._spec, self._template = d.get("tokenizer", BYTES), d.get("chat_template", "")
        self.max_prompt_tokens = max_prompt_tokens
        self.prompts: list[Prompt] = []
        for spec in parse_sources(d.get(field, ""), f"data.{field}"):
            if spec.format != "prompts":
                raise ConfigError(paragraph(
                    f"data.{field} mixes prompts=GLOB with {spec.format}={spec.glob}: an RL",
                    "run samples its rows from prompts alone. Give only prompts=GLOB entries."))
            for path in expand(spec, f"data.{field}"):
                self.prompts += [self._read(value, f"{path} line {n}")
                                 for n, value in _records(path)]
        if not self.prompts:
            raise ConfigError(paragraph(
                f"data.{field}={d.get(field, '')!r} holds no prompt record. Give jsonl files with",
                "one {\"prompt\": ...} object per line."))
        self.seed = int(config.seed)

    def _read(self, record: Any, where: str) -> Prompt:
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if isinstance(prompt, str) and prompt:
            ids = list(self.tokenizer.encode(prompt))
            if self.tokenizer.bos_id is not None:
                ids = [self.tokenizer.bos_id] + ids
        elif isinstance(prompt, list) and prompt:
            ids = chat_encoder(self._spec, self._template).prompt_ids(prompt, where).tolist()
        else:
            raise DataError(paragraph(
                f"{where} has no \"prompt\" (found {type(prompt).__name__}): a prompts record",
                "holds \"prompt\" (a non-empty string, or a list of chat messages) and any other",
                "fields the reward functions read. Fix or remove the record."))
        if not ids or len(ids) > self.max_prompt_tokens:
            raise DataError(paragraph(
                f"{where}: the prompt is {len(ids)} tokens, but a row holds at most",
                f"{self.max_prompt_tokens} prompt tokens (data.seq_len minus",
                "objective.max_new_tokens). Raise data.seq_len, lower objective.max_new_tokens,",
                "or shorten the prompt."))
        return Prompt(prompt, tuple(int(i) for i in ids), record)

    def __len__(self) -> int:
        return len(self.prompts)

    def digest(self) -> np.ndarray:
        """(5,) int32: the prompt count and 128 bits of a hash of every prompt's ids, in file
        order; processes that read the same prompts have the same digest."""
        return digest(self.prompts)

    def hold_out(self, fraction: float) -> list[Prompt]:
        """Removes the records whose content's stable hash is below `fraction` (the others
        keep their file order) and returns them, in file order."""
        held = hash_heldout([record_key(p.record) for p in self.prompts], fraction)
        out = [p for p, h in zip(self.prompts, held) if h]
        self.prompts = [p for p, h in zip(self.prompts, held) if not h]
        return out

    def take(self, rollout: int, count: int) -> list[Prompt]:
        """The `count` prompts of rollout number `rollout` (0-based): consecutive slices of a
        shuffle of the set, reshuffled (by seed and pass) every pass over it."""
        out, start = [], rollout * count
        for k in range(start, start + count):
            epoch, i = divmod(k, len(self.prompts))
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
            out.append(self.prompts[int(order[i])])
        return out


def record_key(record: Any) -> str:
    """The text a record's held-out hash is of: its JSON with sorted keys (its content alone)."""
    return json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def digest(prompts: list[Prompt]) -> np.ndarray:
    """`PromptSet.digest` of a list of prompts."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(np.asarray(p.ids, np.int64).tobytes() + b";")
    return np.concatenate([[len(prompts)], np.frombuffer(h.digest()[:16], np.int32)]
                          ).astype(np.int32)


def training_and_heldout(config: Any, max_prompt_tokens: int) -> tuple[PromptSet, list[Prompt]]:
    """(the training prompts, the held-out ones): see the module docstring. An empty side is
    one paragraph: no training prompt always, no held-out prompt when `train.eval_every` > 0."""
    d, every = config.data, int(config.get("train", {}).get("eval_every", 0))
    train = PromptSet(config, max_prompt_tokens)
    if d.get("eval_sources", ""):
        return train, PromptSet(config, max_prompt_tokens, "eval_sources").prompts
    fraction, total = float(d.get("eval_fraction", 0.05)), len(train)
    held = train.hold_out(fraction)
    where = (f"data.eval_fraction={fraction} of the {total} prompt records of "
             f"data.sources={d.sources!r}")
    if not train.prompts:
        raise ConfigError(paragraph(
            f"{where} holds out every record (a record is held out when a hash of its content",
            "falls below the fraction), so no prompt is left for training rollouts. Lower",
            "data.eval_fraction, or give the held-out prompts as their own files with",
            "data.eval_sources='prompts=GLOB' (every record of data.sources then trains)."))
    if every and not held:
        raise ConfigError(paragraph(
            f"train.eval_every={every} decodes the held-out prompts, but {where} holds out",
            "none (a record is held out when a hash of its content falls below the",
            "fraction). Raise data.eval_fraction, give held-out prompts with",
            "data.eval_sources='prompts=GLOB', or set train.eval_every=0."))
    return train, held


class PromptBatches:
    """What the data registry gives for prompt sources: no batches of its own. An RL objective
    samples its batches from these prompts (`jaxscale/rl/rollout.py` replaces this)."""

    def __init__(self, config: Any):
        self.config = config

    def iterator(self, state: dict | None = None) -> Any:
        raise ConfigError(paragraph(
            "data.sources holds prompts=GLOB entries, which are not training rows: they are",
            "what objective.name=grpo samples completions for. Run them with `jaxscale train",
            "--config.objective.name=grpo` (jaxscale.rl.rollout.train_grpo)."))
