"""Document sources on disk, read one document at a time: text, jsonl, parquet, array_record, tokens.

`config.data.sources` is a `;`-separated list of `FORMAT=GLOB` entries with an optional
`@WEIGHT` (e.g. `jsonl=/data/web/*.jsonl@3;text=/data/books/*.txt@1`). Each entry becomes a
`DocSource`: a random-access list of documents (token arrays ending with EOS) plus their token
lengths. Documents are addressed by index, so a process reads only the files, lines, row groups
or records of the documents in its own rows. Lengths are free for `tokens` (file sizes) and for
`array_record` shards written by `launch.prepare_data` (a lengths file beside each shard); for
the on-the-fly formats (`text`, `jsonl`, `parquet`) each process tokenizes only its share of the
files and the lengths are shared (`jaxscale.doc_index`), so large corpora are still best
prepared once. Bad records raise one-paragraph errors naming the file
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

from jaxscale.doc_index import Exchange, build_index
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
    """Shared by the on-the-fly formats (`text`, `jsonl`, `parquet`); a *unit* is one file.

    Documents are addressed by locators `(unit, j, byte offset)` (the offset is used by jsonl
    only). `scan_unit(u)` lists a file's documents, and for jsonl that reads the file; nothing
    is scanned or tokenized when a reader opens. `jaxscale.doc_index` scans and tokenizes each
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

    @functools.lru_cache(maxsize=4096)
    def _tokens(self, loc: tuple[int, int, int]) -> np.ndarray:
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


class TextReader(_Tokenized):
    """Plain text: one document per file."""

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool):
        self._setup(files, tokenizer, skip_bad)

    def scan_unit(self, u: int) -> list[tuple[int, int, int]]:
        return [(u, 0, 0)]

    def key(self, loc: tuple[int, int, int]) -> str:
        return self.files[loc[0]]

    def where_loc(self, loc: tuple[int, int, int]) -> str:
        return self.files[loc[0]]

    def read_text(self, loc: tuple[int, int, int]) -> str | None:
        try:
            with open(self.files[loc[0]], encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            return bad_record(self, loc, f"cannot be read as UTF-8 text ({e})")


class JsonlReader(_Tokenized):
    """JSON lines: one document per non-blank line, its text under `text_field`; lines are
    found by byte offset, so a document is one seek and one line read."""

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool, text_field: str):
        self._setup(files, tokenizer, skip_bad)
        self.text_field = text_field

    def scan_unit(self, u: int) -> list[tuple[int, int, int]]:
        return [(u, j, off) for j, off in enumerate(_line_offsets(self.files[u]))]

    def where_loc(self, loc: tuple[int, int, int]) -> str:
        return f"{self.files[loc[0]]} line {_line_number(self.files[loc[0]], loc[2])}"

    def read_text(self, loc: tuple[int, int, int]) -> str | None:
        with open(self.files[loc[0]], "rb") as fh:
            fh.seek(loc[2])
            raw = fh.readline()
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return bad_record(self, loc, f"is not valid JSON ({e.__class__.__name__}: {e})")
        if not isinstance(record, dict) or not isinstance(record.get(self.text_field), str):
            return bad_record(self, loc, f"has no string field {self.text_field!r} (set "
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


def _line_number(path: str, offset: int) -> int:
    """The 1-based line at `offset` (read only to name a bad record)."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def bad_record(reader: Any, loc: Any, what: str) -> None:
    if reader.skip_bad:
        reader.skipped = getattr(reader, "skipped", 0) + 1
        return None
    where = reader.where_loc(loc) if isinstance(loc, tuple) else reader.where(loc)
    raise DataError(paragraph(
        f"{where} {what}. Fix or remove the record, or set",
        "--config.data.skip_bad_records=True to skip and count bad records.",
    ))


class ParquetReader(_Tokenized):
    """Parquet: one document per row, its text in column `text_field`; read a row group at a
    time. Row counts come from each file's footer, so listing a file's documents reads no data."""

    def __init__(self, files: list[str], tokenizer: Any, skip_bad: bool, text_field: str):
        self._setup(files, tokenizer, skip_bad)
        self.text_field = text_field

    def _forget(self) -> None:
        self._meta.cache_clear()
        self._group.cache_clear()

    @functools.lru_cache(maxsize=64)
    def _meta(self, u: int) -> np.ndarray:
        """First row of each row group of file `u`, and the file's row count last."""
        import pyarrow.parquet as pq
        f = self.files[u]
        try:
            meta = pq.ParquetFile(f).metadata
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError on bad files
            raise DataError(paragraph(
                f"{f} cannot be read as parquet ({type(e).__name__}: {str(e)[:200]}); it is",
                "truncated or not a parquet file. Re-write it or remove it from the glob.",
            )) from None
        return np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])

    def scan_unit(self, u: int) -> list[tuple[int, int, int]]:
        return [(u, j, 0) for j in range(int(self._meta(u)[-1]))]

    def where_loc(self, loc: tuple[int, int, int]) -> str:
        return f"{self.files[loc[0]]} row {loc[1]}"

    @functools.lru_cache(maxsize=8)
    def _group(self, u: int, g: int) -> list:
        import pyarrow.parquet as pq
        f = self.files[u]
        try:
            table = pq.ParquetFile(f).read_row_group(g, columns=[self.text_field])
        except KeyError:
            raise DataError(paragraph(
                f"{f} has no column {self.text_field!r}. Set --config.data.text_field to the",
                "column holding the text.",
            )) from None
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
                field_name: str = "data.sources", shard_index: int = 0, shard_count: int = 1,
                process_index: int = 0, process_count: int = 1,
                exchange: Exchange | None = None) -> DocSource:
    """The `DocSource` of one `FORMAT=GLOB` entry, restricted to Lo-Fi shard `shard_index` of
    `shard_count`: whole files of the on-the-fly formats, every `shard_count`-th document of
    the others. On-the-fly formats are indexed here (`jaxscale.doc_index`): with `exchange`,
    this process tokenizes only its share of the shard's files."""
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
    if isinstance(reader, _Tokenized):
        if shard_count > 1 and len(files) < shard_count:
            raise ConfigError(paragraph(
                f"{field_name}: {spec.glob!r} matches {len(files)} {spec.format} files but",
                f"lofi.num_workers={shard_count}; each Lo-Fi worker reads whole files of",
                "on-the-fly formats. Split the data into at least as many files as workers,",
                "or prepare it with launch.prepare_data (ArrayRecord is split by record).",
            ))
        if shard_count > 1:
            reader.keep_units(list(range(shard_index, len(files), shard_count)))
        build_index(reader, process_index, process_count, exchange)
        return DocSource(reader)
    return DocSource(reader, np.arange(shard_index, reader.num_docs, shard_count))
