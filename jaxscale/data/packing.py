"""Documents -> fixed rows of `seq_len + 1` tokens: `concat`, `pack` (first-fit) or `none`.

`concat` joins the documents (each ending with EOS) into one stream and cuts windows, as the
stdlib demo does; rows carry only `tokens`. `pack` places whole documents into rows first-fit
and splits only documents longer than a row; `none` gives each document (or each row-sized piece
of a long one) its own row. Both add `segment_ids` (1, 2, ... per document in the row, 0 on
padding) and `positions` (restarting at 0 in every segment), so the model can mask attention
across documents and the loss can skip padding. A plan is computed from token lengths alone;
`row(i)` then reads only the documents of row `i`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxscale.errors import ConfigError, paragraph

PACKINGS = ("none", "concat", "pack")
SEGMENTED = ("pack", "none")  # the packings whose rows carry `segment_ids` and `positions`
OPEN_ROWS = 128  # first-fit looks at this many most recent rows with room left


class ConcatRows:
    """Windows of `width` tokens (stride `width - 1`) over the concatenated documents."""

    def __init__(self, source: Any, width: int):
        self.source, self.width = source, width
        self.ends = np.cumsum(source.lengths)
        total = int(self.ends[-1]) if len(self.ends) else 0
        self.num_rows = max(0, (total - 1) // (width - 1))

    def row(self, r: int) -> dict[str, np.ndarray]:
        lo, hi = r * (self.width - 1), r * (self.width - 1) + self.width
        first = int(np.searchsorted(self.ends, lo, side="right"))
        parts, pos = [], lo
        for d in range(first, len(self.ends)):
            if pos >= hi:
                break
            start = int(self.ends[d]) - int(self.source.lengths[d])
            doc = self.source.doc(d)
            parts.append(doc[pos - start:min(hi, int(self.ends[d])) - start])
            pos = min(hi, int(self.ends[d]))
        return {"tokens": np.concatenate(parts).astype(np.int32)}


class SegmentRows:
    """Rows of whole documents (`pack`: first-fit, several per row; `none`: one per row)."""

    def __init__(self, source: Any, width: int, pad_id: int, pack: bool):
        self.source, self.width, self.pad_id = source, width, pad_id
        self.plan = first_fit(source.lengths, width) if pack else one_per_row(source.lengths, width)
        self.num_rows = len(self.plan)

    def row(self, r: int) -> dict[str, np.ndarray]:
        tokens = np.full(self.width, self.pad_id, np.int32)
        segment_ids = np.zeros(self.width, np.int32)
        positions = np.zeros(self.width, np.int32)
        at = 0
        for k, (d, start, n) in enumerate(self.plan[r]):
            tokens[at:at + n] = self.source.doc(d)[start:start + n]
            segment_ids[at:at + n] = k + 1
            positions[at:at + n] = np.arange(n)
            at += n
        return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}


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


def make_rows(source: Any, packing: str, seq_len: int, pad_id: int) -> Any:
    """The rows of `source` for `config.data.packing`; each has `num_rows` and `row(i)`."""
    width = seq_len + 1
    if packing == "concat":
        return ConcatRows(source, width)
    if packing in SEGMENTED:
        return SegmentRows(source, width, pad_id, pack=packing == "pack")
    raise ConfigError(paragraph(
        f"data.packing={packing!r}: use 'concat' (join documents, cut windows), 'pack' (whole",
        "documents first-fit into rows, with segment ids) or 'none' (one document per row).",
    ))
