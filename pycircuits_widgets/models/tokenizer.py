"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``), visible-whitespace display strings, and
what a model's tokenizer must be for the views to read its text (``check_tokenizer``) or ids
(``reading_ids``).

Display strings (``display_token``) are how every view shows a token. This is the one place
the whitespace mapping is defined:

    ===========  =======
    character    shown as
    ===========  =======
    space        ``·``
    newline      ``↵``
    tab          ``→``
    carriage r.  ``␍``
    ===========  =======

A token whose bytes are not valid UTF-8 on their own (part of a multi-byte character) shows
the undecodable bytes as ``\\xNN``. Characters that draw nothing or reorder what follows
(bidi controls such as U+202E, zero-width characters, other controls and separators, lone
surrogates, Hangul fillers) and the replacement character U+FFFD (bytes some decoder already
lost) show as their escape, ``\\u202e`` (``escape_invisible``): a token ``"\\u202e"`` cannot
mirror the tokens after it, ``"a\\u200bb"`` does not look like ``"ab"``, no token is a box or a
blank, and every display string is valid Unicode. :func:`display_bytes` is the rule for a
token's bytes (every tokenizer here uses it); ``js/src/lib/tokens.js`` shows tokens the same
way and, on screen only, counts long whitespace runs (``"↵·×23"``, the exact string in the
title). ``tests/token_display_cases.json`` holds the cases both sides are tested on.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"
VISIBLE_WHITESPACE = {" ": "·", "\n": "↵", "\t": "→", "\r": "␍"}
_VISIBLE_TABLE = str.maketrans(VISIBLE_WHITESPACE)


def visible_whitespace(text: str) -> str:
    """Replace space, newline, tab and carriage return by their visible glyphs (table above)."""
    return text.translate(_VISIBLE_TABLE)


# Printable characters shown as escapes: letters (category Lo) that draw nothing, and the
# replacement character (what a decoder left for bytes it could not read).
_ESCAPED_PRINTABLE = frozenset("\u115f\u1160\u3164\uffa0\ufffd")


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def escape_invisible(text: str) -> str:
    """``text`` with every character that is not printable (``str.isprintable``: controls,
    format characters such as bidi overrides and zero-width spaces, separators other than the
    space, surrogates, unassigned code points) or draws nothing written as its escape
    (``\\u202e``), as is the replacement character U+FFFD. Space, newline, tab and carriage
    return are kept (``visible_whitespace`` shows them). The result is always valid Unicode."""
    if text.isprintable() and not _ESCAPED_PRINTABLE.intersection(text):
        return text
    return "".join(ch if (ch.isprintable() or ch in VISIBLE_WHITESPACE) and ch not in _ESCAPED_PRINTABLE
                   else _escape(ch) for ch in text)


def display_bytes(raw: bytes) -> str:
    """Display string of a token's bytes: UTF-8, each byte that starts no complete character
    as ``\\xNN`` (a GPT-2 byte token such as ``b"\\xe2"``), whitespace visible, invisible
    characters escaped (``escape_invisible``)."""
    return escape_invisible(visible_whitespace(raw.decode("utf-8", errors="backslashreplace")))


@functools.lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes map to themselves, the other
    bytes to code points 256, 257, ... in byte order (the GPT-2 convention ``tokenizers`` uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


class Tokenizer:
    """A byte-level BPE tokenizer with the special token ``<|endoftext|>`` (separates documents)."""

    def __init__(self, hf_tokenizer: _HFTokenizer):
        self._tok = hf_tokenizer

    # --- construction -------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 2048) -> Tokenizer:
        """Train byte-level BPE on ``texts``; id 0 is ``<|endoftext|>``."""
        tok = _HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            return cls(_HFTokenizer.from_file(str(path)))
        except Exception as err:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"cannot load tokenizer from {path}: {err}") from err

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    # --- encoding -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def end_of_text_id(self) -> int:
        return self._tok.token_to_id(END_OF_TEXT)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"expected text as str, got {type(text).__name__}")
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (special tokens: their literal text)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} out of range [0, {self.vocab_size})")
        table = unicode_to_byte()
        if piece == END_OF_TEXT or any(ch not in table for ch in piece):
            return piece.encode("utf-8")
        return bytes(table[ch] for ch in piece)

    def display_token(self, token_id: int) -> str:
        """Display string of one token (``display_bytes`` of its bytes)."""
        return display_bytes(self.token_bytes(token_id))

    def token_strings(self) -> list[str]:
        """Display string of every id, ``[d_vocab]``."""
        return [self.display_token(i) for i in range(self.vocab_size)]

    def fingerprint(self) -> str:
        """Short content hash, stored in checkpoints to catch a tokenizer/model mismatch."""
        import hashlib

        vocab = json.dumps(sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1]))
        return hashlib.sha256(vocab.encode()).hexdigest()[:16]


