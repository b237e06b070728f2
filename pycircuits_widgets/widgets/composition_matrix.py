"""CompositionMatrix: Q-, K- and V-composition of every head pair, with per-pair detail."""

from __future__ import annotations

import torch
import traitlets

from ..analysis.composition import KINDS, NORMS, composition_detail, composition_scores, random_baseline
from .base import CircuitWidget
from .payload import encode_array
from .selection import HeadSelection, Recompute, apply_now, check_model


class CompositionMatrix(HeadSelection, CircuitWidget):
    """Heatmap of ``kind``-composition scores (``pcw.composition_scores``) for every pair
    ``h1 -> h2`` with ``h1`` in an earlier layer (rows: writing head h1, columns: reading
    head h2). Toggles: Q/K/V, baseline-subtracted or raw, and the published erratum
    (cyclic-permutation norm) side by side with the correct score. Clicking a cell sets
    ``selected_pair`` (and ``layer``/``head`` to the reading head h2); the kernel answers with
    ``detail``: singular values of the composed matrix and positivity of the composed circuit.

    All six score tables (3 kinds x correct/erratum, without baseline) are in the
    ``scores`` trait, so every toggle works without a kernel (saved notebooks, HTML export).
    ``recompute_detail()`` runs the detail synchronously.
    """

    _view = traitlets.Unicode("CompositionMatrix").tag(sync=True)

    # -- data --
    scores = traitlets.Dict().tag(sync=True)
    """float32 payload ``[3 (Q, K, V), 2 (correct, erratum), L, H, L, H]``, no baseline; NaN where l1 >= l2."""
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
            tables = torch.stack([
                torch.stack([composition_scores(model, kind, baseline=False, norm=norm) for norm in NORMS])
                for kind in KINDS
            ])
        cfg = model.cfg
        super().__init__(
            scores=encode_array(tables, "float32"),
            baselines={norm: random_baseline(cfg.d_model, cfg.d_head, norm) for norm in NORMS},
            **kwargs,
        )
        self._runner = Recompute(self)
        if self.selected_pair:
            self.recompute_detail()
        self.observe(self._on_pair, ["selected_pair", "kind"])

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
        return apply_now(self, self._detail_steps(list(self.selected_pair), self.kind))

    def wait(self, timeout: float | None = 30.0) -> bool:
        """Wait until background recomputes are done (True if idle)."""
        return self._runner.wait(timeout)

    def _on_pair(self, change):
        pair, kind = list(self.selected_pair), self.kind
        if change["name"] == "selected_pair" and pair:
            with self.hold_sync():
                self.layer, self.head = pair[2], pair[3]
        self._runner.submit(lambda: self._detail_steps(pair, kind))

    def _detail_steps(self, pair, kind):
        if not pair:
            yield {"detail": {}}
            return
        with torch.no_grad():
            d = composition_detail(self.model, kind, tuple(pair[:2]), tuple(pair[2:]))
        yield {"detail": {
            "kind": d.kind, "h1": list(d.h1), "h2": list(d.h2), "score": d.score,
            "erratum_score": d.erratum_score, "baseline": d.baseline, "positivity": d.positivity,
            "singular_values": encode_array(d.singular_values, "float32"),
            "eig_re": encode_array(d.eigenvalues.real, "float32"),
            "eig_im": encode_array(d.eigenvalues.imag, "float32"),
        }}
