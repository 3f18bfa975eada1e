"""Chat conversations -> token ids and the mask of the tokens the model is trained to produce.

The template is the tokenizer directory's own, as transformers saves it (`chat_template.jinja`,
or `chat_template` in `tokenizer_config.json`), or a file named by `data.chat_template`. It is
rendered as transformers renders it: jinja2's immutable sandbox (templates from the Hub are
untrusted code), `trim_blocks` / `lstrip_blocks`, the loop controls, `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) as variables; the text is then tokenized without added special
tokens. So `encode_chat(dir, messages)[0]` equals
`AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=True)` (tested on
Llama 3, Qwen and Gemma templates and one with generation markers, tests/test_chat.py).

Which tokens are trained (the mask): a template with `{% generation %}` ... `{% endgeneration %}`
marks them itself, as transformers' `return_assistant_tokens_mask` reads it. For the others
(most published templates), an assistant turn is the text between the conversation rendered up
to it with the generation prompt and the conversation rendered through it, less the whitespace
the template writes after the turn: its content and its end-of-turn token, which the model must
learn to produce. A token is trained when its characters overlap such a span (transformers'
rule). A template that renders earlier turns differently once later ones follow cannot be read
this way: it is refused in one paragraph (add generation markers, or `data.train_on=all`).

Documents carry their mask in their ids: bit 31 of a uint32 id is set on a trained token
(`MASK_BIT`; no vocabulary comes near 2**31), so packing, length indexes, caches and prepared
ArrayRecord shards hold chat documents exactly as they hold text.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from jaxscale.data.readers import SKIP_FLAGS, DataError
from jaxscale.data.tokenizer import BYTES, resolve_path
from jaxscale.errors import ConfigError, paragraph

MASK_BIT = np.uint32(1 << 31)
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_REASONING = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, in order
# (rendered blocks, spans) while `ChatTemplate.render` tracks `{% generation %}` blocks; a
# context variable, so that data threads rendering at once each track their own.
_TRACKED: contextvars.ContextVar = contextvars.ContextVar("chat_generation", default=None)


def with_mask(ids: Sequence[int], mask: Sequence[bool]) -> np.ndarray:
    """A document: uint32 `ids` with `MASK_BIT` set where `mask` is true."""
    ids = np.asarray(ids, np.uint32)
    return np.where(np.asarray(mask, bool), ids | MASK_BIT, ids)


def split_mask(doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of a document written by `with_mask` (a text document: mask all false)."""
    doc = np.asarray(doc, np.uint32)
    return (doc & ~MASK_BIT).astype(np.uint32), (doc & MASK_BIT) != 0


def _directory(tokenizer: str) -> str:
    """The directory of a tokenizer spec (its own directory, or the one holding the file)."""
    path = resolve_path(tokenizer)
    return os.path.dirname(path)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def find_template(tokenizer: str, template_file: str = "") -> str:
    """The chat template text: `template_file` (`data.chat_template`), else the tokenizer
    directory's `chat_template.jinja`, else its `tokenizer_config.json`'s `chat_template` (a
    named set of templates gives its `default`)."""
    if template_file:
        if not os.path.isfile(template_file):
            raise ConfigError(paragraph(
                f"data.chat_template={template_file!r} does not exist. Name a Jinja chat",
                "template file (as transformers saves it, chat_template.jinja), or leave it",
                "empty to use the tokenizer directory's own template."))
        with open(template_file, encoding="utf-8") as f:
            return f.read()
    if tokenizer in ("", BYTES):
        raise ConfigError(paragraph(
            "Chat data needs a tokenizer with a chat template, but data.tokenizer is the",
            "byte-level default. Set --config.data.tokenizer to a Hugging Face tokenizer",
            "directory that carries its chat template, or add --config.data.chat_template=FILE."))
    directory = _directory(tokenizer)
    if os.path.isfile(os.path.join(directory, TEMPLATE_FILE)):
        with open(os.path.join(directory, TEMPLATE_FILE), encoding="utf-8") as f:
            return f.read()
    found = _read_json(os.path.join(directory, "tokenizer_config.json")).get("chat_template")
    if isinstance(found, list):  # [{"name": ..., "template": ...}, ...]
        found = {t.get("name"): t.get("template") for t in found}.get("default")
    if not isinstance(found, str) or not found:
        raise ConfigError(paragraph(
            f"The tokenizer directory {directory} has no chat template (no {TEMPLATE_FILE} and",
            "no chat_template in tokenizer_config.json). Use the tokenizer of a chat model, or",
            "name a template file with --config.data.chat_template=FILE."))
    return found


