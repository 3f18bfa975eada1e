"""Documents -> fixed rows of `seq_len + 1` tokens: `concat`, `pack` (first-fit) or `none`.

`concat` joins the documents (each ending with EOS) into one stream and cuts windows, as the
stdlib demo does; rows carry only `tokens`. `pack` places whole documents into rows first-fit
and splits only documents longer than a row; `none` gives each document (or each row-sized piece
of a long one) its own row. Both add `segment_ids` (1, 2, ... per document in the row, 0 on
padding) and `positions` (restarting at 0 in every segment), so the model can mask attention
across documents and the loss can skip padding. A plan is computed from token lengths alone;
`row(i)` then reads only the documents of row `i`.

Rows of a mixture that holds chat (`masked`) also carry `loss_mask` (1 on the tokens the loss
counts, 0 on padding): a chat document's marked tokens (`data.chat`), or with
`data.train_on=all` every token of it, and every token of a text document. Preference sources
have rows of their own, one pair each (`chat_sources.PairRows`), whatever the packing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxscale.data.chat import split_mask
from jaxscale.data.chat_sources import PairRows, kind_of
from jaxscale.errors import ConfigError, paragraph

PACKINGS = ("none", "concat", "pack")
SEGMENTED = ("pack", "none")  # the packings whose rows carry `segment_ids` and `positions`
OPEN_ROWS = 128  # first-fit looks at this many most recent rows with room left


class _Masks:
    """How rows turn a source's documents into (ids, loss mask): `masked` rows carry the mask
    (see the module docstring); `every_token`: `data.train_on=all`, or a text source."""

    masked: bool = False
    every_token: bool = True

    def _set_masks(self, source: Any, masked: bool, train_on: str) -> None:
        self.masked = masked
        self.every_token = train_on == "all" or kind_of(source) != "chat"

    def _read(self, d: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Document `d`'s ids and loss mask (None for rows without masks: the ids as read,
        not copied, as a token file's blocks are large)."""
        doc = self.source.doc(d)
        if not self.masked:
            return doc, None
        ids, mask = split_mask(doc)
        return ids, (np.ones_like(mask) if self.every_token else mask)


class ConcatRows(_Masks):
    """Windows of `width` tokens (stride `width - 1`) over the concatenated documents."""

    def __init__(self, source: Any, width: int, masked: bool = False, train_on: str = "assistant"):
        self.source, self.width = source, width
        self._set_masks(source, masked, train_on)
        self.ends = np.cumsum(source.lengths)
        total = int(self.ends[-1]) if len(self.ends) else 0
        self.num_rows = max(0, (total - 1) // (width - 1))

    def row(self, r: int) -> dict[str, np.ndarray]:
        lo, hi = r * (self.width - 1), r * (self.width - 1) + self.width
        first = int(np.searchsorted(self.ends, lo, side="right"))
        parts, masks, pos = [], [], lo
        for d in range(first, len(self.ends)):
            if pos >= hi:
                break
            start = int(self.ends[d]) - int(self.source.lengths[d])
            ids, mask = self._read(d)
            piece = slice(pos - start, min(hi, int(self.ends[d])) - start)
            parts.append(ids[piece])
            masks.append(None if mask is None else mask[piece])
            pos = min(hi, int(self.ends[d]))
        row = {"tokens": np.concatenate(parts).astype(np.int32)}
        if self.masked:
            row["loss_mask"] = np.concatenate(masks).astype(np.int32)
        return row


class SegmentRows(_Masks):
    """Rows of whole documents (`pack`: first-fit, several per row; `none`: one per row)."""

    def __init__(self, source: Any, width: int, pad_id: int, pack: bool, masked: bool = False,
                 train_on: str = "assistant"):
        self.source, self.width, self.pad_id = source, width, pad_id
        self._set_masks(source, masked, train_on)
        self.plan = first_fit(source.lengths, width) if pack else one_per_row(source.lengths, width)
        self.num_rows = len(self.plan)

    def row(self, r: int) -> dict[str, np.ndarray]:
        tokens = np.full(self.width, self.pad_id, np.int32)
        segment_ids = np.zeros(self.width, np.int32)
        positions = np.zeros(self.width, np.int32)
        loss_mask = np.zeros(self.width, np.int32)
        at = 0
        for k, (d, start, n) in enumerate(self.plan[r]):
            ids, mask = self._read(d)
            tokens[at:at + n] = ids[start:start + n]
            if mask is not None:
                loss_mask[at:at + n] = mask[start:start + n]
            segment_ids[at:at + n] = k + 1
            positions[at:at + n] = np.arange(n)
            at += n
        row = {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}
        return {**row, "loss_mask": loss_mask} if self.masked else row


def _pieces(lengths: np.ndarray, width: int):
    """(doc, start, length) pieces: documents longer than a row split into row-sized pieces."""
    for d, n in enumerate(lengths):
        for start in range(0, int(n), width):
            yield d, start, min(width, int(n) - start)


def one_per_row(lengths: np.ndarray, width: int) -> list[list[tuple[int, int, int]]]:
    return [[p] for p in _pieces(lengths, width) if p[2] > 1]


def first_fit(lengths: np.ndarray, width: int) -> list[list[tuple[int, int, int]]]:
    """Each piece goes into the first of the recent rows with room for it, else a new row."""
    rows: list[list[tuple[int, int, int]]] = []
    room: list[int] = []
    open_rows: list[int] = []
    for piece in _pieces(lengths, width):
        if piece[2] <= 1:  # a lone token has nothing to predict inside its document
            continue
        target = next((r for r in open_rows if room[r] >= piece[2]), None)
        if target is None:
            rows.append([])
            room.append(width)
            open_rows.append(len(rows) - 1)
            target = len(rows) - 1
            if len(open_rows) > OPEN_ROWS:
                open_rows.pop(0)
        rows[target].append(piece)
        room[target] -= piece[2]
        if room[target] <= 1:
            open_rows.remove(target)
    return rows


def carries_segments(data: Any) -> bool:
    """Whether the rows of `config.data` carry `segment_ids` and `positions` besides `tokens`:
    file sources read with a `SEGMENTED` packing (the stdlib demo's windows never do)."""
    return bool(data.get("sources")) and data.get("packing", "concat") in SEGMENTED


def make_rows(source: Any, packing: str, seq_len: int, pad_id: int, masked: bool = False,
              train_on: str = "assistant") -> Any:
    """The rows of `source` for `config.data.packing` (preference pairs: one per row); each
    has `num_rows` and `row(i)`. `masked`: the rows carry `loss_mask` (a mixture with chat),
    `train_on`: `data.train_on`."""
    width = seq_len + 1
    if source is not None and kind_of(source) == "preference":
        return PairRows(source, width, pad_id)
    if packing == "concat":
        return ConcatRows(source, width, masked, train_on)
    if packing in SEGMENTED:
        return SegmentRows(source, width, pad_id, pack=packing == "pack", masked=masked,
                           train_on=train_on)
    raise ConfigError(paragraph(
        f"data.packing={packing!r}: use 'concat' (join documents, cut windows), 'pack' (whole",
        "documents first-fit into rows, with segment ids) or 'none' (one document per row).",
    ))
