"""Document sources on disk or in a bucket, read one document at a time: text, jsonl, parquet,
array_record, tokens.

`config.data.sources` is a `;`-separated list of `FORMAT=GLOB` entries with an optional
`@WEIGHT` (e.g. `jsonl=/data/web/*.jsonl@3;text=/data/books/*.txt@1`); `chat` and
`preference` read jsonl conversations and preference pairs through the tokenizer's chat
template (`jaxscale.data.chat_sources`); `prompts` are the prompts of an RL run, which samples
its own rows (`jaxscale.data.prompts`). Each entry becomes a
`DocSource`: a random-access list of documents (token arrays ending with EOS) plus their token
lengths. Documents are addressed by index, so a process reads only the files, lines, row groups
or records of the documents in its own rows. Lengths are free for `tokens` (file sizes) and for
`array_record` shards written by `launch.prepare_data` (a lengths file beside each shard); for
the on-the-fly formats (`text`, `jsonl`, `parquet`) each process tokenizes only its share of the
files and the lengths are shared (`jaxscale.data.doc_index`), so large corpora are still best
prepared once. Bad records raise one-paragraph errors naming the file
and line (or skip and count them with `data.skip_bad_records`).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxscale.data import chat_sources
from jaxscale.data.chat import encoder as chat_encoder
from jaxscale.data.chat import template_hash
from jaxscale.data.doc_index import Exchange, IndexCache, build_index
from jaxscale.data.readers import DataError, JsonlReader, ParquetReader, TextReader, Tokenized
from jaxscale.data.tokenizer import BYTES, file_hash
from jaxscale.errors import ConfigError, paragraph
from jaxscale.storage import data_files

FORMATS = ("text", "jsonl", "parquet", "chat", "preference", "prompts", "array_record",
           "tokens")
TOKEN_BLOCK = 1 << 16  # a `tokens` file is addressed in blocks of this many tokens


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
        if not 0 < w < float("inf"):
            raise ConfigError(paragraph(
                f"{field_name} entry {entry!r} has mixture weight {weight!r}; weights must be",
                "positive finite numbers (a source that should not be read is left out of the",
                "list).",
            ))
        out.append(SourceSpec(fmt, pattern, w))
    return out


def expand(spec: SourceSpec, field_name: str = "data.sources") -> list[str]:
    """The files of a source entry, sorted: a local glob, or a gs:// / s3:// one."""
    if spec.format == "array_record" and not data_files.is_local(spec.glob):
        raise ConfigError(paragraph(
            f"{field_name}: {spec.glob!r} names ArrayRecord shards in a bucket, but the",
            "array_record library reads local files only. Mount the bucket on each host",
            "(gcsfuse, mountpoint-s3) and give the mounted path, or copy the prepared",
            "directory to local disk; text, jsonl, parquet and tokens sources are read from",
            "buckets directly.",
        ))
    files = data_files.glob(spec.glob)
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


def hash_heldout(keys: list[str], fraction: float) -> np.ndarray:
    """True for the keys whose stable hash (32 bits of sha1) is below `fraction`: the same
    split on every run, process and Python, whatever order the keys come in."""
    buckets = np.asarray([int(hashlib.sha1(k.encode()).hexdigest()[:8], 16) for k in keys],
                         np.int64)
    return buckets < fraction * 0x100000000


def check_ids(ids: np.ndarray, vocab_size: int, where: Callable[[], str], first: int,
              fix: str) -> np.ndarray:
    """`ids` unchanged if every id is below `vocab_size` (0: unchecked). An id at or past the
    embedding table is not an error inside XLA (gathers clamp) and trains silently on the wrong
    row, so a block of a pre-tokenized file is checked as it is read: one max on the host per
    block or record, nothing per step on the device. `where()` names the block (asked only on
    the error path) and `first` numbers its first token."""
    if vocab_size and ids.size:
        top = int(ids.max())
        if top >= vocab_size:
            at = int(np.argmax(ids >= vocab_size))
            raise DataError(paragraph(
                f"{where()} holds token id {top} (the first id out of range is token",
                f"{first + at}),",
                f"but model.vocab_size={vocab_size}: every id must be below the vocabulary size",
                f"(this data needs at least {top + 1}).",
                fix,
            ))
    return ids


