"""BigramTable: the zero-layer model's bigram table W_E W_U, searchable by token."""

from __future__ import annotations

import torch
import traitlets

from ...analysis.bigrams import bigram_top
from ..core.arrays import Array, id_dtype
from ..core.base import CircuitWidget
from ..core.on_demand import OnDemand
from ..core.payload import JSON_BUFFER
from ..core.selection import Bounded, TokenSelection

EMBED_ALL_MAX_VOCAB = 8192
"""Up to this vocabulary size every row's top next tokens are embedded (kernel-less search);
beyond it (GPT-2: 50257, a 2-minute table) rows are computed in the kernel as tokens are selected."""
K = Bounded(min=1, max=lambda model: min(100, model.cfg.d_vocab))
"""Bounds of the constructor's ``k`` (next tokens per row)."""


class BigramTable(OnDemand, TokenSelection, CircuitWidget):
    """Top next tokens of the direct path ``W_E W_U`` (``pcw.analysis.bigrams``): the whole model
    for a zero-layer transformer, the direct-path term for deeper ones. Search the vocabulary,
    click a token to select it (``token``) and see what the model predicts after it.

    Rows are computed on the widget's runner (``on_demand``): every row up front for
    vocabularies up to ``EMBED_ALL_MAX_VOCAB`` tokens, else each selected token's row, which the
    kernel answers whether or not the view is ``active`` (one row is a ``d_model x d_vocab``
    product: milliseconds at any vocabulary size); selecting a token in an inactive small-vocabulary
    table starts it.

    Args:
        model: any weight view (zero layers included).
        k: next tokens per row.
        active: compute now (default) or when ``active`` is first set (``on_demand``).
    """

    _view = traitlets.Unicode("BigramTable").tag(sync=True)
    _browser_writable = frozenset({"token", "active"})

    # -- data --
    vocab = traitlets.List(traitlets.Unicode()).tag(sync=True, **JSON_BUFFER)
    """[d_vocab] display strings, for the search (one deflated buffer in the page: ``JSON_BUFFER``)."""
    rows = traitlets.List(traitlets.Int()).tag(sync=True)
    """Token ids whose rows are in ``top_ids``/``top_logits``, in order; empty when ``complete``
    (row i is token i: the list would cost a line per token in a saved notebook). See :meth:`row_tokens`."""
    top_ids = Array(None, ndim=2, compress=True).tag(sync=True)
    """uint16 [len(rows), k] (int32 for vocabularies over 65536; None before the first rows),
    deflated on the wire: next-token ids, best first."""
    top_logits = Array("float16", ndim=2, compress=True).tag(sync=True)
    """float16 [len(rows), k], deflated on the wire: their W_E W_U logits (shown to 3 significant
    digits; every row of a small vocabulary is saved with the page, so half the bytes)."""
    complete = traitlets.Bool(False).tag(sync=True)
    """bool: every row is embedded (search works fully without a kernel)."""

    def __init__(self, model, k: int = 10, **kwargs):
        missing = [a for a in ("cfg", "W_E", "W_U") if not hasattr(model, a)]
        if missing:
            raise TypeError(f"BigramTable needs a weight view (e.g. pcw.load_pretrained('attn-only-0l')); "
                            f"got {type(model).__name__} without {', '.join(missing)}")
        self._k = K.check(k, model, "k")
        self._computed: tuple[list[int], torch.Tensor, torch.Tensor] = (
            [], torch.zeros(0, self._k), torch.zeros(0, self._k, dtype=torch.int32))  # rows, values, ids
        super().__init__(model, vocab=model.token_strings, complete=model.cfg.d_vocab <= EMBED_ALL_MAX_VOCAB,
                         **kwargs)

    def _started(self) -> None:
        self.observe(self._on_token, ["token"])

    def _ready(self) -> bool:
        return self.top_ids is not None

    def row_tokens(self) -> list[int]:
        """The token id of each row of ``top_ids``/``top_logits``."""
        return list(range(0 if self.top_ids is None else len(self.top_ids))) if self.complete else list(self.rows)

    def _start(self) -> None:
        wanted = list(range(self.model.cfg.d_vocab)) if self.complete else [self.token]
        self._runner.submit("all rows" if self.complete else "rows", lambda: self._rows_steps(wanted))

    def _on_token(self, change):
        t = change["new"]
        if t < 0:
            return
        if not self.complete:
            self._runner.submit("rows", lambda: self._rows_steps([t]))
        elif not self.active:  # every row at once (milliseconds): the selected one is among them
            self.active = True

    def _rows_steps(self, wanted: list[int]):
        """Add the rows of ``wanted`` not computed yet (in the runner's pieces, one at a time), and
        answer with every row computed: an earlier request superseded after computing (its answer
        dropped, e.g. a token clicked, then "compute") leaves its rows here, and they are shown now."""
        rows, values, ids = self._computed
        new = [t for t in dict.fromkeys(wanted) if t >= 0 and t not in rows]
        if new:
            new_values, new_ids = bigram_top(self.model, self._k, new)
            new_values, new_ids = new_values.float(), new_ids.to(torch.int32)
            self._computed = rows, values, ids = (rows + new, torch.cat([values, new_values]), torch.cat([ids, new_ids]))
        if not rows:
            return
        yield {"top_ids": ids.numpy().astype(id_dtype(self.model.cfg.d_vocab)), "top_logits": values, "rows": [] if self.complete else rows}
