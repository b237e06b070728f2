"""How a token is displayed (``models.tokenizer.display_bytes``, the one rule every tokenizer
uses): the shipped tokenizer's tokens against the cases the front end is tested on too
(``tests/token_display_cases.json``); a GPT-2-style byte-level tokenizer built here (never
downloaded), through ``transformers``, checked against Hugging Face's own decoding."""

import json
import pathlib
import re

import pytest
import transformers
from tokenizers import Tokenizer as HFTokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from pycircuits_widgets.models.adapters.hf_tokenizer import HFTokenizer
from pycircuits_widgets.models.tokenizer import Tokenizer, display_bytes, escape_invisible, visible_whitespace
from pycircuits_widgets.train import TOKENIZER_PATH

CASES = json.loads((pathlib.Path(__file__).parent / "token_display_cases.json").read_text(encoding="utf-8"))
TEXT = "Le café — déjà vu — naïve 🙂\n" + " " * 23 + "return x\n\n\tfin\u00a0!"


@pytest.fixture(scope="module")
def shipped():
    return Tokenizer.load(TOKENIZER_PATH)


@pytest.mark.parametrize("case", CASES["shipped"], ids=lambda c: str(c["id"]))
def test_shipped_tokens_display_as_the_shared_cases(shipped, case):
    raw = shipped.token_bytes(case["id"])
    assert raw.hex() == case["bytes"]
    assert display_bytes(raw) == shipped.display_token(case["id"]) == case["exact"]


def test_the_shipped_tokenizer_through_transformers_displays_every_token_the_same(shipped):
    wrapped = HFTokenizer(transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_PATH)))
    assert [wrapped.display_token(i) for i in range(1, shipped.vocab_size)] == shipped.token_strings()[1:]


def byte_level(decoder: bool):
    """A GPT-2-style byte-level BPE trained here on TEXT (the byte alphabet and a few merges,
    so "é", "—" and "🙂" stay split into byte tokens), wrapped as transformers wraps one;
    ``decoder=False``: trained without a decoder (its pieces still "Ġ"-spelled bytes)."""
    tok = HFTokenizers(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if decoder:
        tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=270, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def unescape_bytes(shown: str) -> str:
    """Display string -> text: runs of ``\\xNN`` back to their bytes, whitespace glyphs back."""
    text = re.sub(r"(?:\\x[0-9a-f]{2})+", lambda m: bytes.fromhex(m.group(0).replace("\\x", "")).decode(), shown)
    return text.replace("·", " ").replace("↵", "\n").replace("→", "\t").replace("\\u00a0", "\u00a0")


def test_byte_level_tokens_display_their_bytes_and_never_a_replacement_character():
    hf = byte_level(decoder=True)
    tok = HFTokenizer(hf)
    ids = tok.encode(TEXT)
    shown = [tok.display_token(i) for i in ids]
    assert unescape_bytes("".join(shown)) == TEXT  # every byte accounted for, in order
    partial = [s for i, s in zip(ids, shown) if "\ufffd" in hf.decode([i])]
    assert partial and all("\\x" in s for s in partial)  # lone bytes of "é", "—", "🙂" as escapes
    for i, s in zip(ids, shown):
        if "\ufffd" not in hf.decode([i]):  # whole characters: Hugging Face's own decoding
            assert s == escape_invisible(visible_whitespace(hf.decode([i])))
    assert not any("Ġ" in s or "Ċ" in s or "\ufffd" in s for s in shown)
    assert any(s.startswith("·") for s in shown)  # "Ġ" pieces are words after a space


def test_a_byte_level_tokenizer_without_a_decoder_displays_the_same():
    with_decoder, without = HFTokenizer(byte_level(True)), HFTokenizer(byte_level(False))
    n = with_decoder.hf_tokenizer.vocab_size
    assert [without.display_token(i) for i in range(n)] == [with_decoder.display_token(i) for i in range(n)]


def test_a_replacement_character_from_any_tokenizer_shows_as_its_escape():
    assert display_bytes("caf\ufffd".encode()) == "caf\\ufffd"
    assert display_bytes(b"caf\xc3") == "caf\\xc3"
