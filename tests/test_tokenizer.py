"""Tokenizer: round trip, visible whitespace, byte-level display of partial characters."""

import pytest

from pycircuits_widgets.models.corpus import corpus_documents, corpus_sha256
from pycircuits_widgets.models.tokenizer import VISIBLE_WHITESPACE, Tokenizer, visible_whitespace
from pycircuits_widgets.train import TOKENIZER_PATH


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.load(TOKENIZER_PATH)


@pytest.mark.parametrize("text", [
    "def f(x):\n\treturn x  # comment\r\n",
    "    for i in range(10):\n        yield i ** 2\n",
    "naïve café — 日本語 😀 <|endoftext|> end",
    " leading and trailing spaces  ",
])
def test_round_trip_is_exact(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_on_a_stdlib_document(tok):
    doc = corpus_documents("pydoc")[0]
    assert tok.decode(tok.encode(doc)) == doc


def test_display_strings_show_whitespace(tok):
    ids = tok.encode("a b\n\tc")
    shown = "".join(tok.display_token(i) for i in ids)
    assert shown == "a·b↵→c"
    assert visible_whitespace(" \n\t\r") == "".join(VISIBLE_WHITESPACE[c] for c in " \n\t\r")


def test_partial_utf8_tokens_show_their_bytes(tok):
    # a character the BPE has no merge for is split into byte tokens
    ids = tok.encode("😀")
    assert b"".join(tok.token_bytes(i) for i in ids) == "😀".encode()
    if len(ids) > 1:
        assert "\\x" in tok.display_token(ids[0])


def test_special_token_and_vocab(tok):
    assert tok.end_of_text_id == 0
    assert tok.encode("<|endoftext|>") == [0]
    strings = tok.token_strings()
    assert len(strings) == tok.vocab_size
    assert strings[0] == "<|endoftext|>"
    with pytest.raises(ValueError, match="out of range"):
        tok.token_bytes(tok.vocab_size)


def test_encode_rejects_non_text(tok):
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")


def test_bad_tokenizer_file_is_a_clear_error(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.load(path)


def test_corpus_is_deterministic_and_hashed():
    docs = corpus_documents("pydoc")
    assert docs == corpus_documents("pydoc")
    assert corpus_sha256(docs) == corpus_sha256(list(docs))
    assert corpus_sha256(docs) != corpus_sha256(docs[1:])
    with pytest.raises(ValueError, match="corpus source"):
        corpus_documents("web")
