"""Chat and preference sources (`chat=GLOB`, `preference=GLOB`) and the rows of preference pairs.

Both read jsonl records, one per line, and render them with the tokenizer's chat template
(`jaxscale.data.chat`):

  * `chat`: `{"messages": [{"role": ..., "content": ...}, ...]}` (the Hugging Face / OpenAI
    convention, multi-turn, an optional system turn). A document is the conversation's ids
    with the trained tokens marked (`chat.with_mask`), so it packs like text.
  * `preference`: `{"prompt": ..., "chosen": ..., "rejected": ...}`; the prompt is a string (one
    user turn) or a messages list, each response a string (one assistant turn) or the assistant
    messages that follow the prompt. A document is a pair (`pair_doc`): the prompt's token
    count, then prompt + chosen and prompt + rejected, each marked on the response's trained
    tokens only (what a preference objective scores).

`prepare-data --format=chat|preference` writes these same documents into ArrayRecord shards
(`metadata.json` names the format), so prepared data trains exactly as the jsonl did.
Preference rows (`PairRows`) hold one pair each, never packed: `chosen_tokens`,
`chosen_loss_mask`, `rejected_tokens`, `rejected_loss_mask`, (B, seq_len + 1), right-padded.
A response longer than the row is cut at its end; a pair whose prompt alone leaves no response
token in the row is a bad record. A file whose every pair is identical (chosen == rejected) is
refused, and identical pairs among others are counted, as the file is indexed
(`check_signal`): the index tokenizes every record once anyway, so this reads nothing twice.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import numpy as np

from jaxscale.data.chat import MASK_BIT, ChatEncoder, split_mask, with_mask
from jaxscale.data.readers import SKIP_FLAGS, DataError, JsonlReader
from jaxscale.errors import paragraph

KINDS = ("text", "chat", "preference")  # what a source's documents are
# The arrays of a preference row (`PairRows`), what preference objectives train on.
PAIR_KEYS = ("chosen_tokens", "chosen_loss_mask", "rejected_tokens", "rejected_loss_mask")


def kind_of(source: Any) -> str:
    """The kind of a `DocSource`'s documents (a reader without one holds text)."""
    return getattr(getattr(source, "reader", None), "kind", "text")


def pair_doc(prompt_tokens: int, chosen: np.ndarray, rejected: np.ndarray) -> np.ndarray:
    """One uint32 document of a pair: [prompt tokens, len(chosen), chosen..., rejected...]."""
    return np.concatenate([np.asarray([prompt_tokens, len(chosen)], np.uint32), chosen,
                           rejected]).astype(np.uint32)


