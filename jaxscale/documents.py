"""Document sources on disk, read one document at a time: text, jsonl, parquet, array_record, tokens.

`config.data.sources` is a `;`-separated list of `FORMAT=GLOB` entries with an optional
`@WEIGHT` (e.g. `jsonl=/data/web/*.jsonl@3;text=/data/books/*.txt@1`). Each entry becomes a
`DocSource`: a random-access list of documents (token arrays ending with EOS) plus their token
lengths. Documents are addressed by index, so a process reads only the files, lines, row groups
or records of the documents in its own rows. Lengths are free for `tokens` (file sizes) and for
`array_record` shards written by `launch.prepare_data` (a lengths file beside each shard); the
on-the-fly formats (`text`, `jsonl`, `parquet`) tokenize every document once to learn them, so
large corpora should be prepared first. Bad records raise one-paragraph errors naming the file
and line (or skip and count them with `data.skip_bad_records`).
"""

from __future__ import annotations

import functools
import glob as globlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxscale.errors import ConfigError, JaxscaleError, paragraph
from jaxscale.tokenizer import encode_document

FORMATS = ("text", "jsonl", "parquet", "array_record", "tokens")
TOKEN_BLOCK = 1 << 16  # a `tokens` file is addressed in blocks of this many tokens


class DataError(JaxscaleError):
    """A data file is missing, unreadable or holds a bad record."""


@dataclass(frozen=True)
class SourceSpec:
    format: str
    glob: str
    weight: float = 1.0


def parse_sources(spec: str, field_name: str = "data.sources") -> list[SourceSpec]:
    """`FORMAT=GLOB[@WEIGHT];...` -> specs; formats and weights are checked here."""
    out = []
    for entry in (e.strip() for e in spec.split(";")):
        if not entry:
            continue
        fmt, sep, rest = entry.partition("=")
        if not sep or fmt not in FORMATS:
            raise ConfigError(paragraph(
                f"{field_name} entry {entry!r} is not FORMAT=GLOB[@WEIGHT] with FORMAT one of",
                f"{', '.join(FORMATS)}; e.g. 'jsonl=/data/*.jsonl@2;text=/data/books/*.txt'.",
            ))
        pattern, _, weight = rest.rpartition("@") if "@" in rest else (rest, "", "1")
        try:
            w = float(weight)
        except ValueError:
            w = float("nan")
        if not w > 0:
            raise ConfigError(paragraph(
                f"{field_name} entry {entry!r} has mixture weight {weight!r}; weights must be",
                "positive numbers (a source that should not be read is left out of the list).",
            ))
        out.append(SourceSpec(fmt, pattern, w))
    return out


def expand(spec: SourceSpec, field_name: str = "data.sources") -> list[str]:
    files = sorted(globlib.glob(os.path.expanduser(spec.glob), recursive=True))
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise ConfigError(paragraph(
            f"{field_name}: the glob {spec.glob!r} ({spec.format}) matches no file. Check the",
            "path (globs are expanded on every host, so the files must be visible to each).",
        ))
    return files


@dataclass
class DocSource:
    """Documents of one source entry: `doc(i)` -> uint32 tokens, `lengths` -> token counts.

    `ids` selects (and orders) documents of the underlying reader, e.g. the training part after
    the held-out hash split; `keys` are stable names of every document for that split.
    """

    reader: Any
    ids: np.ndarray = field(default=None)

    def __post_init__(self):
        if self.ids is None:
            self.ids = np.arange(self.reader.num_docs)

    def __len__(self) -> int:
        return len(self.ids)

    def doc(self, i: int) -> np.ndarray:
        """Document `i` of this selection (the reader's document `ids[i]`)."""
        return self.reader.doc(int(self.ids[i]))

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        return self.reader.lengths()[self.ids]

    def subset(self, keep: np.ndarray) -> "DocSource":
        return DocSource(self.reader, self.ids[keep])


class _Tokenized:
    """Shared by the on-the-fly formats: `text_of(i)` -> str, tokenized with EOS, cached."""

    tokenizer: Any
    skip_bad: bool

    def doc(self, i: int) -> np.ndarray:
        return self._tokens(i)

    @functools.lru_cache(maxsize=4096)
    def _tokens(self, i: int) -> np.ndarray:
        text = self.text_of(i)
        if text is None:  # a skipped bad record: an empty document
            return np.zeros(0, np.uint32)
        ids = encode_document(self.tokenizer, text)
        if len(ids) - (self.tokenizer.eos_id is not None) < 1:
            bad_record(self, i, "is an empty document (shorter than one token)")
            return np.zeros(0, np.uint32)
        return ids

    def lengths(self) -> np.ndarray:
        return np.asarray([len(self.doc(i)) for i in range(self.num_docs)], np.int64)