def special_tokens(tokenizer: str) -> dict[str, str]:
    """The named special tokens the template sees (`bos_token`, ...), as transformers reads
    them: `tokenizer_config.json`, then `special_tokens_map.json` (strings or added-token
    dicts)."""
    if tokenizer in ("", BYTES):
        return {}
    directory = _directory(tokenizer)
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        for key, value in _read_json(os.path.join(directory, name)).items():
            if key in SPECIAL_TOKENS and value is not None:
                found[key] = value["content"] if isinstance(value, dict) else str(value)
    return found


@functools.cache
def _environment() -> Any:
    """transformers' template environment: an immutable sandbox with its globals and filters,
    plus the `{% generation %}` tag, which records the character spans it renders."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(
                lineno)

        def _track(self, caller: Any) -> str:
            text = caller()
            tracked = _TRACKED.get()
            if tracked is not None:
                start = len("".join(tracked[0]))
                tracked[1].append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, tokens: Mapping[str, str], where: str = "the chat template"):
        import jinja2

        self.source, self.tokens = source, dict(tokens)
        self.marks_generation = bool(_GENERATION.search(source))
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ConfigError(paragraph(
                f"The chat template of {where} is not valid Jinja ({e.message}, template line",
                f"{e.lineno}). Fix the template (data.chat_template names a template file of",
                "your own), or use the one the tokenizer directory was saved with.")) from None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False
               ) -> tuple[str, list[tuple[int, int]]]:
        """(text, character spans of its `{% generation %}` blocks)."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _TRACKED.set((blocks, spans))
        try:
            for block in self._template.generate(messages=list(messages), tools=None,
                                                 documents=None,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **self.tokens):
                blocks.append(block)
        finally:
            _TRACKED.reset(token)
        return "".join(blocks), spans


# Where a record is, for its errors: a string, or a function asked only on the error path (naming
# a jsonl line reads the file up to it).
Where = str | Callable[[], str]


def _at(where: Where) -> str:
    return where() if callable(where) else where


def check_messages(messages: Any, where: Where) -> list[dict]:
    """`messages` as a list of dicts, or a one-paragraph DataError naming `where`."""
    if not isinstance(messages, list) or not messages:
        raise DataError(paragraph(
            f"{_at(where)} has {'an empty' if messages == [] else 'no'} conversation: `messages` must",
            "be a non-empty list of {\"role\": ..., \"content\": ...} objects. Fix or remove",
            f"the record (or skip bad records: {SKIP_FLAGS})."))
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise DataError(paragraph(
                f"{_at(where)}: message {k} has no role ({json.dumps(m)[:80]}). Every message needs",
                "a \"role\" (system, user, assistant, ...) and its \"content\". Fix or remove",
                f"the record (or skip bad records: {SKIP_FLAGS})."))
    out = []
    for m in messages:  # None values dropped and reasoning aliased, as transformers does
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING if k in m), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m,
                                                "reasoning_content": reasoning})
    return out