def split_pair(doc: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """(prompt tokens, chosen, rejected) of a `pair_doc`."""
    prompt, n = int(doc[0]), int(doc[1])
    return prompt, doc[2:2 + n], doc[2 + n:]


def token_ids(doc: np.ndarray, kind: str) -> np.ndarray:
    """The token ids of a document of `kind` (mask bits and a pair's counts left out): what
    is checked against the vocabulary."""
    if kind == "preference":
        _, chosen, rejected = split_pair(doc)
        doc = np.concatenate([chosen, rejected])
    return doc & ~MASK_BIT if kind != "text" else doc


def as_messages(value: Any, role: str, what: str, where: Any) -> list:
    """A record's field as messages: a string is one `role` turn, a list is kept."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value:
        return value
    raise DataError(paragraph(
        f"{where()} has no {what} (found {type(value).__name__}): a preference record holds",
        "\"prompt\" (a string or a messages list), \"chosen\" and \"rejected\" (each a string",
        "or the assistant messages that follow the prompt). Fix or remove the record (or skip",
        f"bad records: {SKIP_FLAGS})."))


class ChatReader(JsonlReader):
    """`chat=GLOB`: one conversation per jsonl line, under `messages`."""

    kind = "chat"

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool, encoder: ChatEncoder,
                 train_on: str = "assistant"):
        super().__init__(files, tokenizer, skip_bad, "messages")
        self.encoder, self.train_on = encoder, train_on

    def encode(self, record: dict, where: Any) -> np.ndarray:
        ids, mask = self.encoder.encode(record.get("messages"), where,
                                        assistant_only=self.train_on != "all")
        return with_mask(ids, mask)

    def _read_tokens(self, loc: tuple[int, int, int]) -> np.ndarray:
        self.tokenized += 1
        record = self.read_record(loc)
        if record is None:
            return np.zeros(0, np.uint32)
        try:
            return self.encode(record, lambda: self.where_loc(loc))
        except DataError:
            if not self.skip_bad:
                raise
            self.skipped += 1
            return np.zeros(0, np.uint32)

    def read_text(self, loc: tuple[int, int, int]) -> str | None:
        raise NotImplementedError("chat records are tokenized whole (`doc`), not read as text")


class PreferenceReader(ChatReader):
    """`preference=GLOB`: one prompt with a chosen and a rejected response per jsonl line.
    `seq_len`: a pair whose prompt alone fills the row is a bad record."""

    kind = "preference"

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool, encoder: ChatEncoder,
                 seq_len: int):
        super().__init__(files, tokenizer, skip_bad, encoder)
        self.seq_len = seq_len
        self.pairs: Counter = Counter()  # pairs tokenized, per file
        self.same: Counter = Counter()  # of those, pairs whose chosen is the rejected

    def _read_tokens(self, loc: tuple[int, int, int]) -> np.ndarray:
        doc = super()._read_tokens(loc)
        if len(doc):  # empty: a skipped bad record
            self.pairs[self.files[loc[0]]] += 1
            self.same[self.files[loc[0]]] += same_pair(doc)
        return doc

    def check_unit(self, u: int) -> None:
        """A file whose every pair is identical is refused (`check_signal`)."""
        path = self.files[u]
        check_signal(path, self.pairs[path], self.same[path])

    def encode(self, record: dict, where: Any) -> np.ndarray:
        prompt = as_messages(record.get("prompt"), "user", "prompt", where)
        sides = [as_messages(record.get(k), "assistant", f"{k!r} response", where)
                 for k in ("chosen", "rejected")]
        (c_ids, c_mask, prompt_tokens), (r_ids, r_mask, _) = (
            self.encoder.encode_response(prompt, side, where) for side in sides)
        check_prompt(prompt_tokens, self.seq_len, where)
        return pair_doc(prompt_tokens, with_mask(c_ids, c_mask), with_mask(r_ids, r_mask))


def same_pair(doc: np.ndarray) -> bool:
    """Whether a `pair_doc`'s chosen and rejected responses are the same tokens."""
    _, chosen, rejected = split_pair(doc)
    return bool(np.array_equal(chosen, rejected))


def check_signal(path: str, pairs: int, same: int, sources: str = "data.sources") -> None:
    """A file of `pairs` pairs, `same` of them identical: refused when every pair is (no
    preference signal: the loss is a constant, ln 2 for DPO, and its gradient zero); a note
    counts identical pairs among others, which only dilute the loss. `sources`: the setting
    that named the file (`--sources` for the prepare step)."""
    if pairs and same == pairs:
        raise DataError(paragraph(
            f"{path}: each of its {pairs} preference pairs has a chosen response identical to",
            "its rejected one, so the file carries no preference signal: the loss would stay",
            "at its start (ln 2 = 0.693 for DPO) with a zero gradient and the run would learn",
            "nothing from it. Check how the file was written (\"chosen\" and \"rejected\"",
            f"probably hold the same field), or remove it from {sources}."))
    if same:
        print(f"jaxscale: note: {path}: {same} of its {pairs} preference pairs have identical "
              "chosen and rejected responses; they add a constant to the loss and teach "
              "nothing", file=sys.stderr, flush=True)


def check_prompt(prompt_tokens: int, seq_len: int, where: Any) -> None:
    """A pair must leave at least one response token inside a row of `seq_len` + 1 tokens."""
    if seq_len and prompt_tokens > seq_len:
        raise DataError(paragraph(
            f"{where()}: the prompt alone is {prompt_tokens} tokens, more than",
            f"data.seq_len={seq_len}, so no token of either response fits in the row and the",
            "pair cannot be scored. Raise data.seq_len, shorten the prompt, or remove the",
            f"record (or skip such records: {SKIP_FLAGS})."))


class PairRows:
    """One preference pair per row (see the module docstring), read from a source's pair
    documents; a row is cut to `width` = seq_len + 1 tokens and right-padded with `pad_id`."""

    def __init__(self, source: Any, width: int, pad_id: int):
        self.source, self.width, self.pad_id = source, width, pad_id
        self.num_rows = len(source)

    def _where(self, r: int) -> Any:
        reader = self.source.reader
        i = int(self.source.ids[r])
        return lambda: (reader.where(i) if hasattr(reader, "where") else reader._where(i))

    def row(self, r: int) -> dict[str, np.ndarray]:
        prompt_tokens, chosen, rejected = split_pair(self.source.doc(r))
        check_prompt(prompt_tokens, self.width - 1, self._where(r))
        out = {}
        for side, doc in (("chosen", chosen), ("rejected", rejected)):
            ids, mask = split_mask(doc[:self.width])
            tokens = np.full(self.width, self.pad_id, np.int32)
            loss_mask = np.zeros(self.width, np.int32)
            tokens[:len(ids)], loss_mask[:len(ids)] = ids, mask
            out[f"{side}_tokens"], out[f"{side}_loss_mask"] = tokens, loss_mask
        return out