class TextReader(_Tokenized):
    """Plain text: one document per file."""

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool):
        self.files, self.tokenizer, self.skip_bad = files, tokenizer, skip_bad
        self.num_docs = len(files)
        self.keys = files

    def where(self, i: int) -> str:
        return self.files[i]

    def text_of(self, i: int) -> str | None:
        try:
            with open(self.files[i], encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            return bad_record(self, i, f"cannot be read as UTF-8 text ({e})")


class JsonlReader(_Tokenized):
    """JSON lines: one document per line, its text under `text_field`; lines found by offset."""

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool, text_field: str):
        self.files, self.tokenizer, self.skip_bad = files, tokenizer, skip_bad
        self.text_field = text_field
        index = [(f, line, off) for f in files for line, off in enumerate(_line_offsets(f))]
        self._index = index
        self.num_docs = len(index)
        self.keys = [f"{os.path.basename(f)}:{line}" for f, line, _ in index]

    def where(self, i: int) -> str:
        f, line, _ = self._index[i]
        return f"{f} line {line + 1}"

    def text_of(self, i: int) -> str | None:
        f, line, off = self._index[i]
        with open(f, "rb") as fh:
            fh.seek(off)
            raw = fh.readline()
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return bad_record(self, i, f"is not valid JSON ({e.__class__.__name__}: {e})")
        if not isinstance(record, dict) or not isinstance(record.get(self.text_field), str):
            return bad_record(self, i, f"has no string field {self.text_field!r} (set "
                        "--config.data.text_field to the field holding the text)")
        return record[self.text_field]


def _line_offsets(path: str) -> list[int]:
    """Byte offsets of the non-blank lines of a file (blank lines are not documents)."""
    offsets, pos = [], 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                offsets.append(pos)
            pos += len(raw)
    return offsets


def bad_record(reader: Any, i: int, what: str) -> None:
    if reader.skip_bad:
        reader.skipped = getattr(reader, "skipped", 0) + 1
        return None
    raise DataError(paragraph(
        f"{reader.where(i)} {what}. Fix or remove the record, or set",
        "--config.data.skip_bad_records=True to skip and count bad records.",
    ))


class ParquetReader(_Tokenized):
    """Parquet: one document per row, its text in column `text_field`; read a row group at a time."""

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool, text_field: str):
        import pyarrow.parquet as pq
        self.files, self.tokenizer, self.skip_bad = files, tokenizer, skip_bad
        self.text_field = text_field
        self._index = []  # (file, row group, first doc of the group, rows)
        for f in files:
            try:
                meta = pq.ParquetFile(f).metadata
            except Exception as e:  # pyarrow raises ArrowInvalid / OSError on bad files
                raise DataError(paragraph(
                    f"{f} cannot be read as parquet ({type(e).__name__}: {str(e)[:200]}); it is",
                    "truncated or not a parquet file. Re-write it or remove it from the glob.",
                )) from None
            for g in range(meta.num_row_groups):
                self._index.append((f, g, meta.row_group(g).num_rows))
        self._starts = np.cumsum([0] + [n for _, _, n in self._index])
        self.num_docs = int(self._starts[-1])
        self.keys = [f"{os.path.basename(f)}:{g}:{r}" for f, g, n in self._index
                     for r in range(n)]

    def _locate(self, i: int) -> tuple[int, int]:
        g = int(np.searchsorted(self._starts, i, side="right")) - 1
        return g, i - int(self._starts[g])

    def where(self, i: int) -> str:
        g, r = self._locate(i)
        return f"{self._index[g][0]} row {int(self._starts[g]) - self._file_start(g) + r}"

    def _file_start(self, g: int) -> int:
        f = self._index[g][0]
        first = next(k for k, entry in enumerate(self._index) if entry[0] == f)
        return int(self._starts[first])

    @functools.lru_cache(maxsize=8)
    def _group(self, g: int) -> list:
        import pyarrow.parquet as pq
        f, group, _ = self._index[g]
        try:
            table = pq.ParquetFile(f).read_row_group(group, columns=[self.text_field])
        except KeyError:
            raise DataError(paragraph(
                f"{f} has no column {self.text_field!r}. Set --config.data.text_field to the",
                "column holding the text.",
            )) from None
        except Exception as e:
            raise DataError(paragraph(
                f"{f} row group {group} cannot be read ({type(e).__name__}: {str(e)[:200]});",
                "the file is truncated or corrupt. Re-write it or remove it from the glob.",
            )) from None
        return table.column(0).to_pylist()

    def text_of(self, i: int) -> str | None:
        g, r = self._locate(i)
        text = self._group(g)[r]
        if not isinstance(text, str):
            return bad_record(self, i, f"has no text in column {self.text_field!r} ({text!r})")
        return text


