"""A Hugging Face tokenizer seen through the interface ``CircuitModel`` needs:
``encode(str) -> list[int]`` and ``display_token(id) -> str`` (visible whitespace, as in
``models.tokenizer``)."""

from __future__ import annotations

import json
import re
import warnings

from ..tokenizer import display_bytes, escape_invisible, unicode_to_byte, visible_whitespace

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback, e.g. <0x0A>
_SENTENCEPIECE_SPACE = "\u2581"  # "▁"


def _uses_byte_level(hf_tokenizer) -> bool:
    """Whether pieces are byte-level BPE strings (GPT-2's byte-to-unicode alphabet): a
    ByteLevel decoder or pre-tokenizer (a tokenizer trained without a decoder still splits
    text into those pieces, "Ġthe")."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str())
    return any('"ByteLevel"' in json.dumps(spec.get(part)) for part in ("decoder", "pre_tokenizer"))


class HFTokenizer:
    """Wraps a ``transformers`` tokenizer. ``encode`` adds the special tokens the tokenizer adds by
    default (e.g. LLaMA's BOS), as the source model saw in training."""

    def __init__(self, hf_tokenizer):
        for method in ("convert_ids_to_tokens", "__call__"):
            if not hasattr(hf_tokenizer, method):
                raise TypeError(f"expected a transformers tokenizer (with {method}), got {type(hf_tokenizer).__name__}")
        self.hf_tokenizer = hf_tokenizer
        self._byte_level = _uses_byte_level(hf_tokenizer)
        self._special = set(getattr(hf_tokenizer, "all_special_ids", []))

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"expected text as str, got {type(text).__name__}")
        return list(self.hf_tokenizer(text)["input_ids"])

    def display_token(self, token_id: int) -> str:
        """Byte-level pieces decode their bytes (a partial UTF-8 character shows as ``\\xNN``);
        SentencePiece ``▁`` is a space and ``<0xNN>`` a byte; special tokens show literally."""
        piece = self.hf_tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return f"<id {token_id}>"  # ids past the tokenizer's vocabulary (padded embedding rows)
        if token_id in self._special:
            return piece
        table = unicode_to_byte()
        if self._byte_level and all(ch in table for ch in piece):
            return display_bytes(bytes(table[ch] for ch in piece))
        if (match := _BYTE_PIECE.fullmatch(piece)) is not None:
            return display_bytes(bytes([int(match.group(1), 16)]))
        return escape_invisible(visible_whitespace(piece.replace(_SENTENCEPIECE_SPACE, " ")))


def as_tokenizer(tokenizer):
    """``None``, one of ours (has ``display_token``) or a ``transformers`` tokenizer (wrapped)."""
    if tokenizer is None or hasattr(tokenizer, "display_token"):
        return tokenizer
    return HFTokenizer(tokenizer)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def folder_tokenizer(folder):
    """The tokenizer saved in the checkpoint folder ``folder`` (``TOKENIZER_FILES``, local files only),
    or None: none saved, or one transformers cannot load, which warns naming the files and the error
    (the weight-only analyses need no tokenizer: token ids only)."""
    saved = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not saved:
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - loaders raise any type (KeyError, ValueError, ...) on a bad file
        warnings.warn(f"{' / '.join(map(str, saved))}: the tokenizer cannot be loaded ({type(err).__name__}: {err}); "
                      "the model is read without one (token ids only)", stacklevel=3)
        return None
