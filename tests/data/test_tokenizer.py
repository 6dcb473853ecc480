"""Tokenizers: exact round trips, end-of-text handling, BPE training determinism, loading, errors."""

from __future__ import annotations

import numpy as np
import pytest

from kimik3.data.errors import DataError
from kimik3.data.tokenizer import EOT_TEXT, BpeTokenizer, ByteTokenizer, check_tokenizer_choice

TEXT = "def f(x):\n    return x ** 2  # naïve — 数学 🚀\n"


def test_byte_round_trip_and_ids():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids.tolist() == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.decode([*ids, tok.eot_id, *tok.encode("next")]) == TEXT + EOT_TEXT + "next"
    assert (tok.vocab_size, tok.eot_id) == (257, 256)


def _train(texts, vocab=300):
    return BpeTokenizer.train(iter(texts), vocab, progress=False)


def test_bpe_trained_round_trip_and_determinism():
    texts = [TEXT * 3, "for i in range(10):\n    print(i)\n" * 5, "plain words and more words\n" * 4]
    a, b = _train(texts), _train(texts)
    assert a.identity == b.identity  # same corpus + vocab -> same tokenizer (sha256 of its JSON)
    for t in texts + ["unseen: ÿ 🤖 \t\r\n"]:  # byte-level: no unknown tokens, exact decode
        assert a.decode(a.encode(t)) == t
    assert a.decode(a.encode("x").tolist() + [a.eot_id]) == "x" + EOT_TEXT
    assert a.vocab_size <= 300 and a.identity["sha256"] != _train(texts, vocab=280).identity["sha256"]


def test_bpe_load_from_file_matches_trained(tmp_path):
    trained = _train([TEXT * 4])
    trained.save(tmp_path / "tokenizer.json")
    loaded = BpeTokenizer.from_file(tmp_path / "tokenizer.json")
    assert loaded.identity == trained.identity
    np.testing.assert_array_equal(loaded.encode(TEXT), trained.encode(TEXT))


def test_bpe_encodes_special_token_text_in_a_document_as_text(tmp_path):
    """Only the separator the pipeline appends is end-of-text: a document that quotes the marker (or
    another special token of a loaded tokenizer.json) must not split into two documents."""
    trained = _train([TEXT * 4])
    trained.save(tmp_path / "tokenizer.json")
    doc = f"print('{EOT_TEXT}')\n"
    for tok in (trained, BpeTokenizer.from_file(tmp_path / "tokenizer.json")):
        for ids in (tok.encode(doc), tok.encode_batch([doc])[0]):  # encode_batch: what prepare calls
            assert tok.eot_id not in ids.tolist() and tok.decode(ids) == doc
        assert tok.identity == trained.identity  # the tokenizer itself (its JSON) is unchanged


def test_bpe_without_end_of_text_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / "tok.json"))
    with pytest.raises(DataError, match="no end-of-text token"):
        BpeTokenizer.from_file(tmp_path / "tok.json")


def test_bad_tokenizer_choices_are_one_line_errors(tmp_path):
    with pytest.raises(DataError, match=r"data.tokenizer='sentencepiece' is not one of byte, bpe"):
        check_tokenizer_choice("sentencepiece", None)
    with pytest.raises(DataError, match="needs data.tokenizer=bpe"):
        check_tokenizer_choice("byte", "tok.json")
    with pytest.raises(DataError, match="does not exist"):
        BpeTokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not a readable tokenizer.json"):
        BpeTokenizer.from_file(tmp_path / "bad.json")
    with pytest.raises(DataError, match="at least 257"):
        _train(["abc"], vocab=100)