_LARGER_TOKENIZER = paragraph(
    "The shards were prepared with a larger tokenizer: train with --config.data.tokenizer set",
    "to the tokenizer they were prepared with (the tokenizer.json beside them) and",
    "--config.model.vocab_size at least its size, or prepare the data again with this run's",
    "tokenizer.")


class ArrayRecordReader:
    """Shards of `launch.prepare_data`: one record per document, uint32 tokens (EOS included)."""

    def __init__(self, files: list[str], vocab_size: int = 0):
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
        self.files, self.vocab_size = files, vocab_size
        self.keys = None  # prepared data splits held-out by record index (see file_data)
        self.kind = prepared_kind(files)  # text, or chat / preference records (mask bits)

    def doc(self, i: int) -> np.ndarray:
        try:
            ids = np.frombuffer(self._source[i], dtype=np.uint32)
        except Exception as e:
            raise DataError(paragraph(
                f"Record {i} of the ArrayRecord shards {self.files[0]}... cannot be read",
                f"({type(e).__name__}: {str(e)[:200]}); a shard is truncated or corrupt. Re-run",
                "launch.prepare_data into a fresh directory.",
            )) from None
        check_ids(chat_sources.token_ids(ids, self.kind), self.vocab_size, lambda: self._where(i),
                  0, _LARGER_TOKENIZER)
        return ids

    def _where(self, i: int) -> str:
        """`FILE record J` of the run's record `i` (counts read again: on the error path only)."""
        import grain
        for f in self.files:
            n = len(grain.sources.ArrayRecordDataSource([f]))
            if i < n:
                return f"{f} record {i}"
            i -= n
        return f"record {i} of {self.files[0]}..."

    def lengths(self) -> np.ndarray:
        parts = []
        for f in self.files:  # written by launch.prepare_data beside each shard
            side = f + ".lengths.npy"
            if not os.path.exists(side):
                return np.asarray([len(self.doc(i)) for i in range(self.num_docs)], np.int64)
            parts.append(np.load(side, allow_pickle=False))
        return np.concatenate(parts).astype(np.int64)


def prepared_kind(files: list[str]) -> str:
    """What the records of prepared shards are (`metadata.json`'s format beside them): chat
    conversations or preference pairs, else text."""
    import json
    kinds = set()
    for d in sorted({os.path.dirname(f) for f in files}):
        meta = os.path.join(d, "metadata.json")
        if os.path.exists(meta):
            with open(meta) as f:
                kinds.add(json.load(f).get("format", "text"))
    kinds = {k if k in chat_sources.KINDS else "text" for k in kinds} or {"text"}
    if len(kinds) > 1:
        raise ConfigError(paragraph(
            f"The ArrayRecord shards {files[0]}... were prepared from different formats",
            f"({', '.join(sorted(kinds))}): give each format its own data.sources entry."))
    return kinds.pop()


class TokenFileReader:
    """Flat uint16 / uint32 token files (as nanoGPT writes them), memory-mapped.

    The files carry their own document separators; they are addressed in blocks of
    `TOKEN_BLOCK` tokens, so a process maps in only the blocks of its rows.
    """

    def __init__(self, files: list[str], dtype: str, vocab_size: int = 0):
        if dtype not in ("uint16", "uint32"):
            raise ConfigError(f"data.token_dtype={dtype!r}: use 'uint16' or 'uint32'.")
        self.files, self.dtype, self.vocab_size = files, np.dtype(dtype), vocab_size
        self._fix = paragraph(
            "Set --config.model.vocab_size to the vocabulary the file was tokenized with, or",
            f"check that data.token_dtype={dtype!r} is how it was written.")
        self._blocks = []  # (file, start token, length)
        for f in files:
            size = data_files.size(f)
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
        offset = start * self.dtype.itemsize
        if data_files.is_local(f):
            arr = np.memmap(data_files.local_path(f), dtype=self.dtype, mode="r",
                            offset=offset, shape=(n,))
        else:  # one range request for the block
            arr = np.frombuffer(data_files.read_range(f, offset, offset + n * self.dtype.itemsize),
                                self.dtype)
        return check_ids(np.asarray(arr, dtype=np.uint32), self.vocab_size, lambda: f, start,
                         self._fix)

    def lengths(self) -> np.ndarray:
        return np.asarray([n for _, _, n in self._blocks], np.int64)


