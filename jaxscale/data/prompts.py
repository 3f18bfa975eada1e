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
from jaxscale.data.sources import expand, parse_sources
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
    """Every record of `config.data.sources`'s `prompts=GLOB` entries, tokenized; prompts
    longer than `max_prompt_tokens` are refused (they would leave no room to answer)."""

    def __init__(self, config: Any, max_prompt_tokens: int):
        d = config.data
        self.tokenizer = load_tokenizer(d.get("tokenizer", BYTES))
        self._spec, self._template = d.get("tokenizer", BYTES), d.get("chat_template", "")
        self.max_prompt_tokens = max_prompt_tokens
        self.prompts: list[Prompt] = []
        for spec in parse_sources(d.sources):
            if spec.format != "prompts":
                raise ConfigError(paragraph(
                    f"data.sources mixes prompts=GLOB with {spec.format}={spec.glob}: an RL run",
                    "samples its rows from prompts alone. Give only prompts=GLOB entries."))
            for path in expand(spec):
                self.prompts += [self._read(value, f"{path} line {n}")
                                 for n, value in _records(path)]
        if not self.prompts:
            raise ConfigError(paragraph(
                f"data.sources={d.sources!r} holds no prompt record. Give jsonl files with one",
                "{\"prompt\": ...} object per line."))
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
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(np.asarray(p.ids, np.int64).tobytes() + b";")
        return np.concatenate([[len(self.prompts)], np.frombuffer(h.digest()[:16], np.int32)]
                              ).astype(np.int32)

    def take(self, rollout: int, count: int) -> list[Prompt]:
        """The `count` prompts of rollout number `rollout` (0-based): consecutive slices of a
        shuffle of the set, reshuffled (by seed and pass) every pass over it."""
        out, start = [], rollout * count
        for k in range(start, start + count):
            epoch, i = divmod(k, len(self.prompts))
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
            out.append(self.prompts[int(order[i])])
        return out


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