class ChatEncoder:
    """Conversations -> (ids, trained-token mask) with one tokenizer and its chat template."""

    def __init__(self, tokenizer: str, template_file: str = ""):
        from tokenizers import Tokenizer

        self.template = ChatTemplate(find_template(tokenizer, template_file),
                                     special_tokens(tokenizer), template_file or tokenizer)
        if tokenizer in ("", BYTES):
            self._tok: Any = _BytesWithOffsets()
        elif resolve_path(tokenizer).endswith(".model"):
            raise ConfigError(paragraph(
                f"data.tokenizer={tokenizer!r} is a SentencePiece model; chat data is rendered",
                "with a Hugging Face tokenizer (tokenizer.json, which gives each token's",
                "characters, how the trained tokens are found). Use the model's tokenizer.json",
                "(`jaxscale convert --from_hf` copies it), or the byte tokenizer with",
                "--config.data.chat_template=FILE."))
        else:
            self._tok = Tokenizer.from_file(resolve_path(tokenizer))

    def _render(self, messages: list[dict], where: Where, generation_prompt: bool = False
                ) -> tuple[str, list[tuple[int, int]]]:
        import jinja2
        try:
            return self.template.render(messages, generation_prompt)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(paragraph(
                f"{_at(where)}: the chat template refused the conversation ({e}). Fix the record to",
                "what the template accepts (e.g. alternating user/assistant turns), or remove",
                f"it (or skip such records: {SKIP_FLAGS}).")) from None

    def _assistant_spans(self, messages: list[dict], text: str, where: Where
                         ) -> list[tuple[int, int]]:
        """Character spans of the assistant turns, from renders of growing prefixes."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], where, True)[0] if i else ""
            through = self._render(messages[:i + 1], where)[0]
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(paragraph(
                    f"{_at(where)}: the chat template renders the turns before assistant message {i}",
                    "differently once later turns follow, so which tokens are the assistant's",
                    "cannot be read from it. Use a template with {% generation %} markers",
                    "(--config.data.chat_template=FILE), or train on every token",
                    "(--config.data.train_on=all, reading the jsonl on the fly)."))
            spans.append((len(before), len(before) + len(through[len(before):].rstrip())))
        return spans

    def _text(self, messages: list[dict], where: Where, assistant_only: bool = True
              ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its trained tokens (every
        character unless `assistant_only`)."""
        text, spans = self._render(messages, where)
        if not assistant_only:
            return text, [(0, len(text))]
        if not self.template.marks_generation:
            spans = self._assistant_spans(messages, text, where)
        return text, spans

    def _tokens(self, text: str, spans: list[tuple[int, int]]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, mask, character offsets (n, 2)) of `text`: a token is trained when its
        characters overlap a span (transformers' rule)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
        mask = np.zeros(len(encoding.ids), bool)
        for lo, hi in spans:
            mask |= (offsets[:, 0] < hi) & (offsets[:, 1] > lo)
        return np.asarray(encoding.ids, np.int32), mask, offsets

    def encode(self, messages: Any, where: Where = "the conversation",
               assistant_only: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(int32 ids, bool mask): the rendered conversation's tokens, and true on those the
        model is trained to produce (see the module docstring; every token unless
        `assistant_only`, as `data.train_on=all` reads them)."""
        messages = check_messages(messages, where)
        ids, mask, _ = self._tokens(*self._text(messages, where, assistant_only))
        return ids, mask

    def prompt_ids(self, messages: Any, where: Where = "the prompt") -> np.ndarray:
        """The ids a model continues to answer `messages`: rendered with the generation
        prompt (what `jaxscale generate --chat` feeds the model)."""
        text, _ = self._render(check_messages(messages, where), where, True)
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_response(self, prompt: Any, response: Any, where: Where
                        ) -> tuple[np.ndarray, np.ndarray, int]:
        """(ids, mask, prompt tokens) of `prompt` followed by `response`: the mask is the
        chat mask restricted to the response (what a preference objective scores), the prompt
        tokens those that start before the response's text."""
        prompt = check_messages(prompt, where)
        ids, mask, offsets = self._tokens(*self._text(prompt + check_messages(response, where),
                                                      where))
        in_prompt = offsets[:, 0] < len(self._render(prompt, where, True)[0])
        return ids, mask & ~in_prompt, int(in_prompt.sum())


class _BytesWithOffsets:
    """The byte tokenizer (`data.tokenizer=bytes`) as `ChatEncoder` reads a tokenizer: an
    encoding's ids (UTF-8 bytes) and each id's character span (every byte of a character
    spans that character)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> Any:
        from types import SimpleNamespace

        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for i, char in enumerate(text):
            encoded = char.encode("utf-8")
            ids.extend(encoded)
            offsets.extend([(i, i + 1)] * len(encoded))
        return SimpleNamespace(ids=ids, offsets=offsets)


@functools.lru_cache(maxsize=8)
def encoder(tokenizer: str, template_file: str = "") -> ChatEncoder:
    """The (cached) encoder of a tokenizer and template."""
    return ChatEncoder(tokenizer, template_file)


def encode_chat(tokenizer_path: str, messages: Sequence[Mapping[str, Any]],
                chat_template: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, bool mask) of `messages` rendered with the chat template of the tokenizer
    at `tokenizer_path` (or the template file `chat_template`): the ids equal transformers'
    `apply_chat_template(messages, tokenize=True)`, the mask is true on the tokens the model is
    trained to produce (the assistant's, or what `{% generation %}` marks)."""
    return encoder(tokenizer_path, chat_template).encode(list(messages))


def template_hash(tokenizer: str, template_file: str = "") -> str:
    """What identifies the template a chat source is read with (for index caches)."""
    try:
        text = find_template(tokenizer, template_file)
    except ConfigError:
        return ""
    return hashlib.sha256(text.encode()).hexdigest()
