"""CompositionMatrix: Q-, K- and V-composition of every head pair, with per-pair detail."""

from __future__ import annotations

import traitlets

from ...analysis.composition import KINDS, composition_baseline, composition_detail, composition_scores
from ..core import offline
from ..core.arrays import ArrayDict
from ..core.base import CircuitWidget, rolls_back
from ..core.offset_window import OffsetWindow
from ..core.selection import HeadSelection, PairSelection, check_model
from .notes import direct_path_ignores

# the erratum panel shows the first form the errata names (first factor of the paper's product
# moved to the end, K: ||W_K W_O W_V W_Q^T||); both forms: pcw.composition_scores(norm=...)
ERRATUM = "erratum_left"
NORMS = {"correct": "correct", "erratum": ERRATUM}
"""Panel -> the ``norm`` of ``composition_scores`` it shows."""


class CompositionMatrix(OffsetWindow, HeadSelection, PairSelection, CircuitWidget):
    """Heatmap of ``kind``-composition scores (``pcw.composition_scores``) for every pair
    ``h1 -> h2`` with ``h1`` in an earlier layer (rows: writing head h1, columns: reading
    head h2). Toggles: Q/K/V, baseline-subtracted or raw, and the published erratum
    (cyclic-permutation norm) side by side with the correct score. Clicking a cell sets
    ``selected_pair`` (and ``layer``/``head`` to the reading head h2); the kernel answers with
    ``detail``: singular values of the composed matrix and positivity of the composed circuit.

    Score tables (kind x correct/erratum, without baseline) are computed on first use. A
    small model (``EAGER_HEADS`` heads or fewer, milliseconds of work) gets the three correct
    tables at build, so the kind toggle of its saved notebook or HTML export works without a
    kernel, and the three erratum tables once ``show_erratum`` is first set. A larger model
    computes the shown table in the background as the widget is built and each other one
    when a toggle asks for it (the view shows the busy state meanwhile and, without a
    kernel, which tables need one; ``wait()`` blocks until they are in). ``compute_all()``
    fills in the rest (e.g. before ``save_html``). ``recompute_detail()`` runs the detail
    synchronously.

    Rotary models: Q- and K-composition depend on the query - key offset of the reading head
    (``W_QK = W_Q R(offset) W_K^T``); each pair's table entry is its largest score over ``offsets``
    and its detail is at the offset where that is reached (``offset_note`` says so in the view).

    Args:
        model: a weight view with at least 2 layers.
        lazy: compute tables on first use (default: when the model has more than
            ``EAGER_HEADS`` heads).
        offsets: rotary models: the window of query - key offsets Q/K-composition is read over
            (default ``analysis.rotary.DEFAULT_OFFSETS``; the explorer passes its text's offsets).
    """

    _view = traitlets.Unicode("CompositionMatrix").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "selected_pair", "kind", "subtract_baseline", "show_erratum",
                                   "offsets"})
    _window_text = ("Rotary positions: Q- and K-composition read h2's QK circuit W_Q R(offset) W_K^T {how}; each cell "
                    "shows the pair's largest score and its detail is at the offset where that is reached. "
                    "V-composition does not depend on position.")
    EAGER_HEADS = 64

    # -- data --
    scores = ArrayDict("float32").tag(sync=True)
    """{kind: {panel: float32 [L, H, L, H]}}, no baseline, NaN where l1 >= l2; only the
    tables computed so far (kind in Q/K/V, panel "correct" or "erratum", see ``NORMS``)."""
    baselines = traitlets.Dict().tag(sync=True)
    """{panel: float}: random-matrix score subtracted when ``subtract_baseline`` (panels computed so far)."""
    ignores = traitlets.List(traitlets.Unicode()).tag(sync=True)
    """list[str] (read-only): what this model has that the view's weight-only circuits leave out."""
    detail = ArrayDict("float32").tag(sync=True)
    """Detail of ``selected_pair`` for ``kind`` (see ``pcw.analysis.composition_detail``); {} for none."""

    # -- display --
    kind = traitlets.Enum(list(KINDS), default_value="K").tag(sync=True)
    """str, default "K": which composition the heatmap shows."""
    subtract_baseline = traitlets.Bool(True).tag(sync=True)
    """bool, default True: show score minus the random-matrix baseline (the paper's plots)."""
    show_erratum = traitlets.Bool(False).tag(sync=True)
    """bool, default False: also show the original paper's (wrong) cyclic-permutation score."""

    # -- selection: layer, head, selected_pair ([l1, h1, l2, h2] with l1 < l2, or []) from the mixins --

    def __init__(self, model, lazy: bool | None = None, offsets=None, **kwargs):
        check_model(model, "CompositionMatrix")
        if model.cfg.n_layers < 2:
            raise ValueError(f"CompositionMatrix needs at least 2 layers (heads compose across layers), "
                             f"got n_layers={model.cfg.n_layers}")
        if lazy is None:
            lazy = model.cfg.n_layers * model.cfg.n_heads > self.EAGER_HEADS
        self._kinds_at_once = not lazy
        self._computed: dict = {}  # (kind, panel) -> payload: every table computed (by one runner thread)
        super().__init__(model, offsets, ignores=direct_path_ignores(model.cfg, composition=False), **kwargs)

    _answers_offline = "runner"
    _window_what = "Q/K-composition"

    def _started(self) -> None:
        if self._kinds_at_once:
            self.recompute_detail()
        else:  # seconds of work: the view is usable at once and shows the busy state meanwhile
            self._on_pair({"name": "kind"})
        self.observe(self._on_pair, ["selected_pair", "kind", "show_erratum"])

    # -- score tables, on first use --------------------------------------------------------
    def _missing(self, kind: str, erratum: bool) -> list[tuple[str, str]]:
        """(kind, panel) tables the view needs for ``kind`` (all kinds for a small model) that
        are not computed yet."""
        panels = ("correct", "erratum") if erratum else ("correct",)
        kinds = KINDS if self._kinds_at_once else (kind,)
        return [(k, panel) for k in kinds for panel in panels if (k, panel) not in self._computed]

    def _tables(self, wanted) -> dict:
        """Trait updates holding every table computed so far, the ``wanted`` (kind, norm) ones
        added (built from ``_computed``, not the traits: a result still waiting to be applied
        is never lost). Rotary Q/K: each pair's largest score over the offsets (a table of a window
        changed meanwhile is not kept)."""
        window = self._offsets
        for kind, panel in wanted:
            offsets = window if kind in "QK" else None
            table = composition_scores(self.model, kind, baseline=False, norm=NORMS[panel], offsets=offsets,
                                       reduce="max")
            if offsets is None or window == self._offsets:
                self._computed[(kind, panel)] = table
        scores, baselines = {}, {}
        for (kind, panel), table in self._computed.items():
            scores.setdefault(kind, {})[panel] = table
            baselines[panel] = composition_baseline(self.model, NORMS[panel])
        return {"scores": scores, "baselines": baselines}

    def _apply_tables(self, wanted) -> None:
        if wanted:
            with self.hold_sync():
                for name, value in self._tables(wanted).items():
                    setattr(self, name, value)

    def compute_all(self) -> None:
        """Compute every table not computed yet (3 kinds x correct/erratum), synchronously."""
        self.wait(None)  # the runner's thread is the one that fills ``_computed``
        self._apply_tables([(kind, panel) for kind in KINDS for panel in ("correct", "erratum")
                            if (kind, panel) not in self._computed])

    def recompute_detail(self) -> dict:
        """Compute ``detail`` for the current ``selected_pair`` and ``kind`` (synchronously)."""
        self._on_pair({"name": "kind"})
        self.wait(None)
        return {"detail": self.detail}

    @rolls_back
    def _on_pair(self, change):
        pair, kind, erratum = list(self.selected_pair), self.kind, self.show_erratum  # (the pair's head: PairSelection)
        # the tables the toggles show and the pair's detail are different results: neither drops the other
        self._runner.submit("tables", lambda: self._table_steps(kind, erratum))
        self._runner.submit("detail", lambda: self._detail_steps(pair, kind))

    def _on_window(self) -> None:
        self._computed = {key: table for key, table in self._computed.items() if key[0] == "V"}
        self._on_pair({"name": "kind"})

    _offline_inputs = ("kind",)

    def offline_answers(self, answers) -> None:
        """Kernel-less: the detail of every head pair for the composition kind shown."""
        answers.needs_kernel(*self._window_needs_kernel())
        cfg, kind = self.model.cfg, self.kind
        pairs = [[l1, h1, l2, h2] for l1 in range(cfg.n_layers) for h1 in range(cfg.n_heads)
                 for l2 in range(l1 + 1, cfg.n_layers) for h2 in range(cfg.n_heads)]
        if list(self.selected_pair) in pairs:
            pairs.remove(list(self.selected_pair))
            pairs.insert(0, list(self.selected_pair))
        shared = {"kind": kind, "baseline": composition_baseline(self.model, "correct")}

        def details():  # what every pair shares is stored once, in the rule's base
            for pair in pairs:
                detail = offline.last(self._detail_steps(pair, kind))["detail"]
                yield (pair, kind), {"detail": {k: v for k, v in detail.items() if k not in shared}}

        answers.rule(["selected_pair", "kind"], details(), base={"error": "", "detail": shared}, missing=(
            f"This view holds the {kind}-composition details of head pairs (within its {offline.BUDGET // 1000} KB "
            "budget for kernel-less answers); this one needs a running kernel."))

    def fill_steps(self, selection):
        """The detail of ``selection``'s pair (for the kind shown) computed into the per-model cache."""
        for _ in self._detail_steps(list(selection["selected_pair"]), self.kind):
            yield None

    def _table_steps(self, kind, erratum):
        wanted = self._missing(kind, erratum)
        if wanted:
            yield self._tables(wanted)

    def _detail_steps(self, pair, kind):
        if not pair:
            yield {"detail": {}}
            return
        window = self._offsets if kind in "QK" else None
        d = composition_detail(self.model, kind, tuple(pair[:2]), tuple(pair[2:]), window)
        yield {"detail": {
            "offset": d.offset, "offset_note": d.offset_note,
            "kind": d.kind, "h1": list(d.h1), "h2": list(d.h2), "score": d.score,
            "erratum_score": d.erratum_scores[ERRATUM], "baseline": d.baseline, "positivity": d.positivity,
            "singular_values": d.singular_values, "eig_re": d.eigenvalues.real, "eig_im": d.eigenvalues.imag,
        }}
