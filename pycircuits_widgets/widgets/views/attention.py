"""AttentionPatterns: every head's attention pattern, one head in detail, and a token view.

The traits hold float32 weights (``arrays.Patterns``); what travels to the browser (all
attention as uint8 ``round(255 a)``, quantised at the wire, 1 byte per value; for
causal patterns only the lower triangle, ``layout: "causal"``, packed by ``payload.pack_causal``:
``[..., n (n + 1) / 2]``, about half a byte per attention value):

* ``overview``: every head max-pooled to at most ``OVERVIEW_MAX`` x ``OVERVIEW_MAX`` (blocks
  of ``factor`` x ``factor`` positions; max-pooling keeps a single sharp weight visible). For
  contexts of at most ``OVERVIEW_MAX`` tokens this *is* the full pattern (``factor == 1``).
* ``full``: every head at full resolution, only when the overview is pooled and its bytes
  fit in ``full_budget`` (default 4 MiB: 12 causal heads up to 836 tokens). Then the saved notebook / HTML export has full detail for every head.
* ``_detail``: otherwise, the selected head at full resolution, replaced by the kernel when
  ``layer``/``head`` change. An export then has full detail for the head selected when it was
  saved; the view says that other heads show the pooled overview until a kernel is attached.
* exact values: the detail read-out asks the kernel for the hovered row as float32 (custom
  message ``{"type": "row"}``); until the answer arrives (or without a kernel) it shows the
  quantised value marked "≈ (uint8)".
"""

from __future__ import annotations

import numpy as np
import traitlets

from ..core.arrays import Patterns
from ..core.base import CircuitWidget, check_text, rolls_back
from ..core.payload import max_pool, to_numpy
from ..core.selection import HeadSelection, Index, PositionSelection

OVERVIEW_MAX = 128
"""Largest side of a head's overview thumbnail (positions are max-pooled down to it)."""
FULL_BUDGET = 4 * 2**20
"""Default byte budget for shipping every head at full resolution (uint8, causal half)."""
ROW_SUM_TOL = 5e-3
"""Tolerance on ``sum_src A[dest, src] == 1`` (float16 caches are within ~1e-3)."""
MASK_TOL = 1e-6
"""Largest weight accepted above the diagonal of a causal pattern."""
CHECK_ROWS = 256
"""Rows per step of the causal-mask check (temporaries stay small at any context length)."""


