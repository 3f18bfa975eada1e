"""Readers of the on-the-fly formats: `text` (a document per file), `jsonl`, `parquet`.

A reader addresses each document by a locator `(file, j, byte offset)` and tokenizes a document
only when it is asked for it (`doc(i)`, cached), so a process reads nothing but the files, lines
and row groups of the documents it needs. Opening a reader reads nothing; listing a file's
documents (`scan_unit`) reads a jsonl file's line offsets or a parquet footer. Bad records raise
one-paragraph errors naming the file and line, or are skipped and counted
(`data.skip_bad_records`).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import numpy as np

from jaxscale.data.tokenizer import encode_document
from jaxscale.errors import JaxscaleError, paragraph
from jaxscale.storage import data_files


class DataError(JaxscaleError):
    """A data file is missing, unreadable or holds a bad record."""


class Tokenized:
    """Shared by the on-the-fly formats (`text`, `jsonl`, `parquet`); a *unit* is one file.

    Documents are addressed by locators `(unit, j, byte offset)` (the offset is used by jsonl
    only). `scan_unit(u)` lists a file's documents, and for jsonl that reads the file; nothing
    is scanned or tokenized when a reader opens. `jaxscale.data.doc_index` scans and tokenizes each
    process's own files once to learn token lengths, shares them between processes, and then
    `attach`es the whole table, so `doc(i)` reads exactly document `i` and nothing else.
    """

    tokenizer: Any
    skip_bad: bool
    files: list[str]

    def _setup(self, files: list[str], tokenizer: Any, skip_bad: bool) -> None:
        self.files, self.tokenizer, self.skip_bad = files, tokenizer, skip_bad
        self.skipped = 0
        self.tokenized = 0  # documents tokenized by this process (per-host reading is tested)
        self.locs: list[tuple[int, int, int]] = []
        self._lengths = np.zeros(0, np.int64)
        # Per-reader caches (a method-level lru_cache would be one cache shared by every reader
        # of the process, keeping them alive and cleared by any one of them).
        self._tokens = functools.lru_cache(maxsize=4096)(self._read_tokens)

    @property
    def units(self) -> list[str]:
        return self.files

    def keep_units(self, keep: list[int]) -> None:
        """Restricts the reader to these files (a Lo-Fi worker's shard)."""
        self.files = [self.files[u] for u in keep]
        self._tokens.cache_clear()  # locators name files by position
        self._forget()

    def _forget(self) -> None:
        pass

    def check_unit(self, u: int) -> None:
        """Called once file `u` is indexed (tokenized whole): a reader that can judge a whole
        file (`chat_sources.PreferenceReader`) refuses or notes it here."""

    def attach(self, locs: list[tuple[int, int, int]], lengths: np.ndarray | None) -> None:
        """Sets the document table (every unit's locators, in unit order) and token lengths."""
        self.locs, self._lengths = locs, lengths

    def scan(self) -> None:
        """Lists every document without tokenizing (the prepare step reads every text anyway)."""
        self.attach([loc for u in range(len(self.units)) for loc in self.scan_unit(u)], None)

    @property
    def num_docs(self) -> int:
        return len(self.locs)

    @property
    def keys(self) -> list[str]:
        return [self.key(loc) for loc in self.locs]

    def key(self, loc: tuple[int, int, int]) -> str:
        return f"{os.path.basename(self.files[loc[0]])}:{loc[1]}"

    def where(self, i: int) -> str:
        return self.where_loc(self.locs[i])

    def text_of(self, i: int) -> str | None:
        return self.read_text(self.locs[i])

    def doc(self, i: int) -> np.ndarray:
        return self._tokens(self.locs[i])

    def tokens_at(self, loc: tuple[int, int, int]) -> np.ndarray:
        return self._tokens(loc)

    def _read_tokens(self, loc: tuple[int, int, int]) -> np.ndarray:
        self.tokenized += 1
        text = self.read_text(loc)
        if text is None:  # a skipped bad record: an empty document
            return np.zeros(0, np.uint32)
        ids = encode_document(self.tokenizer, text)
        if len(ids) - (self.tokenizer.eos_id is not None) < 1:
            bad_record(self, loc, "is an empty document (shorter than one token)")
            return np.zeros(0, np.uint32)
        return ids

    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            return np.asarray([len(self.doc(i)) for i in range(self.num_docs)], np.int64)
        return self._lengths


class TextReader(Tokenized):
    """Plain text: one document per file."""

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool):
        self._setup(files, tokenizer, skip_bad)

    def scan_unit(self, u: int) -> list[tuple[int, int, int]]:
        return [(u, 0, 0)]

    def where_loc(self, loc: tuple[int, int, int]) -> str:
        return self.files[loc[0]]

    def read_text(self, loc: tuple[int, int, int]) -> str | None:
        try:
            with data_files.open_binary(self.files[loc[0]]) as f:
                return f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            return bad_record(self, loc, f"cannot be read as UTF-8 text ({e})")


