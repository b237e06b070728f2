"""CompositionMatrix: Q-, K- and V-composition of every head pair, with per-pair detail."""

from __future__ import annotations

import torch
import traitlets

from ..analysis.composition import KINDS, composition_detail, composition_scores, random_baseline
from .base import CircuitWidget
from .payload import encode_array
from .selection import HeadSelection, Recompute, apply_now, check_model

# the erratum panel shows the first form the errata names (first factor of the paper's product
# moved to the end, K: ||W_K W_O W_V W_Q^T||); both forms: pcw.composition_scores(norm=...)
ERRATUM = "erratum_left"


class CompositionMatrix(HeadSelection, CircuitWidget):
    """Heatmap of ``kind``-composition scores (``pcw.composition_scores``) for every pair
    ``h1 -> h2`` with ``h1`` in an earlier layer (rows: writing head h1, columns: reading
    head h2). Toggles: Q/K/V, baseline-subtracted or raw, and the published erratum
    (cyclic-permutation norm) side by side with the correct score. Clicking a cell sets
    ``selected_pair`` (and ``layer``/``head`` to the reading head h2); the kernel answers with
    ``detail``: singular values of the composed matrix and positivity of the composed circuit.

    The three correct score tables (Q, K, V, without baseline) are in the ``scores`` trait from
    the start, so the kind and baseline toggles work without a kernel (saved notebooks, HTML
    export). The erratum tables are computed only once ``show_erratum`` is first set (they cost
    as much as the correct ones and nobody asked for them yet); until then their half of
    ``scores`` is NaN. ``recompute_detail()`` runs the detail synchronously.
    """

    _view = traitlets.Unicode("CompositionMatrix").tag(sync=True)

    # -- data --
    scores = traitlets.Dict().tag(sync=True)
    """float32 payload ``[3 (Q, K, V), 2 (correct, erratum), L, H, L, H]``, no baseline; NaN where
    l1 >= l2, and in the erratum half until ``show_erratum`` is first set."""
    baselines = traitlets.Dict().tag(sync=True)
    """{"correct": float, "erratum": float}: random-matrix score subtracted when ``subtract_baseline``."""
    detail = traitlets.Dict().tag(sync=True)
    """Detail of ``selected_pair`` for ``kind`` (see ``pcw.analysis.composition_detail``); {} for none."""

    # -- display --
    kind = traitlets.Enum(list(KINDS), default_value="K").tag(sync=True)
    """str, default "K": which composition the heatmap shows."""
    subtract_baseline = traitlets.Bool(True).tag(sync=True)
    """bool, default True: show score minus the random-matrix baseline (the paper's plots)."""
    show_erratum = traitlets.Bool(False).tag(sync=True)
    """bool, default False: also show the original paper's (wrong) cyclic-permutation score."""

    # -- selection --
    selected_pair = traitlets.List(traitlets.Int()).tag(sync=True)
    """[l1, h1, l2, h2] with l1 < l2, or [] for none."""

    def __init__(self, model, **kwargs):
        check_model(model, "CompositionMatrix")
        if model.cfg.n_layers < 2:
            raise ValueError(f"CompositionMatrix needs at least 2 layers (heads compose across layers), "
                             f"got n_layers={model.cfg.n_layers}")
        self.model = model
        with torch.no_grad():
            correct = torch.stack([composition_scores(model, kind, baseline=False) for kind in KINDS])
        self._tables = torch.stack([correct, torch.full_like(correct, float("nan"))], 1)
        self._has_erratum = False
        cfg = model.cfg
        super().__init__(
            scores=encode_array(self._tables, "float32"),
            baselines={"correct": random_baseline(cfg.d_model, cfg.d_head),
                       "erratum": random_baseline(cfg.d_model, cfg.d_head, ERRATUM)},
            **kwargs,
        )
        self._runner = Recompute(self)
        if self.selected_pair or self.show_erratum:
            apply_now(self, self._steps(list(self.selected_pair), self.kind, self.show_erratum))
        self.observe(self._on_change, ["selected_pair", "kind", "show_erratum"])

    @traitlets.validate("selected_pair")
    def _valid_pair(self, proposal):
        pair = proposal["value"]
        if not pair:
            return []
        cfg = self.model.cfg
        if len(pair) != 4:
            raise traitlets.TraitError(f"selected_pair must be [] or [l1, h1, l2, h2], got {pair}")
        l1, h1, l2, h2 = pair
        if not (0 <= l1 < l2 < cfg.n_layers and 0 <= h1 < cfg.n_heads and 0 <= h2 < cfg.n_heads):
            raise traitlets.TraitError(
                f"selected_pair must be [l1, h1, l2, h2] with 0 <= l1 < l2 <= {cfg.n_layers - 1} and heads "
                f"in 0..{cfg.n_heads - 1}, got {pair}"
            )
        return list(pair)

    def recompute_detail(self) -> dict:
        """Compute ``detail`` for the current ``selected_pair`` and ``kind`` (synchronously)."""
        return apply_now(self, self._steps(list(self.selected_pair), self.kind, False))

    def wait(self, timeout: float | None = 30.0) -> bool:
        """Wait until background recomputes are done (True if idle)."""
        return self._runner.wait(timeout)

    def _on_change(self, change):
        pair, kind, erratum = list(self.selected_pair), self.kind, self.show_erratum
        if change["name"] == "selected_pair" and pair:
            with self.hold_sync():
                self.layer, self.head = pair[2], pair[3]
        # every request carries show_erratum, so the newest one (the only one applied) fills them
        self._runner.submit(lambda: self._steps(pair, kind, erratum))

    def _steps(self, pair, kind, erratum):
        if erratum and not self._has_erratum:
            with torch.no_grad():
                wrong = torch.stack([composition_scores(self.model, k, False, ERRATUM) for k in KINDS])
            tables = torch.stack([self._tables[:, 0], wrong], 1)
            yield {"scores": encode_array(tables, "float32")}
            # reached only once the update was applied (a stale request is closed at its yield)
            self._tables, self._has_erratum = tables, True
        if not pair:
            yield {"detail": {}}
            return
        with torch.no_grad():
            d = composition_detail(self.model, kind, tuple(pair[:2]), tuple(pair[2:]))
        yield {"detail": {
            "kind": d.kind, "h1": list(d.h1), "h2": list(d.h2), "score": d.score,
            "erratum_score": d.erratum_scores[ERRATUM], "baseline": d.baseline, "positivity": d.positivity,
            "singular_values": encode_array(d.singular_values, "float32"),
            "eig_re": encode_array(d.eigenvalues.real, "float32"),
            "eig_im": encode_array(d.eigenvalues.imag, "float32"),
        }}