class AttentionPatterns(HeadSelection, PositionSelection, CircuitWidget):
    """Attention patterns of all heads: a grid of thumbnails, the selected head as a heatmap
    with token labels and an exact hover read-out, and a token view (select a text
    ``position``, see the attention it pays as destination or receives as source).

    Build it from a model (the kernel runs it; ``text`` stays editable)::

        AttentionPatterns(model, "text")

    or from patterns you already have (TransformerLens ``cache["pattern", l]`` works)::

        AttentionPatterns(tokens=str_tokens, patterns=A)

    Args:
        model: a ``CircuitModel`` (anything ``pcw.run`` accepts), or None.
        text: the text the model reads (needs ``model``).
        tokens: ``list[str]`` of length ``n`` (display strings), with ``patterns``.
        patterns: ``[n_heads, n, n]`` or ``[n_layers, n_heads, n, n]`` (or ``[1, L, H, n, n]``)
            tensor/array, ``A[..., dest, src]``: weights in [0, 1], rows summing to 1.
        causal: patterns are causal (``src <= dest``); weights above the diagonal are an error
            and the masked triangle is drawn hatched. False for bidirectional (BERT-style) heads.
        layer, head, position, dest_position, src_position, token_mode: initial selection.
        full_budget: bytes allowed for shipping all heads at full resolution (see module doc).
        forward: ``text -> pcw.run(model, text)``-like callable (default ``pcw.run``); the
            explorer passes its own, so one forward pass per text serves every view.

    Raises:
        ValueError: shapes of tokens and patterns disagree; NaN/inf; negative weights or
            weights above 1; non-zero weights above the diagonal of a causal pattern.
        Rows that do not sum to 1 (ablated or rescaled patterns can be legitimate) are shown,
        with a ``warning`` in the view naming the worst row.
    """

    _view = traitlets.Unicode("AttentionPatterns").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "position", "dest_position", "src_position", "token_mode", "text"})

    # -- data --
    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    """list[str]: the tokens (display strings), ``n`` of them."""
    n_layers = traitlets.Int(1).tag(sync=True)
    """int (read-only): number of layers in the patterns."""
    n_heads = traitlets.Int(1).tag(sync=True)
    """int (read-only): heads per layer."""
    overview = Patterns(compress=True).tag(sync=True)
    """``weights`` [n_layers, n_heads, m, m] max-pooled patterns, plus ``factor`` (positions per
    cell); deflated on the wire (saved with the page; mostly near-zero weights, about 1/5)."""
    full = Patterns().tag(sync=True)
    """``weights`` [n_layers, n_heads, n, n], or {} (overview is already full, or over budget)."""
    _detail = Patterns().tag(sync=True)
    """``weights`` [n, n] of head (``layer``, ``head``) when neither overview nor full has it, else {}."""
    causal = traitlets.Bool(True).tag(sync=True)
    """bool, default True: src > dest is masked (drawn hatched, not as zeros)."""
    warning = traitlets.Unicode("").tag(sync=True)
    """str: data accepted but suspicious (rows not summing to 1)."""
    text = traitlets.Unicode("").tag(sync=True)
    """str: the text the model read; setting it (Python or the view's text box) re-runs the model."""
    editable = traitlets.Bool(False).tag(sync=True)
    """bool: built from a model, so ``text`` can be edited."""
    run_label = traitlets.Unicode("").tag(sync=True)
    """str (read-only): which run of ``text`` the patterns are of when not the model's own
    (``show_run``: "ablated: L1.H6 (zero)"), shown in the view's header; "" for the model's run."""

    # -- selection: layer, head (shown in detail), position (token view) from the mixins --
    dest_position = Index(-1).tag(sync=True)
    """int, default -1 (none): destination position of the clicked cell."""
    src_position = Index(-1).tag(sync=True)
    """int, default -1 (none): source position of the clicked cell."""
    token_mode = traitlets.Enum(["destination", "source"], default_value="destination").tag(sync=True)
    """str: token view shades the attention the selected position pays ("destination") or receives ("source")."""

    def __init__(self, model=None, text=None, *, tokens=None, patterns=None, causal=True,
                 full_budget: int = FULL_BUDGET, forward=None, **kwargs):
        self._model = model
        self._full_budget = int(full_budget)
        self._forward = forward
        self._ran = None  # (text, tokens, patterns) of the last run, from the text validator
        if model is not None:
            if tokens is not None or patterns is not None:
                raise TypeError("give either model (and text) or tokens= and patterns=, not both")
            if text is None:
                raise TypeError("AttentionPatterns(model, text): text is missing")
            tokens, patterns = self._run(text)
        elif text is not None:
            raise TypeError("text needs a model: AttentionPatterns(model, text); "
                            "with precomputed patterns pass tokens= and patterns=")
        elif tokens is None or patterns is None:
            raise TypeError("AttentionPatterns needs (model, text) or tokens= and patterns=")
        tokens, A, warning = check_patterns(tokens, patterns, causal=causal)
        self._patterns = A
        self._ran, self._ran_warning = (text, tokens, A), warning
        super().__init__(text=text or "", editable=model is not None, causal=causal,
                         warning=warning, **self._data_traits(tokens, A, causal), **kwargs)

    _answers_offline = "now"

    def _started(self) -> None:
        self._detail = self._detail_patterns()
        self.on_msg(_answer_row_request)

    def offline_answers(self, answers) -> None:
        """Kernel-less: new text needs the model (a view built from a model only)."""
        if self.editable:
            answers.needs_kernel("text")

    # -- data -----------------------------------------------------------------------------
    def set_patterns(self, tokens, patterns):
        """Replace tokens and patterns together; the selection is kept where still valid."""
        tokens, A, warning = check_patterns(tokens, patterns, causal=self.causal)
        self._replace(tokens, A, warning)

    def show_run(self, patterns=None, label: str = "") -> None:
        """Show ``patterns [L, H, n, n]`` of another run of the same text (the explorer's ablated
        run), under ``label``; ``None``: the text's own run again, from the arrays kept since it ran
        (nothing recomputed: the same payload as before)."""
        if self._model is None:
            raise TypeError("show_run needs a view built from a model: AttentionPatterns(model, text)")
        _, tokens, A = self._ran
        warning = self._ran_warning
        if patterns is not None:
            tokens, A, warning = check_patterns(tokens, patterns, causal=self.causal)
        with self.hold_sync():
            self._replace(tokens, A, warning)
            self.run_label = label if patterns is not None else ""

    def _replace(self, tokens, A, warning):
        data = self._data_traits(tokens, A, self.causal)
        L, H, n = A.shape[0], A.shape[1], A.shape[2]
        with self.hold_sync():
            # Clamp the selection first so no validator sees it against the new sizes.
            self.position = self.position if self.position < n else -1
            self.dest_position = self.dest_position if self.dest_position < n else -1
            self.src_position = self.src_position if self.src_position < n else -1
            self.layer, self.head = min(self.layer, L - 1), min(self.head, H - 1)
            self._patterns = A
            for name, value in data.items():
                setattr(self, name, value)
            self.warning = warning
            self._detail = self._detail_patterns()

    def _data_traits(self, tokens, A, causal: bool) -> dict:
        L, H, n, _ = A.shape
        factor = -(-n // OVERVIEW_MAX)
        # pooling commutes with the (monotone) quantisation at the wire: pool the floats
        overview = {"weights": max_pool(A, factor), "causal": causal, "factor": factor}
        size = n * (n + 1) // 2 if causal else n * n
        full = {"weights": A, "causal": causal} if factor > 1 and L * H * size <= self._full_budget else {}
        return {"tokens": tokens, "n_layers": L, "n_heads": H, "overview": overview, "full": full}

    def _detail_patterns(self) -> dict:
        """The selected head at full resolution, when overview and full don't already hold it."""
        if self.overview.get("factor", 1) == 1 or self.full:
            return {}
        return {"weights": self._patterns[self.layer, self.head], "causal": self.causal,
                "layer": self.layer, "head": self.head}

    @traitlets.observe("layer", "head")
    @rolls_back
    def _on_head(self, change):
        detail = self._detail_patterns()
        if detail or self._detail:
            self._detail = detail

    @traitlets.observe("text")
    @rolls_back
    def _on_text(self, change):
        if self._model is not None and self._ran[0] == change["new"] and self._ran[2] is not self._patterns:
            _, tokens, A = self._ran
            self._replace(tokens, A, self._ran_warning)
            self.run_label = ""

    def _run(self, text):
        """(display tokens, patterns [L, H, n, n]) of the model reading ``text``, once per text."""
        out = (self._forward or _default_forward)(self._model, text)
        return _tokens_and_patterns(out)

    # -- validation (browser and Python alike; a bad value is refused, the last good kept) ----
    def _n_positions(self) -> int:
        return len(self.tokens)

    def _index_bounds(self, name):
        if name in ("dest_position", "src_position"):  # a clicked cell: positions, like ``position``
            return super()._index_bounds("position")
        return super()._index_bounds(name)

    @traitlets.validate("text")
    def _valid_text(self, proposal):
        text = proposal["value"]
        if getattr(self, "_model", None) is None:
            if text:
                raise traitlets.TraitError("text can only be edited when the widget was built from a model: "
                                           "AttentionPatterns(model, text)")
            return text
        check_text(text)
        if self._ran is None or self._ran[0] != text:  # the model reads it now: a bad text is refused here
            try:
                tokens, patterns = self._run(text)
                tokens, A, warning = check_patterns(tokens, patterns, causal=self.causal)
            except (TypeError, ValueError) as exc:
                raise traitlets.TraitError(f"text: {exc}") from exc
            self._ran, self._ran_warning = (text, tokens, A), warning
        return text


def _answer_row_request(widget, content, buffers):
    """Custom message ``{"type": "row", layer, head, dest}`` -> the exact float32 row
    ``A[layer, head, dest, :]`` (the read-out's exact value)."""
    if not isinstance(content, dict) or content.get("type") != "row":
        return
    L, H, n, _ = widget._patterns.shape
    try:
        layer, head, dest = int(content["layer"]), int(content["head"]), int(content["dest"])
    except (KeyError, TypeError, ValueError):
        return
    if 0 <= layer < L and 0 <= head < H and 0 <= dest < n:
        row = np.ascontiguousarray(widget._patterns[layer, head, dest], dtype=np.float32)
        widget.send({"type": "row", "layer": layer, "head": head, "dest": dest}, [row.tobytes()])


def _default_forward(model, text):
    from ...analysis.activations import run

    return run(model, text)


def _tokens_and_patterns(out):
    """(display tokens, patterns [L, H, n, n]) of a ``pcw.run`` output (batch of one)."""
    tokens = out.str_tokens
    if tokens and isinstance(tokens[0], (list, tuple)):
        tokens = tokens[0]
    return list(tokens), out.patterns[0]


def check_patterns(tokens, patterns, *, causal: bool = True):
    """Validate tokens and patterns; returns ``(tokens, A [L, H, n, n] float32, warning)``.

    One head at a time (min, max, row sums, the masked triangle in row blocks), so no
    pattern-sized temporaries: memory above the input is the row sums."""
    if isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens):
        raise TypeError("tokens must be a list of strings (e.g. model.to_str_tokens(text))")
    tokens = list(tokens)
    A = to_numpy(patterns, name="patterns").astype(np.float32, copy=False)
    if A.ndim == 5 and A.shape[0] == 1:
        A = A[0]
    if A.ndim == 3:
        A = A[None]
    if A.ndim != 4:
        raise ValueError("patterns must have shape [n_heads, dest, src] or [n_layers, n_heads, dest, src] "
                         f"(a leading batch of 1 is allowed), got {list(np.shape(patterns))}")
    L, H, nd, ns = A.shape
    if L == 0 or H == 0:
        raise ValueError(f"patterns have no heads to show (shape [n_layers, n_heads, dest, src] = {list(A.shape)}); "
                         "expected at least one layer and one head (a 0-layer model has no attention)")
    n = len(tokens)
    if n == 0:
        raise ValueError("tokens is empty: nothing to show")
    if nd != n or ns != n:
        raise ValueError(f"patterns [..., dest, src] = [..., {nd}, {ns}] do not match the {n} tokens; "
                         f"expected [..., {n}, {n}]")
    sums = np.empty((L, H, n))
    for layer in range(L):
        for head in range(H):
            _check_head(A[layer, head], [layer, head], causal)
            sums[layer, head] = A[layer, head].sum(-1)  # pairwise float32 sum: ~1e-6, tolerance 5e-3
    worst = np.unravel_index(np.abs(sums - 1).argmax(), sums.shape)
    warning = ""
    if abs(sums[worst] - 1) > ROW_SUM_TOL:
        warning = (f"rows do not sum to 1 (e.g. layer {worst[0]}, head {worst[1]}, dest {worst[2]}: "
                   f"{sums[worst]:.4f}); shown as given")
    return tokens, A, warning


