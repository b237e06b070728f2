"""PathExpansion: a model's logits on one text as the paper's sum of paths."""

from __future__ import annotations

import traitlets

from ...analysis.path_expansion import (
    LINEARISED,
    NonlinearFeatureError,
    check_path_features,
    path_expansion_steps,
    path_specs,
)
from ..core.arrays import Array
from ..core.base import CircuitWidget
from ..core.meter import metered
from ..core.payload import JSON_BUFFER
from ..core.selection import Bounded, HeadSelection, PairSelection, PositionSelection, check_model
from ..core.text_data import TextData

LADDER = ("direct path only", "+ single heads", "+ virtual heads", "full model")
"""Rungs of the loss ladder, by path order (for a 2-layer attention-only, bias-free model)."""


STAGES = {"terms": ("path expansion: terms", "terms"), "logits": ("path expansion: logits of each term", "terms"),
          "importance": ("path expansion: loss without each term", "terms")}
"""The ``progress`` text and unit of each stage of a text's job."""

MAX_TERMS = 2048
"""Most path terms the view computes (``prod_l (1 + n_heads)``; each a [pos, d_vocab] logit table, computed
twice and never all kept: ``analysis.path_expansion.PathExpansion``, "Memory")."""


class PathExpansion(TextData, HeadSelection, PositionSelection, PairSelection, CircuitWidget):
    """The logits of ``model`` on ``text`` split into the paper's path terms with attention frozen
    (``pcw.analysis.path_expansion``): the direct path, one term per head and one virtual-head term
    per pair of heads in increasing layers; with MLPs and biases, also each MLP layer's output and
    each layer's bias, and what later heads move of them. The expansion goes as deep as
    ``MAX_TERMS`` allows (``max_order``; a path at that depth reads the whole stream at its first
    head, so the terms always sum to the logits; ``expansion_note`` says which). Shows the loss ladder by path order and the ranked
    importance of each term (loss increase when that term alone is removed). Clicking a head term
    selects the head (``layer``/``head``); a virtual term selects the pair (``selected_pair``).
    Hovering (or clicking) a text position shows which terms raise the logit of the token that
    actually came next there. Everything is computed per text, so every interaction works without
    a kernel. A model whose forward has a step no sum of paths passes exactly is refused:
    at construction when no text can be expanded (``NonlinearFeatureError``, a ``ValueError``: the
    explorer shows its notice instead of the view), or per text (``refusal`` says why, no terms).

    The terms are computed on the widget's runner (``on_demand``): at once in a script, in the
    background under a kernel (``wait()`` blocks until they are in), and only once ``active``.

    Args:
        model: a weight view with at least one layer.
        text: the text the model reads.
        forward: ``forward(model, text) -> RunResult`` (default ``pcw.run``); the explorer passes
            its own, so one forward pass per text serves every view.
        active: compute now (default) or when ``active`` is first set (``on_demand``).
        one_token: accept a one-token text (nothing to predict: the view is cleared) instead of
            refusing it; the explorer, which reads any text, passes True.
    """

    _view = traitlets.Unicode("PathExpansion").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "position", "selected_pair", "text", "active"})

    # -- data (per text) --
    text = traitlets.Unicode("").tag(sync=True)
    """str: the text; setting it recomputes every term (a bad text is refused, the last good one stays)."""
    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    """[pos] display strings of the text's tokens."""
    terms = traitlets.List().tag(sync=True, **JSON_BUFFER)
    """[{"name": "L0.H4 → L1.H6", "heads": [[l, h], ...], "order": int}] in path-expansion order."""
    ladder = traitlets.List().tag(sync=True)
    """[{"label", "loss"}]: mean next-token loss with paths up to each order, then the full model's."""
    importance = Array("float32", ndim=1).tag(sync=True)
    """float32 [n_terms] (None before the first text): loss increase (nats) when the term is removed from the full sum."""
    expansion_note = traitlets.Unicode("").tag(sync=True)
    """str (read-only): what the terms are for this model (depth, MLPs and biases as sources)."""
    refusal = traitlets.Unicode("").tag(sync=True)
    """str (read-only): why this text's logits are not a sum of paths (e.g. values reaching the model's
    ``clip_qkv`` clamp), shown instead of the terms; "" when they are."""
    contributions = Array("float16", ndim=2, compress=True).tag(sync=True)
    """float16 [n_terms, pos - 1] (the view's largest array, saved with the page: shown to 3
    significant digits, deflated on the wire): each term's centred logit for the token at p + 1, from position p."""

    # -- selection: layer, head, position (the terms' contributions to the next token there),
    # selected_pair from the mixins --

    # -- display --
    top_n = Bounded(16, min=1, max=200).tag(sync=True)
    """int, default 16: how many terms the importance chart shows, most important first."""

    def __init__(self, model, text, forward=None, one_token: bool = False, **kwargs):
        check_model(model, "PathExpansion")
        cfg = model.cfg
        check_path_features(cfg)
        self._max_order = deepest_order(cfg)
        self._first_position = kwargs.pop("position", -1)  # validated against the text, once it is set
        super().__init__(model, text, forward, one_token, expansion_note=expansion_note(cfg, self._max_order),
                         **kwargs)

    _short_text = "the loss needs at least 2"

    def _started(self) -> None:
        super()._started()
        self.position = self._first_position

    def _ready(self) -> bool:
        return bool(self.terms)

    @traitlets.observe("text")
    def _clip_position(self, change):
        if self.position >= self._n_tokens:
            self.position = -1

    def _text_steps(self, text: str):
        """The text's forward, then the terms, their logits and their importances, one term a piece
        (each stage metered apart: ``STAGES``)."""
        out = self._forward(self.model, text)
        cleared = {"tokens": list(out.str_tokens[0]), "terms": [], "ladder": [], "importance": None,
                   "contributions": None, "refusal": "", "progress": {}}
        if out.tokens.shape[-1] < 2:  # nothing to predict
            yield cleared
            return
        try:
            pe = yield from metered(path_expansion_steps(self.model, out, self._max_order), {None: STAGES["terms"]})
            yield from metered(pe.readout_steps(), {None: STAGES["logits"]})
            by_order = pe.loss_by_order().tolist()
            importance = yield from metered(pe.term_importance_steps(), {None: STAGES["importance"]})
            contributions = pe.next_token_contributions()[:, 0]
        except NonlinearFeatureError as exc:  # this text, not the view: no terms rather than wrong ones
            yield {**cleared, "refusal": str(exc)}
            return
        plain = {t.source for t in pe.terms} == {"embed"}  # the paper's attention-only, bias-free expansion
        labels = list(LADDER[:len(by_order)]) if plain and len(by_order) <= 3 else [
            f"terms of order ≤ {n}" for n in range(len(by_order))]
        yield {
            "tokens": list(out.str_tokens[0]),
            "terms": [{"name": t.name, "heads": [list(h) for h in t.heads], "order": t.order} for t in pe.terms],
            "ladder": [{"label": lab, "loss": loss} for lab, loss in zip(labels, by_order)]
            + [{"label": LADDER[-1], "loss": float(out.loss)}],
            "importance": importance,
            "contributions": contributions,
            "refusal": "", "progress": {},
        }

    def _n_positions(self) -> int:
        return self._n_tokens