class JsonlReader(Tokenized):
    """JSON lines: one document per non-blank line, its text under `text_field`; lines are
    found by byte offset, so a document is one seek and one line read."""

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool, text_field: str):
        self._setup(files, tokenizer, skip_bad)
        self.text_field = text_field

    def scan_unit(self, u: int) -> list[tuple[int, int, int]]:
        return [(u, j, off) for j, off in enumerate(_line_offsets(self.files[u]))]

    def where_loc(self, loc: tuple[int, int, int]) -> str:
        return f"{self.files[loc[0]]} line {_line_number(self.files[loc[0]], loc[2])}"

    def read_record(self, loc: tuple[int, int, int]) -> dict | None:
        """The JSON object on the line at `loc` (None: a bad record, skipped)."""
        raw = data_files.read_line(self.files[loc[0]], loc[2])
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return bad_record(self, loc, f"is not valid JSON ({e.__class__.__name__}: {e})")
        if not isinstance(record, dict):
            return bad_record(self, loc, f"is not a JSON object ({raw[:60]!r})")
        return record

    def read_text(self, loc: tuple[int, int, int]) -> str | None:
        record = self.read_record(loc)
        if record is None:
            return None
        if not isinstance(record.get(self.text_field), str):
            return bad_record(self, loc, f"has no string field {self.text_field!r} (set "
                              "--config.data.text_field, or prepare-data's --text_field, to the "
                              "field holding the text)")
        return record[self.text_field]


def _line_offsets(path: str) -> list[int]:
    """Byte offsets of the non-blank lines of a file (blank lines are not documents)."""
    offsets, pos = [], 0
    with data_files.open_binary(path) as f:
        for raw in f:
            if raw.strip():
                offsets.append(pos)
            pos += len(raw)
    return offsets


def _line_number(path: str, offset: int) -> int:
    """The 1-based line at `offset` (read only to name a bad record)."""
    return data_files.read_range(path, 0, offset).count(b"\n") + 1


# How each command skips bad records (`data.skip_bad_records`), named by every such error.
SKIP_FLAGS = ("--config.data.skip_bad_records=True (train), --skip_bad_records (evaluate, "
              "prepare-data)")


def bad_record(reader: Any, loc: Any, what: str) -> None:
    if reader.skip_bad:
        reader.skipped = getattr(reader, "skipped", 0) + 1
        return None
    where = reader.where_loc(loc) if isinstance(loc, tuple) else reader.where(loc)
    raise DataError(paragraph(
        f"{where} {what}. Fix or remove the record, or skip and count bad records:",
        f"{SKIP_FLAGS}.",
    ))


class ParquetReader(Tokenized):
    """Parquet: one document per row, its text in column `text_field`; read a row group at a
    time. Row counts come from each file's footer, so listing a file's documents reads no data."""

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool, text_field: str):
        self._setup(files, tokenizer, skip_bad)
        self.text_field = text_field
        self._meta = functools.lru_cache(maxsize=64)(self._read_meta)
        self._group = functools.lru_cache(maxsize=8)(self._read_group)

    def _forget(self) -> None:
        self._meta.cache_clear()
        self._group.cache_clear()

    def _read_meta(self, u: int) -> np.ndarray:
        """First row of each row group of file `u`, and the file's row count last."""
        import pyarrow.parquet as pq
        f = self.files[u]
        try:
            with data_files.open_binary(f) as fh:
                pf = pq.ParquetFile(fh)
                meta, columns = pf.metadata, pf.schema_arrow.names
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError on bad files
            raise DataError(paragraph(
                f"{f} cannot be read as parquet ({type(e).__name__}: {str(e)[:200]}); it is",
                "truncated or not a parquet file. Re-write it or remove it from the glob.",
            )) from None
        if self.text_field not in columns:
            shown = ", ".join(repr(c) for c in columns[:10]) + (" ..." if len(columns) > 10
                                                                 else "")
            raise DataError(paragraph(
                f"{f} has no column {self.text_field!r}; its columns are {shown or 'none'}.",
                "Set --config.data.text_field (prepare-data: --text_field) to the column",
                "holding the text.",
            ))
        return np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])

    def scan_unit(self, u: int) -> list[tuple[int, int, int]]:
        return [(u, j, 0) for j in range(int(self._meta(u)[-1]))]

    def where_loc(self, loc: tuple[int, int, int]) -> str:
        return f"{self.files[loc[0]]} row {loc[1]}"

    def _read_group(self, u: int, g: int) -> list:
        import pyarrow.parquet as pq
        f = self.files[u]
        try:  # no arrow thread pool: its threads, still starting when an error here ends the
            # process, abort it at exit ("terminate called without an active exception")
            with data_files.open_binary(f) as fh:
                table = pq.ParquetFile(fh).read_row_group(g, columns=[self.text_field],
                                                          use_threads=False)
        except Exception as e:
            raise DataError(paragraph(
                f"{f} row group {g} cannot be read ({type(e).__name__}: {str(e)[:200]});",
                "the file is truncated or corrupt. Re-write it or remove it from the glob.",
            )) from None
        return table.column(0).to_pylist()

    def read_text(self, loc: tuple[int, int, int]) -> str | None:
        u, j, _ = loc
        starts = self._meta(u)
        g = int(np.searchsorted(starts, j, side="right")) - 1
        text = self._group(u, g)[j - int(starts[g])]
        if not isinstance(text, str):
            return bad_record(self, loc, f"has no text in column {self.text_field!r} ({text!r})")
        return text