def _check_head(X: np.ndarray, where: list[int], causal: bool) -> None:
    """Raise for NaN/inf, weights outside [0, 1] or above the diagonal of a causal head ``X [n, n]``."""
    lo, hi = X.min(), X.max()  # NaN propagates through both
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise ValueError(f"patterns contain NaN or inf, first at [layer, head, dest, src] = "
                         f"{where + _first(~np.isfinite(X))}")
    if lo < 0:
        raise ValueError(f"attention weights must be >= 0; negative at [layer, head, dest, src] = "
                         f"{where + _first(X < 0)} ({lo:.3g}). Are these scores before the softmax?")
    if hi > 1 + ROW_SUM_TOL:
        raise ValueError(f"attention weights must be <= 1; {hi:.4g} at [layer, head, dest, src] = "
                         f"{where + _first(X > 1 + ROW_SUM_TOL)}")
    if not causal:
        return
    n = X.shape[0]
    for r0 in range(0, n, CHECK_ROWS):
        r1 = min(r0 + CHECK_ROWS, n)
        right, square = X[r0:r1, r1:], np.triu(X[r0:r1, r0:r1], k=1)
        if max(right.max(initial=0), square.max(initial=0)) > MASK_TOL:
            above = np.concatenate([square > MASK_TOL, right > MASK_TOL], axis=1)
            d, s = _first(above)
            raise ValueError(f"non-zero weight above the diagonal (src > dest) at [layer, head, dest, src] = "
                             f"{where + [r0 + d, r0 + s]}: not a causal pattern (pass causal=False for "
                             "bidirectional heads)")


def _first(mask) -> list[int]:
    return [int(i) for i in np.argwhere(mask)[0]]
