"""CompositionMatrix: Q-, K- and V-composition of every head pair, with per-pair detail."""

from __future__ import annotations

import time

import traitlets

from ...analysis.composition import KINDS, composition_baseline, composition_detail, composition_scores
from ...analysis.path_patching import measured_composition_steps
from ..core import offline
from ..core.arrays import ArrayDict
from ..core.base import CircuitWidget, rolls_back
from ..core.meter import Meter, metered
from ..core.offset_window import OffsetWindow
from ..core.save_plan import MEASURED, PAGE_BYTES_PER_ANSWER_BYTE, PlanItem
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

    Measured on a text (the explorer's, ``measure_on``): ``source = "measured"`` shows, on the same
    axes, ``pcw.measured_composition`` of that text for the kind shown (each pair's path-patching
    effect: how much removing h1 from h2's query, key or value input changes h2's attention, or its
    output for V), computed on first use in the background (a kernel's; a plain script: at once),
    one layer pair per chunk with ``progress``, giving way to every other view's request between
    chunks as the explorer's precompute does (a click is never delayed); ``compute_measured()``
    computes every kind synchronously (e.g. before ``save_html``).

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
                                   "offsets", "source"})
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

    measured = ArrayDict("float32").tag(sync=True)
    """{kind: float32 [L, H, L, H]}: ``pcw.measured_composition`` of the text ``measure_on`` gave, NaN
    where l1 >= l2; only the kinds computed so far (saved with the page)."""
    measured_note = traitlets.Unicode("").tag(sync=True)
    """str (read-only): what the measured matrix was measured on ("" when no text was given: the
    weights are all the view can show)."""

    # -- display --
    source = traitlets.Enum(["weights", "measured"], default_value="weights").tag(sync=True)
    """str, default "weights": the heatmap shows the score read from the weights, or the effect
    measured on ``measure_on``'s text (``measured``)."""
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
        self._computed: dict = {}  # (kind, panel) -> payload: every table computed (by the runner's pieces, one at a time)
        self._measure = None  # (RunResult, tag) the measured matrices are of (``measure_on``)
        self._measured: dict = {}  # kind -> measured table of that run (filled by the runner's pieces)
        super().__init__(model, offsets, ignores=direct_path_ignores(model.cfg, composition=False), **kwargs)

    _answers_offline = "runner"
    _window_what = "Q/K-composition"

    def _started(self) -> None:
        if self._kinds_at_once:
            self.recompute_detail()
        else:  # seconds of work: the view is usable at once and shows the busy state meanwhile
            self._on_pair({"name": "kind"})
        self.observe(self._on_pair, ["selected_pair", "kind", "show_erratum"])
        self.observe(self._on_source, ["source", "kind"])

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
        self.wait(None)  # the runner's pieces are what fill ``_computed``
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

    # -- measured on a text ----------------------------------------------------------------
    def measure_on(self, clean, note: str) -> None:
        """Measure composition on the text of ``clean`` (``pcw.run(model, text)``, the explorer's
        run); ``note`` says what it is, in the view. Matrices of an earlier text are dropped."""
        self._measure, self._measured = (clean, object()), {}
        self._runner.cancel("measured")
        with self.hold_sync():
            self.measured, self.measured_note, self.progress = {}, note, {}
        self._on_source(None)

    def compute_measured(self, kinds=KINDS) -> None:
        """The measured matrices of ``kinds`` (default: all) not computed yet, synchronously (needs
        ``measure_on``)."""
        if self._measure is None:
            raise ValueError("CompositionMatrix.compute_measured: no text to measure on (measure_on(pcw.run(model, "
                             "text), note) first; the explorer gives its own)")
        self._runner.cancel("measured")
        self._runner.wait(None)
        for kind in kinds:
            for update in self._measured_steps(kind, self._measure):
                with self.hold_sync():
                    for name, value in update.items():
                        setattr(self, name, value)

    def page_items(self, context) -> list[PlanItem]:
        """A saved page's composition (``core.save_plan``): the scores with their baseline and the head pairs'
        detail within the budget, timed on the last two pairs (not computed yet; their answers are then free),
        then the measured matrices on the text (each kind: every writer head's output removed
        from each later layer's input, that layer's heads read again: FLOPs over the rate)."""
        cfg = self.model.cfg
        L, H, d, dh = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
        items = []
        if L > 1:
            timed = []  # (seconds, answer) of the last pairs: the first pays what every pair shares (a Gram, once)
            for pair in ([L - 2, h, L - 1, H - 1] for h in range(H - 1, max(-1, H - 3), -1)):
                began = time.perf_counter()
                answer = offline.last(self._detail_steps(pair, self.kind))
                timed.append((time.perf_counter() - began, answer))
            pairs = min(L * H * (L - 1) * H // 2, self.answers_budget() // offline.answer_bytes(timed[-1][1], self) + 1)
            items.append(self.answers_item(context, "composition scores with their baseline, head pairs' detail",
                                           timed[0][0] + (pairs - 1) * timed[-1][0]))
        missing = [kind for kind in KINDS if kind not in self._measured]
        if self._measure is not None and missing:
            pos = self._measure[0].tokens.shape[1]
            per_kind = L * (L - 1) // 2 * H * 2 * pos * (2 * d * H * dh + 2 * pos * H * dh)

            def measure(n: int) -> None:
                self.compute_measured(missing)

            items.append(PlanItem(context.section, "measured composition matrices",
                                  context.rate.seconds(len(missing) * per_kind),
                                  int(PAGE_BYTES_PER_ANSWER_BYTE * 4 * (L * H) ** 2 * len(missing)), MEASURED, measure))
        return items

    @rolls_back
    def _on_source(self, change):
        if self.source != "measured" or self.kind in self._measured:
            return
        if self._measure is None:
            raise ValueError("source='measured' needs a text to measure on: this view has none (the explorer's "
                             "composition section measures on its text)")
        kind, measure = self.kind, self._measure
        self._runner.submit("measured", lambda: self._measured_steps(kind, measure), tier="asked",
                            progress=self._measuring(kind).report(0))

    def _measuring(self, kind: str) -> Meter:
        """The meter of ``kind``'s measured matrix: its layer pairs."""
        L = self.model.cfg.n_layers
        return Meter(f"measuring {kind}-composition on this text", L * (L - 1) // 2, "layer pairs")

    def _measured_steps(self, kind: str, measure):
        """``pcw.measured_composition`` of ``kind`` on the measured run, one layer pair per chunk
        (asked-for work: it shares what clicks leave); ``progress`` counts the layer pairs, timed
        from the job's first piece (it may wait behind other work before that)."""
        if kind in self._measured:
            return
        clean, _ = measure
        meter = self._measuring(kind)
        table = yield from metered(measured_composition_steps(self.model, clean.tokens, kind, clean=clean),
                                   {None: (meter.text, meter.unit)})
        if self._measure is measure:  # (not of a text replaced meanwhile)
            self._measured[kind] = table.float()
            yield {"measured": dict(self._measured), "progress": {}}

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