# -- a model's tokenizer as the explorer reads it ---------------------------------------------
class IdsText:
    """Token ids written as text, ``"464 3290 318"``: the tokenizer of an explorer given ids, so its
    text views read (and a reader edits) ids; each id displays as ``tokenizer``'s token, or
    ``<id N>`` without one."""

    def __init__(self, tokenizer=None):
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        pieces = text.split()
        bad = [p for p in pieces if not p.isdigit()]
        if bad or not pieces:
            raise ValueError(f"this explorer reads token ids separated by spaces (e.g. '464 3290 318'); "
                             f"{bad[0]!r} is not an id" if bad else "no token ids given")
        return [int(p) for p in pieces]

    def display_token(self, token_id: int) -> str:
        return f"<id {token_id}>" if self._tokenizer is None else self._tokenizer.display_token(token_id)


def reading(model, text):
    """``(model, text)`` for an explorer: ``text`` a non-empty str (which needs the model's tokenizer), or
    token ids (:func:`reading_ids`)."""
    if not isinstance(text, str):
        return reading_ids(model, text)
    if not text:
        raise TypeError("CircuitExplorer(model, text): text must be a non-empty str or token ids, got ''")
    if getattr(model, "tokenizer", None) is None:
        raise ValueError("CircuitExplorer: this model has no tokenizer, and reading text needs a tokenizer "
                         "(pcw.from_hf(hf_model, tokenizer)); or pass token ids (a list, tensor or numpy array)")
    return model, text


def reading_ids(model, ids):
    """``(model, text)`` for an explorer given token ids: a shallow copy of ``model`` (same weight
    tensors) whose tokenizer is ``IdsText``, and the ids as its text. Refuses ids that are not one
    sequence of valid ids (``[pos]`` or ``[1, pos]``)."""
    tokens = model._as_tokens(ids)
    if tokens.ndim == 2:
        if tokens.shape[0] != 1:
            raise ValueError(f"CircuitExplorer reads one sequence: token ids of shape {tuple(tokens.shape)} given; "
                             "pass [pos] or [1, pos]")
        tokens = tokens[0]
    strings = model.token_strings
    view = copy.copy(model)
    view.tokenizer = IdsText(model.tokenizer)
    view._token_strings = strings  # the same display strings: not computed again
    return view, " ".join(str(i) for i in tokens.tolist())


PADDED_MULTIPLE = 64
"""Models pad their embedding to a multiple of this (Pythia, Qwen, Phi): such a vocabulary may be
larger than the tokenizer's."""


def tokenizer_size(tokenizer) -> int | None:
    """How many ids ``tokenizer`` knows (None when it does not say)."""
    if tokenizer is None:
        return None
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        return len(hf)
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) else None


def check_tokenizer(model) -> None:
    """Refuse a tokenizer whose vocabulary does not fit ``model``'s, naming both sizes: more ids than
    the model has rows, or fewer without the model's vocabulary being padded (a multiple of
    ``PADDED_MULTIPLE``), which means another model's tokenizer."""
    size, d_vocab = tokenizer_size(getattr(model, "tokenizer", None)), model.cfg.d_vocab
    if size is None or size == d_vocab or (size < d_vocab and d_vocab % PADDED_MULTIPLE == 0):
        return
    raise ValueError(f"the tokenizer has {size} tokens but the model's vocabulary has {d_vocab} (d_vocab): "
                     "it is not this model's tokenizer" + (
                         "; its ids past the model's would not exist" if size > d_vocab else
                         f" (a larger model vocabulary is accepted only when padded to a multiple of {PADDED_MULTIPLE})"))


def text_reading_as(tokenizer, ids: list[int], keep: int) -> tuple[str, int]:
    """``(text, start)``: a text ``tokenizer`` reads as exactly ``ids[start:]``, the smallest ``start`` (at
    most ``keep``, a position that must stay in the text). A window cut from a corpus may start inside a
    word or a character, whose decoding re-reads differently: it starts a token or two later."""
    if isinstance(tokenizer, IdsText):
        return " ".join(map(str, ids)), 0
    for start in range(keep + 1):
        text = tokenizer.decode(ids[start:])
        if list(tokenizer.encode(text)) == ids[start:]:
            return text, start
    raise ValueError(f"this window's tokens do not read back exactly from any text that keeps position {keep} "
                     "(its decoding tokenizes differently)")