class ArrayRecordReader:
    """Shards of `launch.prepare_data`: one record per document, uint32 tokens (EOS included)."""

    def __init__(self, files: list[str]):
        import grain
        for f in files:
            if os.path.getsize(f) == 0:
                raise DataError(paragraph(
                    f"{f} is empty: not an ArrayRecord shard. Re-run launch.prepare_data or",
                    "remove it from the glob.",
                ))
        try:
            self._source = grain.sources.ArrayRecordDataSource(files)
            self.num_docs = len(self._source)
        except Exception as e:
            raise DataError(paragraph(
                f"The ArrayRecord shards {files[0]}... cannot be opened ({type(e).__name__}:",
                f"{str(e)[:200]}); a shard is truncated or not ArrayRecord. Re-run",
                "launch.prepare_data into a fresh directory.",
            )) from None
        self.files = files
        self.keys = None  # prepared data splits held-out by record index (see file_data)

    def doc(self, i: int) -> np.ndarray:
        try:
            return np.frombuffer(self._source[i], dtype=np.uint32)
        except Exception as e:
            raise DataError(paragraph(
                f"Record {i} of the ArrayRecord shards {self.files[0]}... cannot be read",
                f"({type(e).__name__}: {str(e)[:200]}); a shard is truncated or corrupt. Re-run",
                "launch.prepare_data into a fresh directory.",
            )) from None

    def lengths(self) -> np.ndarray:
        parts = []
        for f in self.files:  # written by launch.prepare_data beside each shard
            side = f + ".lengths.npy"
            if not os.path.exists(side):
                return np.asarray([len(self.doc(i)) for i in range(self.num_docs)], np.int64)
            parts.append(np.load(side, allow_pickle=False))
        return np.concatenate(parts).astype(np.int64)


class TokenFileReader:
    """Flat uint16 / uint32 token files (as nanoGPT writes them), memory-mapped.

    The files carry their own document separators; they are addressed in blocks of
    `TOKEN_BLOCK` tokens, so a process maps in only the blocks of its rows.
    """

    def __init__(self, files: list[str], dtype: str):
        if dtype not in ("uint16", "uint32"):
            raise ConfigError(f"data.token_dtype={dtype!r}: use 'uint16' or 'uint32'.")
        self.files, self.dtype = files, np.dtype(dtype)
        self._blocks = []  # (file, start token, length)
        for f in files:
            size = os.path.getsize(f)
            if size % self.dtype.itemsize:
                raise DataError(paragraph(
                    f"{f} has {size} bytes, not a multiple of {self.dtype.itemsize}: it is not a",
                    f"flat {dtype} token file (set --config.data.token_dtype) or is truncated.",
                ))
            n = size // self.dtype.itemsize
            self._blocks += [(f, s, min(TOKEN_BLOCK, n - s)) for s in range(0, n, TOKEN_BLOCK)]
        self.num_docs = len(self._blocks)
        self.keys = [f"{os.path.basename(f)}:{s}" for f, s, _ in self._blocks]

    def doc(self, i: int) -> np.ndarray:
        f, start, n = self._blocks[i]
        arr = np.memmap(f, dtype=self.dtype, mode="r", offset=start * self.dtype.itemsize,
                        shape=(n,))
        return np.asarray(arr, dtype=np.uint32)

    def lengths(self) -> np.ndarray:
        return np.asarray([n for _, _, n in self._blocks], np.int64)


def open_source(spec: SourceSpec, data_config: Any, tokenizer: Any,
                field_name: str = "data.sources") -> DocSource:
    """The `DocSource` of one `FORMAT=GLOB` entry."""
    files = expand(spec, field_name)
    skip = bool(data_config.get("skip_bad_records", False))
    field = data_config.get("text_field", "text")
    if spec.format == "text":
        reader = TextReader(files, tokenizer, skip)
    elif spec.format == "jsonl":
        reader = JsonlReader(files, tokenizer, skip, field)
    elif spec.format == "parquet":
        reader = ParquetReader(files, tokenizer, skip, field)
    elif spec.format == "array_record":
        reader = ArrayRecordReader(files)
    else:
        reader = TokenFileReader(files, data_config.get("token_dtype", "uint16"))
    return DocSource(reader)
