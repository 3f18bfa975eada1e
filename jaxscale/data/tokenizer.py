"""Tokenizers by location: a Hugging Face `tokenizer.json`, a SentencePiece `.model`, or bytes.

`config.data.tokenizer` names one of them: `bytes` (the byte-level default, ids 0..255 with no
special tokens, as the stdlib demo uses), a path to a `tokenizer.json` or to a directory holding
one (as a converted Llama carries), or a path to a SentencePiece `.model`. The libraries made for
the job do the work (`tokenizers`, `sentencepiece`); this module only opens them behind one small
interface and reads their BOS / EOS / pad ids. `file_hash` identifies a tokenizer file so that a
prepared dataset can refuse to be trained with another tokenizer. A tokenizer in a bucket
(`gs://`, `s3://`: a converted model written there carries its tokenizer.json) is copied once
into a local cache, since both libraries read local files only.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from jaxscale.errors import ConfigError, paragraph
from jaxscale.storage import data_files, locations

BYTES = "bytes"
# Special-token spellings looked up in a tokenizer.json, in order of preference.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<|bos|>", "<bos>", "[CLS]")
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|eos|>", "<eos>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_id(self, name: str) -> int | None:
        """The id of the special token `name` (e.g. an end-of-turn marker), None if absent."""


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255. The NUL byte (0), which text files do not contain, ends each
    document (EOS) and pads rows, so the byte vocabulary stays 256."""

    vocab_size: int = 256
    bos_id: int | None = None
    eos_id: int | None = 0
    pad_id: int = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_id(self, name: str) -> int | None:
        return None  # bytes have no special tokens

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` read from its `tokenizer.json`."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok
        self.path = path
        self._tok = _Tok.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._first_id(_BOS_NAMES)
        self.eos_id = self._first_id(_EOS_NAMES)
        pad = self._first_id(_PAD_NAMES)
        self.pad_id = pad if pad is not None else (self.eos_id or 0)

    def _first_id(self, names: tuple[str, ...]) -> int | None:
        return next((i for i in map(self.token_id, names) if i is not None), None)

    def token_id(self, name: str) -> int | None:
        i = self._tok.token_to_id(name)
        return None if i is None else int(i)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


class SentencePieceTokenizer:
    """A SentencePiece `.model` (Llama 1/2, Gemma, T5 style)."""

    def __init__(self, path: str):
        import sentencepiece as spm
        self.path = path
        self._sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = int(self._sp.get_piece_size())
        as_id = lambda i: int(i) if i >= 0 else None
        self.bos_id, self.eos_id = as_id(self._sp.bos_id()), as_id(self._sp.eos_id())
        pad = as_id(self._sp.pad_id())
        self.pad_id = pad if pad is not None else (self.eos_id or 0)

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def token_id(self, name: str) -> int | None:
        i = int(self._sp.piece_to_id(name))  # an unknown piece maps to <unk>'s id
        return i if self._sp.id_to_piece(i) == name else None


CACHE_DIR = os.path.join("~", ".cache", "jaxscale", "tokenizers")


def _local_copy(url: str) -> str:
    """The tokenizer file a bucket URL names (itself, or a directory's tokenizer.json /
    tokenizer.model), copied once per object version into CACHE_DIR."""
    names = ("tokenizer.json", "tokenizer.model")
    candidates = [url] if url.endswith((".json", ".model")) else [locations.join(url, n)
                                                                   for n in names]
    for candidate in candidates:
        try:
            version = data_files.fingerprint(candidate)
        except (FileNotFoundError, OSError):
            continue
        digest = hashlib.sha1(version.encode()).hexdigest()[:16]
        local = os.path.join(os.path.expanduser(CACHE_DIR), digest, candidate.rsplit("/", 1)[1])
        if not os.path.isfile(local):
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with data_files.open_binary(candidate) as f:
                data = f.read()
            tmp = f"{local}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, local)
        return local
    raise ConfigError(paragraph(
        f"data.tokenizer={url!r}: no tokenizer.json or tokenizer.model there. Point it at the",
        "tokenizer file itself or at a directory holding one (a `launch.convert --out` in a",
        "bucket carries the model's tokenizer).",
    ))


def resolve_path(spec: str) -> str:
    """The tokenizer file `spec` names (a directory means its tokenizer.json / tokenizer.model);
    a bucket URL gives its local cached copy."""
    if not data_files.is_local(spec):
        return _local_copy(spec)
    if os.path.isdir(spec):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(spec, name)):
                return os.path.join(spec, name)
        raise ConfigError(paragraph(
            f"data.tokenizer={spec!r} is a directory without a tokenizer.json or tokenizer.model.",
            "Point it at the tokenizer file itself, at a `launch.convert --from_hf` output (which",
            "copies the tokenizer), or a `launch.prepare_data --train_tokenizer` output.",
        ))
    if not os.path.isfile(spec):
        raise ConfigError(paragraph(
            f"data.tokenizer={spec!r} does not exist. Use 'bytes' (byte-level, no file), a",
            "tokenizer.json, a directory holding one, or a SentencePiece .model file.",
        ))
    return spec


def load_tokenizer(spec: str = BYTES) -> Any:
    """Opens the tokenizer `spec` names; errors name the path and what would work."""
    if spec in ("", BYTES):
        return ByteTokenizer()
    path = resolve_path(spec)
    try:
        if path.endswith(".model"):
            return SentencePieceTokenizer(path)
        return HFTokenizer(path)
    except Exception as e:  # the libraries raise bare exceptions on unreadable files
        raise ConfigError(paragraph(
            f"data.tokenizer={spec!r}: {path} could not be read as a",
            "SentencePiece model" if path.endswith(".model") else "Hugging Face tokenizer.json",
            f"({type(e).__name__}: {str(e)[:200]}). Check that the file is complete, or",
            "re-create it (e.g. `launch.prepare_data --train_tokenizer=VOCAB`).",
        )) from None


def file_hash(spec: str) -> str:
    """sha256 of the tokenizer file (`bytes` for the byte tokenizer): names the tokenizer."""
    if spec in ("", BYTES):
        return BYTES
    h = hashlib.sha256()
    with open(resolve_path(spec), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_vocab(tokenizer: Any, model_vocab: int, spec: str) -> None:
    """A model smaller than the tokenizer's vocabulary cannot embed its ids (larger is padding)."""
    if model_vocab < tokenizer.vocab_size:
        raise ConfigError(paragraph(
            f"model.vocab_size={model_vocab} is smaller than the {tokenizer.vocab_size} tokens of",
            f"data.tokenizer={spec!r}: ids past {model_vocab - 1} would index outside the",
            f"embedding. Use --config.model.vocab_size={tokenizer.vocab_size} or larger (a",
            "padded vocabulary, e.g. a multiple of 128, is allowed).",
        ))


def encode_document(tokenizer: Any, text: str) -> np.ndarray:
    """A document's ids followed by EOS (when the tokenizer has one), as uint32."""
    ids = tokenizer.encode(text)
    if tokenizer.eos_id is not None:
        ids = list(ids) + [tokenizer.eos_id]
    return np.asarray(ids, dtype=np.uint32)


def model_tokenizer(config: Any, *dirs: str) -> Any | None:
    """The tokenizer a model carries: a tokenizer file in its directory (a `launch.convert`
    output, a HF directory), else its training config's `data.tokenizer`; None for a
    byte-level model trained without one (generation then reads the prompt as bytes)."""
    for d in dirs:
        if d and not data_files.is_local(d):
            try:
                return load_tokenizer(d)
            except ConfigError:  # no tokenizer file in that bucket directory
                continue
        if d and os.path.isdir(d) and any(os.path.isfile(os.path.join(d, n))
                                          for n in ("tokenizer.json", "tokenizer.model")):
            return load_tokenizer(d)
    spec = config.get("data", {}).get("tokenizer", BYTES) if hasattr(config, "get") else BYTES
    if spec in ("", BYTES):
        return None
    return load_tokenizer(spec)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja")


def run_tokenizer_dir(run_config: Any, *dirs: str) -> str | None:
    """The local directory holding a model's tokenizer files: the first of `dirs` that has a
    tokenizer (a `launch.convert` output, a HF directory), else the directory of its training
    config's `data.tokenizer`; None for a byte-level model."""
    for d in dirs:
        if d and os.path.isdir(d) and any(os.path.isfile(os.path.join(d, n))
                                          for n in ("tokenizer.json", "tokenizer.model")):
            return d
    spec = (run_config or {}).get("data", {}).get("tokenizer", BYTES)
    if spec in ("", BYTES) or not data_files.is_local(spec):
        return None
    path = resolve_path(spec)
    return os.path.dirname(path)


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copies a model directory's tokenizer files (so a converted model carries its tokenizer)."""
    import shutil
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src_dir, name)):
            shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))
            copied.append(name)
    return copied