def deepest_order(cfg) -> int:
    """The largest ``max_order`` whose expansion has at most ``MAX_TERMS`` terms (at least 1: each
    head's whole output). Counted upwards: the number of paths grows as ``n_heads ** order``."""
    best = 1
    for order in range(2, cfg.n_layers + 1):
        if len(path_specs(cfg, order)) > MAX_TERMS:
            break
        best = order
    return best


def expansion_note(cfg, max_order: int) -> str:
    """One sentence for the view: what its terms are for a model of config ``cfg``, and what they sum to."""
    parts = []
    if not cfg.attn_only:
        parts.append("each MLP layer's output (as the forward pass computed it) is a source, read by the "
                     "unembedding and by later heads; an MLP counts 1 toward a term's order")
    if max_order < cfg.n_layers:
        parts.append(f"paths go through at most {max_order} head{'s' if max_order > 1 else ''}, and a path at "
                     "that depth reads the whole residual stream at its first head")
    parts += [LINEARISED[f] for f in cfg.nonlinear_features if f not in ("final_softcap", "clip_qkv")]
    if not parts and cfg.final_softcap is None:
        return ""
    frozen = "Attention and the norms' divisions frozen from the forward pass"
    total = ("The terms sum exactly to the model's logits before its final soft-cap "
             f"({cfg.final_softcap:g} · tanh(logits / {cfg.final_softcap:g})), which the loss ladder and the "
             "importances apply to each sum." if cfg.final_softcap is not None
             else "The terms sum exactly to the model's logits.")
    return f"{frozen}; {'; '.join(parts)}. {total}" if parts else f"{frozen}. {total}"
