"""A corpus tokenised into windows of ``seq_len`` tokens: the rule, and its identity for the store.

The rule (``RULE``), deterministic and the one the shipped models were trained on (``train.py``): the
kept documents in order, each tokenised and followed by the tokenizer's end-of-text token when it has
one (``separator_id``), are concatenated into one stream, cut into consecutive non-overlapping windows
of ``seq_len`` tokens. A document shorter than a window shares it with its neighbours; a longer one
spans several; the stream's last partial window (fewer than ``seq_len`` tokens) is dropped. Windows
are numbered from 0 in stream order; ``max_windows`` keeps the first n.

Bounded memory: a document is tokenised in pieces of at most ``PIECE_CHARS`` characters, cut where
byte-level BPE pre-tokenisation (GPT-2's, this project's) splits anyway: after a newline between two
non-space characters, else before a single space between two non-space characters, so the tokens are
those of the whole text; a piece with neither (a 64 Ki-character word) is cut at the limit, where the
tokens may differ from the whole text's. A tokenizer that adds a prefix to every encoding (LLaMA's BOS:
what it gives for ``""``) adds it once per document: later pieces drop it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator

import numpy as np

from .documents import CorpusError, Skip, short_digest

PIECE_CHARS = 1 << 16
RULE = "concatenated documents, each followed by the separator; consecutive windows; tail dropped; v1"
_CUT = re.compile(r"(?<=\S\n)(?=\S)|(?<=\S)(?= \S)")
_PROBE = "def f(x):\n    return x  # héllo, 世界! 12345\n\tEnd."


def separator_id(tokenizer) -> int | None:
    """The end-of-text id written after every document: ours (``<|endoftext|>``) or a Hugging Face
    tokenizer's ``eos_token_id``; None when the tokenizer has none (documents then simply abut)."""
    sep = getattr(tokenizer, "end_of_text_id", None)
    if sep is None:
        sep = getattr(getattr(tokenizer, "hf_tokenizer", None), "eos_token_id", None)
    return None if sep is None else int(sep)


def tokenizer_identity(tokenizer) -> str:
    """A hash that changes when the tokenisation would: the tokenizer's own ``fingerprint()`` where it has
    one, a Hugging Face fast tokenizer's serialised form, else the ids it gives a fixed probe text."""
    name = type(tokenizer).__name__
    own = getattr(tokenizer, "fingerprint", None)
    if callable(own):
        return f"{name}:{own()}"
    backend = getattr(getattr(tokenizer, "hf_tokenizer", None), "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(tokenizer.encode(_PROBE))
    return f"{name}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def pieces(text: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` cut into pieces of at most ``limit`` characters at pre-tokenisation boundaries (module
    docstring); their concatenation is ``text``."""
    start = 0
    while len(text) - start > limit:
        end = start + limit
        cuts = [m.start() for m in _CUT.finditer(text, max(start + 1, end - 4096), end)]
        cut = cuts[-1] if cuts else end
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


def document_tokens(tokenizer, chunks: Iterator[str], prefix: list[int]) -> Iterator[list[int]]:
    """Token ids of one document read as ``chunks``, piece by piece (module docstring)."""
    carry, first = "", True
    for chunk in chunks:
        text = carry + chunk
        # hold back the last piece: the next chunk may continue it (a cut needs the text after it)
        parts = list(pieces(text))
        carry = parts.pop() if parts else ""
        for part in parts:
            yield _encode(tokenizer, part, prefix, first)
            first = False
    if carry:
        yield _encode(tokenizer, carry, prefix, first)


def _encode(tokenizer, text: str, prefix: list[int], first: bool) -> list[int]:
    ids = tokenizer.encode(text)
    if not first and prefix and ids[:len(prefix)] == prefix:
        ids = ids[len(prefix):]
    return ids


def token_stream(corpus, tokenizer, checked: Callable[[], None] = lambda: None,
                 more: Callable[[], bool] = lambda: True) -> Iterator[list[int]]:
    """The corpus's token stream (module docstring) in pieces: each kept document's pieces, then the
    separator. A document whose text differs from the scan's is refused (``CorpusError``) once read to
    its end; ``checked()`` is called after each document that passed. ``more()``, asked before each piece:
    False ends the stream, the current document's rest read (not tokenised) so that it is checked too."""
    sep = separator_id(tokenizer)
    prefix = tokenizer.encode("")
    for doc, digest in corpus.kept():
        if not more():
            return
        chunks = _checked(doc, digest)
        for ids in document_tokens(tokenizer, chunks, prefix):
            if not more():
                for _ in chunks:  # the rest of this document, hashed only
                    pass
                checked()
                return
            yield ids
        checked()
        if sep is not None:
            yield [sep]


def window_blocks(corpus, tokenizer, seq_len: int, block: int, start: int = 0, stop: int | None = None,
                  on_checked: Callable[[int], None] = lambda n: None) -> Iterator[np.ndarray]:
    """Windows ``start`` to ``stop`` (exclusive; None: to the end) of the corpus (module docstring), as
    int64 arrays ``[block, seq_len]`` (the last may be shorter). Windows before ``start`` are tokenised,
    not kept; the stream stops being read at ``stop`` (the document in progress read to its end, hashed
    only). Memory: a block, a piece and less than a window.

    ``on_checked(n)``: called each time a document's text is found to be the scan's, with ``n`` the
    windows (from window 0) made only of checked documents' tokens. A window cut before its documents
    are checked may hold a changed document's text: a caller that keeps windows keeps only those below
    the last ``n`` for good (``sweeps.py``), or all of them once the generator has ended."""
    if seq_len < 1 or block < 1:
        raise ValueError(f"seq_len and block must be >= 1, got {seq_len} and {block}")
    rest, index = np.zeros(0, np.int64), 0  # tokens short of a window; windows cut so far
    held: list[np.ndarray] = []
    n_held = 0
    stream = token_stream(corpus, tokenizer, checked=lambda: on_checked(index),
                          more=lambda: stop is None or index < stop)
    for ids in stream:
        flat = np.concatenate([rest, np.asarray(ids, dtype=np.int64)])
        m = len(flat) // seq_len
        rest = flat[m * seq_len:]
        lo, hi = max(start - index, 0), m if stop is None else min(m, stop - index)
        index += m
        if hi > lo:
            held.append(flat[lo * seq_len:hi * seq_len].reshape(hi - lo, seq_len))
            n_held += hi - lo
        while n_held >= block:
            joined = np.concatenate(held)
            yield joined[:block]
            held, n_held = [joined[block:]], n_held - block
    if n_held:
        yield np.concatenate(held)


def _checked(doc, digest: int) -> Iterator[str]:
    """``doc``'s chunks, its hash checked against the scan's once read to the end."""
    h = hashlib.sha256()
    try:
        for chunk in doc.chunks():
            h.update(chunk.encode("utf-8"))
            yield chunk
    except Skip as skip:
        raise CorpusError(f"{doc.name} changed since the corpus was scanned (it is now skipped: {skip.reason}); "
                          "build the Corpus again") from None
    if short_digest(h.digest()) != digest:
        raise CorpusError(f"{doc.name} changed since the corpus was scanned; build the Corpus again")
