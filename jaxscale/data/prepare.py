"""The prepare step: text files -> tokenized ArrayRecord shards + `metadata.json` (+ a tokenizer).

Chat conversations and preference pairs (`--format=chat|preference`, jsonl) are rendered with
the tokenizer's chat template (or `--chat_template=FILE`) into the documents their on-the-fly
sources read (`jaxscale.data.chat_sources`: ids with the trained tokens marked, a pair's two
sides); `metadata.json` names the format, so training reads the shards as what they hold.

`prepare(...)` optionally trains a byte-level BPE tokenizer on the sources with the `tokenizers`
library (`train_tokenizer=VOCAB`, saved as `OUT/tokenizer.json`), then tokenizes the documents
in chunks across `workers` processes (a progress bar counts documents) and writes them in source
order into `num_shards` ArrayRecord files, one record per document (uint32 ids ending with EOS),
each with a `.lengths.npy` beside it so that training plans rows without reading documents.
`metadata.json` is written last (its presence means the directory is complete) and records the
token and document counts, the tokenizer file's sha256 (training checks it against
`config.data.tokenizer`) and the source globs. An existing prepared directory is never overwritten,
nor is a file the step did not write: `--out` must be new, empty, or an interrupted run of this
step (its `.jaxscale-prepare` marker lists the files it writes).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import tqdm

from jaxscale.data.chat import TEMPLATE_FILE, find_template
from jaxscale.data.chat import encoder as chat_encoder
from jaxscale.data.chat_sources import ChatReader, PreferenceReader, check_signal
from jaxscale.data.readers import JsonlReader, ParquetReader, TextReader, bad_record
from jaxscale.data.sources import FORMATS, SourceSpec, expand
from jaxscale.data.tokenizer import encode_document, file_hash, load_tokenizer
from jaxscale.errors import ConfigError, paragraph
from jaxscale.storage import data_files

TEXT_FORMATS = ("text", "jsonl", "parquet", "chat", "preference")
CHAT_FORMATS = ("chat", "preference")
SPECIAL_TOKENS = ("<|endoftext|>", "<pad>")  # EOS and pad of a trained tokenizer
CHUNK = 256  # documents per task handed to a worker


def open_readers(globs: list[str], fmt: str, text_field: str, tokenizer: Any = None,
                 skip_bad: bool = False, chat: tuple[str, str] = ("", "")) -> list[Any]:
    """The readers of `globs`; `chat`: (tokenizer path, template file) for chat formats."""
    if fmt not in TEXT_FORMATS:
        raise ConfigError(paragraph(
            f"--format={fmt!r}: the prepare step reads {', '.join(TEXT_FORMATS)} (the other",
            f"formats, {', '.join(f for f in FORMATS if f not in TEXT_FORMATS)}, are already",
            "tokenized and are trained on directly).",
        ))
    out = []
    for g in globs:
        files = expand(SourceSpec(fmt, g), "--sources")
        if fmt in CHAT_FORMATS:
            encoder = chat_encoder(*chat) if tokenizer is not None else None
            out.append(ChatReader(files, tokenizer, skip_bad, encoder) if fmt == "chat" else
                       PreferenceReader(files, tokenizer, skip_bad, encoder, 0))
        elif fmt == "text":
            out.append(TextReader(files, tokenizer, skip_bad))
        elif fmt == "jsonl":
            out.append(JsonlReader(files, tokenizer, skip_bad, text_field))
        else:
            out.append(ParquetReader(files, tokenizer, skip_bad, text_field))
        out[-1].scan()  # every document is read here anyway
    return out


def _texts(readers: list[Any]) -> Iterator[str]:
    for r in readers:
        for i in range(r.num_docs):
            text = r.text_of(i)
            if text:
                yield text


def train_tokenizer(readers: list[Any], vocab_size: int, path: str) -> None:
    """A byte-level BPE (GPT-2 style) trained on every document; EOS `<|endoftext|>`, pad `<pad>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_texts(readers), trainer=trainer)
    tok.save(path)
    if tok.get_vocab_size() < vocab_size:
        print(f"jaxscale: note: the tokenizer has {tok.get_vocab_size():,} ids, fewer than the "
              f"{vocab_size:,} asked for: the sources offer no more merges (more text gives "
              "more)", file=sys.stderr, flush=True)


_WORKER: dict = {}


def _init_worker(globs: list[str], fmt: str, text_field: str, tokenizer_path: str,
                 skip_bad: bool, chat_template: str = "") -> None:
    tokenizer = load_tokenizer(tokenizer_path)
    _WORKER["readers"] = open_readers(globs, fmt, text_field, tokenizer, skip_bad,
                                      (tokenizer_path, chat_template))


def _tokenize(task: tuple[int, int, int]) -> tuple[list[bytes], int, Counter]:
    """Tokenizes documents [lo, hi) of reader `r`: (records, skipped bad records, and for
    preference pairs, how many were read and how many are identical, keyed (file, "pairs" or
    "same"))."""
    r, lo, hi = task
    reader = _WORKER["readers"][r]
    before = getattr(reader, "skipped", 0)
    if isinstance(reader, PreferenceReader):
        reader.pairs.clear()  # counted per task, summed by the caller
        reader.same.clear()
    records = []
    for i in range(lo, hi):
        if getattr(reader, "kind", "text") in CHAT_FORMATS:  # rendered and marked whole
            doc = reader.doc(i)
            if len(doc):  # empty: a bad record, skipped and counted by the reader
                records.append(doc.astype(np.uint32).tobytes())
            continue
        text = reader.text_of(i)
        ids = encode_document(reader.tokenizer, text) if text is not None else None
        if ids is None or len(ids) - (reader.tokenizer.eos_id is not None) < 1:
            if ids is not None:
                bad_record(reader, i, "is an empty document (shorter than one token)")
            continue
        records.append(ids.astype(np.uint32).tobytes())
    signal = Counter({(f, k): n for k, counts in (("pairs", getattr(reader, "pairs", {})),
                                                  ("same", getattr(reader, "same", {})))
                      for f, n in counts.items()})
    return records, getattr(reader, "skipped", 0) - before, signal


MARKER = ".jaxscale-prepare"  # written first: names what this step writes into --out


def check_args(out: str, tokenizer: str, num_shards: int, workers: int, train_vocab: int
               ) -> None:
    """The flags that need no reading, checked before anything is created."""
    if not data_files.is_local(out):
        raise ConfigError(paragraph(
            f"--out={out}: the prepared dataset is written as ArrayRecord shards, which the",
            "array_record library writes (and training reads) as local files only. Give a local",
            "directory or a mounted bucket (gcsfuse, mountpoint-s3); --sources may be",
            "gs:// or s3:// globs.",
        ))
    for flag, value in (("--num_shards", num_shards), ("--workers", workers)):
        if value < 1:
            raise ConfigError(paragraph(
                f"{flag}={value}: give at least 1 (e.g. {flag}=4).",
            ))
    if train_vocab < 0 or not (tokenizer or train_vocab) or (tokenizer and train_vocab):
        raise ConfigError("Give exactly one of --tokenizer=PATH and --train_tokenizer=VOCAB "
                          "(a positive vocabulary size).")
    base = 256 + len(SPECIAL_TOKENS)  # every byte, then EOS and pad: ids before any merge
    if 0 < train_vocab <= base:
        raise ConfigError(paragraph(
            f"--train_tokenizer={train_vocab}: a byte-level BPE starts with {base} ids (the 256",
            f"bytes, {' and '.join(SPECIAL_TOKENS)}), so it learns merges only past that. Give",
            "a larger vocabulary (e.g. --train_tokenizer=4096), or --tokenizer=bytes for bytes",
            "alone.",
        ))


def check_chat_args(fmt: str, tokenizer: str, train_vocab: int, chat_template: str) -> None:
    """Chat formats need the tokenizer their template was written for (its special tokens)."""
    if fmt not in CHAT_FORMATS:
        return
    if train_vocab:
        raise ConfigError(paragraph(
            f"--format={fmt} renders records with a chat template, whose special tokens belong",
            "to the tokenizer it was written for; a tokenizer trained here would lack them.",
            "Give --tokenizer=DIR (a chat model's tokenizer directory) instead of",
            "--train_tokenizer."))
    find_template(tokenizer, chat_template)  # no template: one paragraph, before any work


def claim_out(out: str, names: list[str]) -> None:
    """Makes `out` this step's directory, or refuses with one paragraph: it holds a prepared
    dataset, it is not a directory, it holds files the prepare step did not write (they are
    never overwritten), or it cannot be written. An interrupted earlier run's files (listed in
    its `MARKER`) are removed first, so no stale shard of it is left for a glob to find."""
    if os.path.exists(os.path.join(out, "metadata.json")):
        raise ConfigError(paragraph(
            f"{out} already holds a prepared dataset (metadata.json); it is never overwritten.",
            "Choose another --out directory, or delete this one first.",
        ))
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out={out} is a file, not a directory; choose a new directory.")
    entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
    ours = ({MARKER, "metadata.json.tmp", *_previous_names(out)} if MARKER in entries
            else set())
    foreign = [e for e in entries if e not in ours]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3
                                          else "")
        raise ConfigError(paragraph(
            f"--out={out} is not empty and is not a prepare output: it holds {shown}, which",
            "the prepare step did not write and will not overwrite. Give a new or empty",
            "directory.",
        ))
    try:
        os.makedirs(out, exist_ok=True)
        for e in entries:
            os.remove(os.path.join(out, e))
        with open(os.path.join(out, MARKER), "w") as f:
            json.dump(names, f)
    except OSError as e:
        raise ConfigError(paragraph(
            f"--out={out} cannot be written ({e.strerror or e}: {e.filename or out}): a",
            "read-only filesystem, a path below a regular file, or no permission. Give a",
            "writable local directory.",
        )) from None


def _previous_names(out: str) -> list[str]:
    try:
        with open(os.path.join(out, MARKER)) as f:
            names = json.load(f)
        return [n for n in names if isinstance(n, str) and os.sep not in n]
    except (OSError, ValueError):
        return []


def prepare(globs: list[str], fmt: str, out: str, tokenizer: str = "", num_shards: int = 1,
            workers: int = 1, train_vocab: int = 0, text_field: str = "text",
            skip_bad: bool = False, chat_template: str = "") -> dict:
    """Writes the prepared dataset into `out` and returns its metadata."""
    check_args(out, tokenizer, num_shards, workers, train_vocab)
    check_chat_args(fmt, tokenizer, train_vocab, chat_template)
    readers = open_readers(globs, fmt, text_field, None, skip_bad)
    if not sum(r.num_docs for r in readers):
        raise ConfigError(paragraph(
            f"--sources={','.join(globs)} hold no {fmt} documents (the files are empty), so",
            "there is nothing to prepare and nothing was written. Point --sources at files with",
            "at least one record."))
    src = ""
    if not train_vocab and tokenizer != "bytes":
        from jaxscale.data.tokenizer import resolve_path
        src = resolve_path(tokenizer)
    tok_path = (os.path.join(out, "tokenizer.json") if train_vocab else
                os.path.join(out, os.path.basename(src)) if src else "bytes")
    # Chat records are rendered with the source tokenizer's template (or the named file); `out`
    # then carries that template and the special tokens it reads, so `data.tokenizer=OUT`
    # renders prompts (`generate --chat`) as the data was rendered.
    chat = fmt in CHAT_FORMATS
    render_with = src if chat else tok_path
    copied = [n for n in ("tokenizer_config.json", "special_tokens_map.json")
              if chat and os.path.isfile(os.path.join(os.path.dirname(src), n))]
    names = [f"data-{k:05d}-of-{num_shards:05d}.array_record" for k in range(num_shards)]
    claim_out(out, names + [n + ".lengths.npy" for n in names] + copied
              + ([TEMPLATE_FILE] if chat else [])
              + ([os.path.basename(tok_path)] if tok_path != "bytes" else []))
    if train_vocab:
        train_tokenizer(readers, train_vocab, tok_path)
    elif src:
        shutil.copyfile(src, tok_path)  # the prepared data carries its tokenizer
    for name in copied:
        shutil.copyfile(os.path.join(os.path.dirname(src), name), os.path.join(out, name))
    if chat:
        with open(os.path.join(out, TEMPLATE_FILE), "w", encoding="utf-8") as f:
            f.write(find_template(src, chat_template))
    load_tokenizer(tok_path)  # fails clearly before any worker starts
    init = (globs, fmt, text_field, render_with, skip_bad, chat_template)
    lengths, skipped, signal = _write_shards(readers, out, names, init, workers)
    for path in sorted({f for f, _ in signal}):  # before metadata.json: never a complete dir
        check_signal(path, signal[path, "pairs"], signal[path, "same"], "--sources")
    seen = sum(map(len, lengths))
    meta = {"format_version": 1, "documents": seen, "tokens": int(sum(map(sum, lengths))),
            "skipped_records": skipped, "sources": list(globs), "format": fmt,
            "tokenizer": tok_path, "tokenizer_hash": file_hash(tok_path),
            "shards": [{"file": n, "documents": len(ls), "tokens": int(sum(ls))}
                       for n, ls in zip(names, lengths)]}
    with open(os.path.join(out, "metadata.json.tmp"), "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(os.path.join(out, "metadata.json.tmp"), os.path.join(out, "metadata.json"))
    os.remove(os.path.join(out, MARKER))  # metadata.json now marks the directory complete
    return meta


def _write_shards(readers: list[Any], out: str, names: list[str], init: tuple, workers: int
                  ) -> tuple[list[list[int]], int, Counter]:
    """Tokenizes every document across `workers` processes and writes them in source order
    into the shards `names`: (token lengths per shard, skipped bad records, `_tokenize`'s
    preference-pair counts summed)."""
    from array_record.python.array_record_module import ArrayRecordWriter
    total_docs = sum(rd.num_docs for rd in readers)
    chunk = max(1, min(CHUNK, total_docs // (4 * workers)))  # keep every worker busy
    tasks = [(r, lo, min(lo + chunk, rd.num_docs)) for r, rd in enumerate(readers)
             for lo in range(0, rd.num_docs, chunk)]
    shard_of = lambda doc: min(len(names) - 1, doc * len(names) // max(total_docs, 1))
    writers = [ArrayRecordWriter(os.path.join(out, n), "group_size:1") for n in names]
    lengths: list[list[int]] = [[] for _ in names]
    skipped, seen, signal = 0, 0, Counter()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, _init_worker, init) if workers > 1 else _Inline(init) as pool, \
            tqdm.tqdm(total=total_docs, unit="doc", desc="prepare") as bar:
        for (records, bad, counts), (_, lo, hi) in zip(pool.imap(_tokenize, tasks), tasks):
            for rec in records:
                k = shard_of(seen)
                writers[k].write(rec)
                lengths[k].append(len(rec) // 4)
                seen += 1
            skipped, signal = skipped + bad, signal + counts
            bar.update(hi - lo)
    for w in writers:
        w.close()
    for n, lens in zip(names, lengths):
        np.save(os.path.join(out, n + ".lengths.npy"), np.asarray(lens, np.int64))
    return lengths, skipped, signal


class _Inline:
    """A one-process stand-in for a Pool (workers=1): same code path, no process start-up."""

    def __init__(self, init: tuple):
        _init_worker(*init)

    def imap(self, fn, tasks):
        return map(fn, tasks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