def index_cache(spec: SourceSpec, data_config: Any) -> IndexCache | None:
    """The on-disk index cache of `data.index_cache` ('' = none), salted with every setting
    that changes a file's document table."""
    directory = data_config.get("index_cache", "")
    if not directory:
        return None
    tokenizer = data_config.get("tokenizer", BYTES)
    salt = "|".join([spec.format, file_hash(tokenizer), data_config.get("text_field", "text"),
                     str(bool(data_config.get("skip_bad_records", False)))])
    if spec.format in ("chat", "preference"):  # the template makes the ids; pairs: seq_len
        salt += "|" + template_hash(tokenizer, data_config.get("chat_template", ""))
        salt += (f"|{data_config.get('seq_len', 0)}" if spec.format == "preference"
                 else f"|{data_config.get('train_on', 'assistant')}")
    return IndexCache(directory, salt)


def open_source(spec: SourceSpec, data_config: Any, tokenizer: Any,
                field_name: str = "data.sources", shard_index: int = 0, shard_count: int = 1,
                process_index: int = 0, process_count: int = 1,
                exchange: Exchange | None = None, vocab_size: int = 0) -> DocSource:
    """The `DocSource` of one `FORMAT=GLOB` entry, restricted to Lo-Fi shard `shard_index` of
    `shard_count`: whole files of the on-the-fly formats, every `shard_count`-th document of
    the others. On-the-fly formats are indexed here (`jaxscale.data.doc_index`): with `exchange`,
    this process tokenizes only its share of the shard's files. Ids of the pre-tokenized
    formats are checked against `vocab_size` (the model's) as they are read."""
    files = expand(spec, field_name)
    skip = bool(data_config.get("skip_bad_records", False))
    field = data_config.get("text_field", "text")
    if spec.format == "text":
        reader = TextReader(files, tokenizer, skip)
    elif spec.format == "jsonl":
        reader = JsonlReader(files, tokenizer, skip, field)
    elif spec.format == "parquet":
        reader = ParquetReader(files, tokenizer, skip, field)
    elif spec.format == "chat":
        reader = chat_sources.ChatReader(files, tokenizer, skip, _chat_encoder(data_config),
                                         data_config.get("train_on", "assistant"))
    elif spec.format == "preference":
        reader = chat_sources.PreferenceReader(files, tokenizer, skip, _chat_encoder(data_config),
                                               data_config.get("seq_len", 0))
    elif spec.format == "array_record":
        reader = ArrayRecordReader(files, vocab_size)
    else:
        reader = TokenFileReader(files, data_config.get("token_dtype", "uint16"), vocab_size)
    if isinstance(reader, Tokenized):
        if shard_count > 1 and len(files) < shard_count:
            raise ConfigError(paragraph(
                f"{field_name}: {spec.glob!r} matches {len(files)} {spec.format} files but",
                f"lofi.num_workers={shard_count}; each Lo-Fi worker reads whole files of",
                "on-the-fly formats. Split the data into at least as many files as workers,",
                "or prepare it with launch.prepare_data (ArrayRecord is split by record).",
            ))
        if shard_count > 1:
            reader.keep_units(list(range(shard_index, len(files), shard_count)))
        build_index(reader, process_index, process_count, exchange, index_cache(spec,
                                                                                data_config))
        check_not_empty(spec, reader, files, field_name)
        return DocSource(reader)
    check_not_empty(spec, reader, files, field_name)
    return DocSource(reader, np.arange(shard_index, reader.num_docs, shard_count))


def _chat_encoder(data_config: Any) -> Any:
    """The chat encoder of `data.tokenizer` and `data.chat_template`."""
    return chat_encoder(data_config.get("tokenizer", BYTES), data_config.get("chat_template", ""))


def check_not_empty(spec: SourceSpec, reader: Any, files: list[str], field_name: str) -> None:
    """A source whose files hold no document (empty, blank lines only, or every record skipped
    as bad) is named here, not later as a held-out split or a batch with no rows. Lengths are
    looked at only where they are already known (a skipped record has length 0)."""
    if reader.num_docs and (not isinstance(reader, Tokenized) or reader.lengths().any()):
        return
    shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    skipped = getattr(reader, "skipped", 0)
    why = (f"every one of its {skipped} records was skipped as bad (data.skip_bad_records)"
           if skipped else "they are empty or hold only blank lines")
    raise DataError(paragraph(
        f"{field_name}: no documents in {spec.format}={spec.glob!r}: {why} ({shown}).",
        "Add documents to the files, fix the glob, or remove the entry.",
    ))
