"""Tokenizers by location: bytes, a tokenizer.json (or its directory), a SentencePiece model."""

import io

import pytest

from jaxscale.data.tokenizer import check_vocab, encode_document, file_hash, load_tokenizer
from jaxscale.errors import ConfigError


def test_bytes_tokenizer_round_trips_and_ends_documents_with_eos():
    tok = load_tokenizer("bytes")
    ids = encode_document(tok, "héllo")
    assert ids[-1] == tok.eos_id == 0 and tok.decode(ids.tolist()) == "héllo"
    assert file_hash("bytes") == "bytes"


def test_sentencepiece_model_gives_special_ids(tmp_path):
    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["the quick brown fox jumps"] * 50),
                                   model_writer=model, vocab_size=40, model_type="bpe")
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    tok = load_tokenizer(str(tmp_path))  # a directory holding tokenizer.model
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 40)
    assert tok.decode(tok.encode("the fox")) == "the fox"
    # special tokens by name (a rollout's stop ids): EOS found, an absent one is None, not <unk>
    assert tok.token_id("</s>") == tok.eos_id and tok.token_id("<|im_end|>") is None
    with pytest.raises(ConfigError, match="model.vocab_size=32 is smaller than the 40 tokens"):
        check_vocab(tok, 32, str(tmp_path))
    check_vocab(tok, 64, str(tmp_path))  # a padded vocabulary is fine


def test_missing_and_unreadable_tokenizers_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match="without a tokenizer.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"trunc')
    with pytest.raises(ConfigError, match="could not be read as a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path))
