"""EigenvaluePlot: every head on the plane OV positivity vs QK positivity, one head's spectrum."""

from __future__ import annotations

import time
from collections.abc import Mapping

import traitlets

from ...analysis.circuits import embedding_note
from ...analysis.eigen import best_offset_spectra
from ...analysis.head_scores import SCORE_NAMES, head_scores, repeated_random_tokens
from ...analysis.skip_trigrams import copied_tokens
from ...corpus.sweeps import checked_sweep
from ..core import offline
from ..core.arrays import Array, ArrayDict
from ..core.base import CircuitWidget, rolls_back
from ..core.offset_window import OffsetWindow
from ..core.payload import to_numpy
from ..core.read_through import ReadThrough
from ..core.save_plan import PAGE_BYTES_PER_ANSWER_BYTE, WEIGHTS, PlanItem, forward_flops
from ..core.selection import Bounded, HeadSelection, check_model
from .notes import direct_path_ignores

EVERY_LAYER = {"mlp0": "W_E + block 0 (each token alone through the first block; what other tokens write is left "
                       "out)",
               "corpus": "the corpus stream (each token's mean stream entering the head's layer over the sweep: one "
                         "vector per token for every context it came in)"}
"""What the scatter's heads read through, each embedding but ``W_E`` (``read_through``)."""


