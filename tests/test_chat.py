"""Chat templates as Hugging Face defines them, and the chat / preference data built on them.

The oracle is transformers itself: for tokenizer directories saved by transformers with the
published templates of Llama 3, Qwen2 and Gemma and Qwen3's template with `{% generation %}`
markers (`tests/chat_common.py`), `encode_chat` gives the ids of
`AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tokenize=True)`, and where the
template marks generation, transformers' own assistant mask. Without markers the mask is checked
against what each template writes for an assistant turn. Then: bad records in one paragraph, and
prepared shards (`prepare-data --format=chat|preference`) that give the rows the jsonl gives.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxscale.data.chat import encode_chat, split_mask
from jaxscale.data.chat_sources import PairRows
from jaxscale.data.packing import make_rows
from jaxscale.data.readers import SKIP_FLAGS, DataError
from jaxscale.data.sources import SourceSpec, open_source
from jaxscale.data.tokenizer import load_tokenizer
from jaxscale.errors import ConfigError
from tests.chat_common import CONVERSATIONS, tokenizer_dir

# What each template writes for an assistant turn's content, and the end of its turn.
TURN = {"llama3": (str.strip, "<|eot_id|>"), "qwen2": (str, "<|im_end|>"),
        "gemma": (str.strip, "<end_of_turn>")}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tokenizers"))
    return {f: tokenizer_dir(root, f) for f in (*TURN, "qwen3", "qwen3_generation")}


@pytest.mark.parametrize("family", [*TURN, "qwen3_generation"])
def test_ids_and_mask_equal_transformers(tokenizers, family):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizers[family])
    for messages in CONVERSATIONS:
        if family == "gemma" and messages[0]["role"] == "system":
            continue  # Gemma's template refuses a system turn (tested below)
        ids, mask = encode_chat(tokenizers[family], messages)
        assert ids.dtype == np.int32 and mask.dtype == bool and ids.shape == mask.shape
        want = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=family.endswith("generation"))
        assert ids.tolist() == want["input_ids"]
        trained = hf.decode(ids[mask].tolist())
        if family in TURN:
            content, end = TURN[family]
            assert trained == "".join(content(m["content"]) + end for m in messages
                                      if m["role"] == "assistant")
        else:
            assert mask.astype(int).tolist() == want["assistant_masks"]
            assert "fine thanks<|im_end|>" in trained or "jumps" in trained or "good" in trained


def test_template_errors_are_one_paragraph(tokenizers, tmp_path):
    # Qwen3's template writes a <think> block into the last assistant turn only, so without
    # generation markers its earlier turns cannot be read from renders of growing prefixes.
    with pytest.raises(DataError, match=r"renders the turns before assistant message 2"):
        encode_chat(tokenizers["qwen3"], CONVERSATIONS[1])
    # ... unless every token is trained
    from jaxscale.data.chat import encoder
    ids, mask = encoder(tokenizers["qwen3"]).encode(CONVERSATIONS[1], assistant_only=False)
    assert mask.all() and len(ids) > 20
    with pytest.raises(DataError, match="System role not supported"):
        encode_chat(tokenizers["gemma"], CONVERSATIONS[1])
    with pytest.raises(ConfigError, match="has no chat template"):
        _plain_tokenizer(tmp_path, tokenizers["qwen2"])
    # A named template file replaces the directory's own.
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}|{% endfor %}")
    ids, _ = encode_chat(tokenizers["llama3"], CONVERSATIONS[0], str(tmp_path / "t.jinja"))
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(tokenizers["llama3"]).decode(ids.tolist()) == (
        "hello how are you|fine thanks|")


def _plain_tokenizer(tmp_path, src):
    """A tokenizer.json without any chat template beside it."""
    import shutil
    (tmp_path / "plain").mkdir()
    shutil.copy(f"{src}/tokenizer.json", tmp_path / "plain" / "tokenizer.json")
    encode_chat(str(tmp_path / "plain"), CONVERSATIONS[0])


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


def _source(fmt, glob, tok, **data):
    from ml_collections import ConfigDict
    d = ConfigDict({**dict(tokenizer=tok, chat_template="", seq_len=64, skip_bad_records=False,
                           train_on="assistant"), **data})
    return open_source(SourceSpec(fmt, glob), d, load_tokenizer(tok))


@pytest.mark.parametrize("record, match", [
    ({"messages": [{"content": "hi"}]}, r"bad\.jsonl line 2: message 0 has no role"),
    ({"messages": []}, r"bad\.jsonl line 2 has an empty conversation"),
    ({"text": "no messages"}, r"bad\.jsonl line 2 has no conversation"),
])
def test_bad_chat_records_name_file_and_line(tokenizers, tmp_path, record, match):
    good = {"messages": CONVERSATIONS[0]}
    glob = _write(tmp_path / "bad.jsonl", [good, record, good])
    with pytest.raises(DataError, match=match) as error:
        _source("chat", glob, tokenizers["qwen2"])
    assert SKIP_FLAGS in str(error.value)  # train's flag, and evaluate's and prepare-data's
    skipped = _source("chat", glob, tokenizers["qwen2"], skip_bad_records=True)
    assert skipped.reader.skipped == 1 and (skipped.lengths > 0).sum() == 2


def test_preference_pairs_and_a_prompt_longer_than_the_row(tokenizers, tmp_path):
    tok = tokenizers["llama3"]
    pairs = [{"prompt": "is two plus two four", "chosen": "yes", "rejected": "no"},
             {"prompt": [{"role": "user", "content": "hello"}],
              "chosen": [{"role": "assistant", "content": "fine thanks"}],
              "rejected": "bad"}]
    glob = _write(tmp_path / "pairs.jsonl", pairs)
    rows = make_rows(_source("preference", glob, tok), "pack", 63, 0)
    assert isinstance(rows, PairRows) and rows.num_rows == 2
    row = rows.row(0)
    assert set(row) == {"chosen_tokens", "chosen_loss_mask", "rejected_tokens",
                        "rejected_loss_mask"} and all(v.shape == (64,) for v in row.values())
    full, _ = encode_chat(tok, [{"role": "user", "content": "is two plus two four"},
                                {"role": "assistant", "content": "yes"}])
    assert row["chosen_tokens"][:len(full)].tolist() == full.tolist()
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(tok)
    for side, text in (("chosen", "yes<|eot_id|>"), ("rejected", "no<|eot_id|>")):
        assert hf.decode(row[f"{side}_tokens"][row[f"{side}_loss_mask"] > 0].tolist()) == text
    with pytest.raises(DataError, match=r"pairs\.jsonl line 1: the prompt alone is \d+ tokens"):
        _source("preference", glob, tok, seq_len=8)
    missing = _write(tmp_path / "missing.jsonl", [{"prompt": "hi", "chosen": "yes"}])
    with pytest.raises(DataError, match=r"missing\.jsonl line 1 has no 'rejected' response"):
        _source("preference", missing, tok)


def test_a_file_of_identical_pairs_is_refused_and_some_are_counted(tokenizers, tmp_path,
                                                                    capsys):
    tok = tokenizers["llama3"]
    same = [{"prompt": p, "chosen": "yes", "rejected": "yes"} for p in ("hi", "is it four")]
    glob = _write(tmp_path / "same.jsonl", same)
    cache = tmp_path / "index-cache"
    with pytest.raises(DataError, match=r"same\.jsonl: each of its 2 preference pairs has a "
                       r"chosen response identical to its rejected one.*no preference signal"):
        _source("preference", glob, tok, index_cache=str(cache))
    assert not cache.exists()  # nothing of a refused file is cached
    some = _write(tmp_path / "some.jsonl", [*same, {"prompt": "hi", "chosen": "yes",
                                                    "rejected": "no"}])
    assert len(_source("preference", some, tok)) == 3
    assert "some.jsonl: 2 of its 3 preference pairs have identical" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"same\.jsonl: each of its 2"):  # not a bad record
        _source("preference", str(tmp_path / "s*.jsonl"), tok, skip_bad_records=True)


def test_prepare_refuses_a_file_of_identical_pairs_and_counts_some(tokenizers, tmp_path,
                                                                   capsys):
    """`prepare-data --format=preference` checks each file as the jsonl source does (pairs are
    counted per task, so one document per task here: the sums must not double-count)."""
    from jaxscale.data.prepare import prepare

    tok = tokenizers["llama3"]
    same = [{"prompt": p, "chosen": "yes", "rejected": "yes"} for p in ("hi", "is it four")]
    glob = _write(tmp_path / "same.jsonl", same)
    with pytest.raises(DataError, match=r"same\.jsonl: each of its 2 preference pairs.*"
                       r"remove it from --sources"):
        prepare([glob], "preference", str(tmp_path / "refused"), tokenizer=tok)
    assert not (tmp_path / "refused" / "metadata.json").exists()  # never a complete directory
    some = _write(tmp_path / "some.jsonl", [*same, {"prompt": "hi", "chosen": "yes",
                                                    "rejected": "no"}])
    # the refused directory is an interrupted run: a rerun with fixed sources reuses it
    assert prepare([some], "preference", str(tmp_path / "refused"),
                   tokenizer=tok)["documents"] == 3
    assert "some.jsonl: 2 of its 3 preference pairs have identical" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["chat", "preference"])
def test_prepared_shards_give_the_rows_of_the_jsonl(tokenizers, tmp_path, fmt):
    from jaxscale.data.prepare import prepare

    tok = tokenizers["qwen3_generation"]
    records = ([{"messages": m} for m in CONVERSATIONS] if fmt == "chat" else
               [{"prompt": m[0]["content"], "chosen": "yes", "rejected": "no no"}
                for m in CONVERSATIONS])
    glob = _write(tmp_path / "data.jsonl", records)
    out = str(tmp_path / "prepared")
    meta = prepare([glob], fmt, out, tokenizer=tok)
    assert meta["format"] == fmt and meta["documents"] == 3
    prepared = _source("array_record", f"{out}/*.array_record", out)
    direct = _source(fmt, glob, tok)
    assert prepared.reader.kind == fmt
    mine, theirs = (make_rows(s, "pack", 40, 0, masked=True) for s in (prepared, direct))
    assert mine.num_rows == theirs.num_rows
    for r in range(mine.num_rows):
        a, b = mine.row(r), theirs.row(r)
        assert set(a) == set(b) and all((a[k] == b[k]).all() for k in a)
    if fmt == "chat":  # the trained tokens survive the shards (bit 31 of each id)
        ids, mask = split_mask(prepared.doc(0))
        assert mask.any() and not mask.all() and ids.max() < 400
    # The prepared directory renders prompts as the data was rendered.
    assert encode_chat(out, CONVERSATIONS[0])[0].tolist() == encode_chat(
        tok, CONVERSATIONS[0])[0].tolist()


def test_the_byte_tokenizer_renders_chat_with_a_template_file(tmp_path):
    """`data.tokenizer=bytes` with `data.chat_template=FILE`: the ids are the UTF-8 bytes of the
    template's rendering, the trained ones exactly the assistant's (multi-byte characters
    whole); a SentencePiece model is refused by name."""
    import jinja2

    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "t.jinja").write_text(template)
    messages = [{"role": "user", "content": "où ça?"},
                {"role": "assistant", "content": "là-bas ✓"},
                {"role": "user", "content": "merci"},
                {"role": "assistant", "content": "de rien"}]
    ids, mask = encode_chat("bytes", messages, str(tmp_path / "t.jinja"))
    rendered = jinja2.Template(template).render(messages=messages, add_generation_prompt=False)
    assert bytes(ids.tolist()) == rendered.encode("utf-8")
    assert bytes(ids[mask].tolist()) == "là-bas ✓de rien".encode("utf-8")
    glob = _write(tmp_path / "chat.jsonl", [{"messages": messages}])
    source = _source("chat", glob, "bytes", chat_template=str(tmp_path / "t.jinja"))
    assert (source.lengths > 0).sum() == 1
    (tmp_path / "sp.model").write_bytes(b"not read")
    with pytest.raises(ConfigError, match=r"sp\.model' is a SentencePiece model; chat data"):
        encode_chat(str(tmp_path / "sp.model"), messages, str(tmp_path / "t.jinja"))
