"""BigramTable: the zero-layer model's bigram table W_E W_U, searchable by token."""

from __future__ import annotations

import torch
import traitlets

from ..analysis.bigrams import bigram_top
from .base import CircuitWidget, check_range, reports_errors
from .payload import encode_array
from .selection import TokenSelection

EMBED_ALL_MAX_VOCAB = 8192
"""Up to this vocabulary size every row's top next tokens are embedded (kernel-less search);
beyond it (GPT-2: 50257, a 2-minute table) rows are computed in the kernel as tokens are selected."""


class BigramTable(TokenSelection, CircuitWidget):
    """Top next tokens of the direct path ``W_E W_U`` (``pcw.analysis.bigrams``): the whole model
    for a zero-layer transformer, the direct-path term for deeper ones. Search the vocabulary,
    click a token to select it (``token``) and see what the model predicts after it.

    Args:
        model: any weight view (zero layers included).
        k: next tokens per row.
    """

    _view = traitlets.Unicode("BigramTable").tag(sync=True)
    _browser_writable = frozenset({"token"})

    # -- data --
    vocab = traitlets.List(traitlets.Unicode()).tag(sync=True)
    """[d_vocab] display strings, for the search."""
    rows = traitlets.List(traitlets.Int()).tag(sync=True)
    """Token ids whose rows are in ``top_ids``/``top_logits`` (all of them for small vocabularies)."""
    top_ids = traitlets.Dict().tag(sync=True)
    """int32 payload [len(rows), k]: next-token ids, best first."""
    top_logits = traitlets.Dict().tag(sync=True)
    """float32 payload [len(rows), k]: their W_E W_U logits."""
    complete = traitlets.Bool(False).tag(sync=True)
    """bool: every row is embedded (search works fully without a kernel)."""

    def __init__(self, model, k: int = 10, **kwargs):
        missing = [a for a in ("cfg", "W_E", "W_U") if not hasattr(model, a)]
        if missing:
            raise TypeError(f"BigramTable needs a weight view (e.g. pcw.load_pretrained('attn-only-0l')); "
                            f"got {type(model).__name__} without {', '.join(missing)}")
        self.model = model
        self._k = check_range("k", k, 1, min(100, model.cfg.d_vocab))
        V = model.cfg.d_vocab
        complete = V <= EMBED_ALL_MAX_VOCAB
        super().__init__(vocab=model.token_strings, complete=complete, **kwargs)
        self._set_rows(list(range(V)) if complete else ([self.token] if self.token >= 0 else []))
        self.observe(self._on_token, ["token"])

    def _on_token(self, change):
        if change["new"] >= 0 and change["new"] not in self.rows:
            self._set_rows([*self.rows, change["new"]])

    @reports_errors
    def _set_rows(self, rows: list[int]) -> None:
        if rows:
            values, ids = bigram_top(self.model, self._k, rows)
        else:
            values, ids = torch.zeros(0, self._k), torch.zeros(0, self._k, dtype=torch.int32)
        with self.hold_sync():
            self.top_ids = encode_array(ids, "int32")
            self.top_logits = encode_array(values, "float32")
            self.rows = rows