class EigenvaluePlot(OffsetWindow, ReadThrough, HeadSelection, CircuitWidget):
    """Scatter of all heads at (OV positivity, QK positivity) (``pcw.eigenvalue_positivity``),
    labelled ``L1.H6`` and coloured by layer or by a head score (e.g. induction). Clicking a
    head sets ``layer``/``head``; the kernel answers with ``detail``: that head's OV and QK
    eigenvalues (drawn in the complex plane, optionally log-scaled magnitude) and the tokens
    it copies most.

    Rotary models: the QK circuit depends on the query - key offset (``W_Q R(offset) W_K^T``); each
    head's QK positivity is its largest over ``offsets`` and its QK spectrum is at that offset
    (``offset_note`` says so in the view, the detail names the offset).

    Args:
        model: a weight view.
        scores: ``{name: [L, H]}`` head scores to colour by; default ``pcw.head_scores(model)``
            (a forward pass on repeated random tokens), computed on first use (when
            ``color_by`` asks for one) for models with more than ``EAGER_HEADS`` heads;
            ``{}`` for none.
        n_copies: how many most-copied tokens the detail lists.
        offsets: rotary models: the window of query - key offsets the QK side is read over
            (default ``analysis.rotary.DEFAULT_OFFSETS``; the explorer passes its text's offsets).
        sweep: a ``pcw.Sweep`` of this model: colour by its head scores, pooled over the corpus
            (``Sweep.head_scores``; ``scores_note`` says so in the legend) instead of ``scores``; and the
            corpus stream an ``embedding="corpus"`` reads.
        embedding: what the heads of layers >= 1 are read through (``core.read_through``): "raw" (``W_E``,
            the paper's reading, default), "mlp0" (``W_E`` through block 0) or "corpus" (each token's mean
            stream entering the head's layer over ``sweep``'s positions); layer 0 reads ``W_E`` itself. The
            scatter, the spectrum and the copied tokens all read it; ``read_through`` says what they read.
    """

    _view = traitlets.Unicode("EigenvaluePlot").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "color_by", "log_scale", "offsets", "embedding"})
    _window_text = ("Rotary positions: the QK circuit W_E W_Q R(offset) W_K^T W_E^T is read {how}; each head's QK "
                    "positivity is its largest over them and its QK spectrum is at that offset.")
    EAGER_HEADS = 64
    _embedding_note = traitlets.Unicode("").tag(sync=True)
    """str (kernel's): which embedding the token circuits read (``analysis.circuits.embedding_note``)."""

    # -- data --
    ov_positivity = Array("float32", ndim=2).tag(sync=True)
    """float32 [L, H]: sum(lambda) / sum(|lambda|) of each head's full OV circuit; None while
    the runner computes it (models with more than ``EAGER_HEADS`` heads: ``wait()`` covers it)."""
    qk_positivity = Array("float32", ndim=2).tag(sync=True)
    """float32 [L, H]: the same for each head's full QK circuit (rotary: its largest over the
    offsets, ``offset_note``); None while computed."""

    ignores = traitlets.List(traitlets.Unicode()).tag(sync=True)
    """list[str] (read-only): what this model has that the view's weight-only circuits leave out."""
    scores = ArrayDict("float32").tag(sync=True)
    """{name: float32 [L, H]}: head scores available for ``color_by``; {} for a score
    not computed yet (computed when ``color_by`` asks for it)."""
    scores_note = traitlets.Unicode("").tag(sync=True)
    """str (read-only): where ``scores`` come from, shown in the legend ("" for the default: repeated random
    tokens, or the caller's own)."""
    detail = ArrayDict("float32").tag(sync=True)
    """The selected head: {"layer", "head", "ov_re"/"ov_im"/"qk_re"/"qk_im": float32 [d_head],
    "copies": [{"id", "str", "score"}]} (score: centred full-OV diagonal, see ``copied_tokens``)."""

    # -- display --
    color_by = traitlets.Unicode("layer").tag(sync=True)
    """str, default "layer": "layer" or a key of ``scores``."""
    log_scale = traitlets.Bool(False).tag(sync=True)
    """bool, default False: draw eigenvalues at log(1 + |lambda|) with their phase."""
    n_copies = Bounded(12, min=1, max=lambda model: min(200, model.cfg.d_vocab)).tag(sync=True)
    """int, default 12: number of most-copied tokens in the detail, in ``1..min(200, d_vocab)``."""

    def __init__(self, model, scores=None, offsets=None, sweep=None, **kwargs):
        check_model(model, "EigenvaluePlot")
        if checked_sweep(sweep, model, "EigenvaluePlot") is not None:
            if scores is not None:
                raise TypeError("EigenvaluePlot: pass scores or sweep (whose head scores it colours by), not both")
            scores = sweep.head_scores()
            kwargs["scores_note"] = (f"attention to its target, 0 to 1, pooled over the corpus sweep "
                                     f"({sweep.n_windows:,} windows of {sweep.seq_len} tokens)")
        if scores is not None and not isinstance(scores, Mapping):
            raise TypeError("scores must be a dict {name: [n_layers, n_heads] array} (e.g. pcw.head_scores(model)) "
                            f"or None, got {type(scores).__name__}")
        self._strings = model.token_strings
        L, H = model.cfg.n_layers, model.cfg.n_heads
        self._lazy = lazy = L * H > self.EAGER_HEADS  # two vocab-sized products: several forwards' worth at GPT-2 shapes
        if scores is None and not lazy:
            scores = head_scores(model)
        if scores is None:  # names now, numbers on first use
            scores = {name: {} for name in SCORE_NAMES}
        else:
            scores = {name: _check_score(name, value, L, H) for name, value in scores.items()}
        super().__init__(model, offsets, sweep=sweep, scores=scores, ignores=direct_path_ignores(model.cfg),
                         _embedding_note=embedding_note(model), **kwargs)

    _answers_offline = "runner"
    _window_what = "the QK spectrum"

    def _started(self) -> None:
        if self._lazy:  # the scatter fills in from the runner (the view shows it computing), then the detail
            self._runner.submit("spectra", lambda: iter([self._positivities()]))
            self._on_head(None)
        else:
            with self.hold_sync():
                for name, value in self._positivities().items():
                    setattr(self, name, value)
            self.recompute()
        self.observe(self._on_head, ["layer", "head", "n_copies", "color_by"])
        self.observe(lambda change: self._on_window(), ["embedding"])

    def _spectra(self):
        """Every head's spectra read through the current embedding (``analysis.eigen.best_offset_spectra``)."""
        corpus = self.embedding == "corpus"
        return best_offset_spectra(self.model, self._offsets, self.embedding, self._sweep if corpus else None)

    def _positivities(self) -> dict:
        """Trait values of the scatter: ``ov_positivity``, ``qk_positivity``, and ``read_through``."""
        spectra = self._spectra()
        read = "" if self.embedding == "raw" else (f"{EVERY_LAYER[self.embedding]}, every head of layers 1 and up "
                                                   "(layer 0 reads W_E itself)")
        return {"ov_positivity": spectra.ov_positivity, "qk_positivity": spectra.qk_positivity, "read_through": read}

    @traitlets.validate("color_by")
    def _valid_color_by(self, proposal):
        name = proposal["value"]
        options = ["layer", *self.scores]
        if name not in options:
            raise traitlets.TraitError(f"color_by must be one of {options}, got {name!r}")
        return name

    def recompute(self) -> dict:
        """Compute ``detail`` for the current ``layer``/``head`` (synchronously)."""
        self._on_head(None)
        self.wait(None)
        return {"detail": self.detail}

    @rolls_back
    def _on_head(self, change):
        layer, head, n = self.layer, self.head, self.n_copies
        if isinstance(self.scores.get(self.color_by), dict):  # a head score asked for first: computed once
            self._runner.submit("scores", self._score_steps)
        self._runner.submit("detail", lambda: self._detail_steps(layer, head, n))

    def _on_window(self) -> None:
        self._runner.submit("spectra", lambda: iter([self._positivities()]))
        self._on_head(None)

    _offline_inputs = ("n_copies", "embedding")

    def offline_answers(self, answers) -> None:
        """Kernel-less: every head's eigenvalue detail (spectra and most-copied tokens)."""
        answers.needs_kernel("embedding", *self._window_needs_kernel())
        answers.rule(["layer", "head"], (
            ((layer, head), offline.last(self._detail_steps(layer, head, self.n_copies)))
            for layer, head in offline.heads(self)
        ), base={"error": ""}, missing=offline.over_budget("This head's eigenvalue detail"))

    def page_items(self, context) -> list[PlanItem]:
        """A saved page's weight-only work (``core.save_plan``): the positivities and each head's detail within
        the budget, one head's detail timed (one not computed yet: the positivities too, if still computing);
        the head scores, where not computed yet (a forward of the repeated random tokens they are measured on)."""
        cfg = self.model.cfg
        L, H = cfg.n_layers, cfg.n_heads
        heads = offline.heads(self)
        began = time.perf_counter()
        answer = offline.last(self._detail_steps(*heads[-1], self.n_copies))  # (cached: its answer is then free)
        each = time.perf_counter() - began
        fitting = min(L * H, self.answers_budget() // offline.answer_bytes(answer, self) + 1)
        items = [self.answers_item(context, "eigenvalue positivities and each head's spectrum", each * fitting)]
        if any(isinstance(score, dict) for score in self.scores.values()):
            tokens = repeated_random_tokens(self.model)
            flops = forward_flops(cfg, tokens.numel(), tokens.shape[1])
            items.append(PlanItem(context.section, "head scores", context.rate.seconds(flops),
                                  int(PAGE_BYTES_PER_ANSWER_BYTE * 4 * L * H * len(SCORE_NAMES)), WEIGHTS,
                                  lambda n: self._apply(next(self._score_steps()))))
        return items

    def _apply(self, update: dict) -> None:
        with self.hold_sync():
            for name, value in update.items():
                setattr(self, name, value)

    def fill_steps(self, selection):
        """``selection``'s head's detail computed into the per-model cache (its copied tokens)."""
        for _ in self._detail_steps(selection["layer"], selection["head"], self.n_copies):
            yield None

    def _score_steps(self):
        yield {"scores": dict(head_scores(self.model))}

    def _detail_steps(self, layer, head, n):
        spectra = self._spectra()
        at = spectra.qk_offset
        detail = {"layer": layer, "head": head, **({} if at is None else {"qk_offset": int(at[layer, head])})}
        for kind, eigs in (("ov", spectra.ov), ("qk", spectra.qk)):
            detail[f"{kind}_re"] = eigs[layer, head].real
            detail[f"{kind}_im"] = eigs[layer, head].imag
        yield {"detail": detail}  # the spectrum is cached: it shows at once
        ids, values = copied_tokens(self.model, layer, head, n, self._read(layer)[0])
        yield {"detail": {**detail, "copies": [
            {"id": i, "str": self._strings[i], "score": s} for i, s in zip(ids.tolist(), values.tolist())
        ]}}


def _check_score(name, value, L: int, H: int):
    arr = to_numpy(value, name=f"scores[{name!r}]")
    if arr.shape != (L, H):
        raise ValueError(f"scores[{name!r}] must have shape [n_layers, n_heads] = [{L}, {H}], got {list(arr.shape)}")
    return arr

