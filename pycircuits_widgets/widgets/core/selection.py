"""The one selection every view shares.

Selection vocabulary (same names and meaning in every view and the explorer):

* ``layer``, ``head``: a head, written ``L1.H6`` in every label (:func:`head_label`);
* ``position``: an index into the text (-1: none);
* ``token``: a vocabulary id (-1: none);
* ``selected_pair``: a head pair ``[l1, h1, l2, h2]``, earlier head -> later head (``[]``: none).

Each index is a :class:`Index` trait: an ``int`` (``True`` is not one), range-checked by
:func:`check_range` against the bounds a view gives in ``_index_bounds``. Views link by name,
so ``ipywidgets.link((table, "head"), (plot, "head"))`` works, and the explorer drives them all.
A view's other counts (rows, pages, tokens per list) are :class:`Bounded` traits: bounds declared
with the trait, checked and refused the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import traitlets

from ...models import weight_view_hint
from .base import check_range

SELECTION_KEYS = ("layer", "head", "position", "token", "selected_pair")
"""The whole selection, as the explorer holds it (``js/src/lib/selection.js`` ``SELECTION_KEYS``; a
view follows some of them: ``views.registry.ViewSpec.follows``)."""


def head_label(layer: int, head: int) -> str:
    """The one way a head is written in the UI: ``L1.H6``."""
    return f"L{layer}.H{head}"


class Index(traitlets.Int):
    """A selection index: a Python ``int`` (``bool`` refused), range-checked by the owner's
    ``_index_bounds(name) -> (lo, hi, none_allowed)`` (``none_allowed``: -1 means none)."""

    info_text = "an int"

    def validate(self, obj, value):
        lo, hi, none = obj._index_bounds(self.name)
        return int(check_range(self.name, value, lo, hi, none=none))


class Bounded(traitlets.Int):
    """An int trait with declared bounds (as lonboard's traits declare ``min=``/``max=``): a Python
    ``int`` (``bool`` refused) in ``min..max`` (``none``: or -1, meaning none), else a ``TraitError``
    naming the trait, the valid range and the bad value (:func:`check_range`). A bound is an int or a
    function of the view's model, for one the model sets: ``max=lambda model: min(200, model.cfg.d_vocab)``.

    A constructor argument that is no trait declares its bounds the same way, as a module constant
    checked with :meth:`check` (``K.check(k, model, "k")``)."""

    info_text = "an int"

    def __init__(self, default_value: int = 0, *, min: int | Callable, max: int | Callable, none: bool = False,
                 **kwargs):
        super().__init__(default_value, **kwargs)
        self.bounds, self.none = (min, max), none

    def range(self, model=None) -> tuple[int, int]:
        """``(min, max)`` for a view of ``model`` (a bound given as a function is called with it)."""
        lo, hi = (bound(model) if callable(bound) else bound for bound in self.bounds)
        return lo, hi

    def check(self, value, model=None, name: str | None = None) -> int:
        """``value`` if it is within the bounds for ``model``, else the ``TraitError`` naming ``name``
        (default: the trait's name)."""
        return int(check_range(name or self.name, value, *self.range(model), none=self.none))

    def validate(self, obj, value):
        # a value that is no int at all gets traitlets' own message, as a plain ``Int`` trait gives it
        return self.check(super().validate(obj, value), getattr(obj, "model", None))


class Selection(traitlets.HasTraits):
    """Base of the selection mixins: ``_index_bounds`` is chained through them."""

    def _index_bounds(self, name):
        raise traitlets.TraitError(f"{type(self).__name__} has no bounds for {name!r}")


class HeadSelection(Selection):
    """Selection ``layer``/``head`` and the model shape ``n_layers``/``n_heads`` (read-only).

    A subclass sets ``n_layers``/``n_heads`` or passes the model to ``CircuitWidget.__init__``.
    """

    # -- selection --
    layer = Index(0).tag(sync=True)
    """int, default 0: selected layer, in ``0..n_layers-1``."""
    head = Index(0).tag(sync=True)
    """int, default 0: selected head within ``layer``, in ``0..n_heads-1``."""

    # -- model shape (read-only, for the pickers) --
    n_layers = traitlets.Int().tag(sync=True)
    """int (read-only): layers of the model."""
    n_heads = traitlets.Int().tag(sync=True)
    """int (read-only): heads per layer."""

    @traitlets.default("n_layers")
    def _default_n_layers(self):
        return self.model.cfg.n_layers

    @traitlets.default("n_heads")
    def _default_n_heads(self):
        return self.model.cfg.n_heads

    def _index_bounds(self, name):
        # a model without heads (zero layers) keeps the default 0, shown nowhere
        if name == "layer":
            return 0, max(self.n_layers - 1, 0), False
        if name == "head":
            return 0, max(self.n_heads - 1, 0), False
        return super()._index_bounds(name)


class TokenSelection(Selection):
    """Selection trait ``token``: a vocabulary id, or -1 for none."""

    token = Index(-1).tag(sync=True)
    """int, default -1: selected vocabulary id (``0..d_vocab-1``), -1 for none."""

    def _index_bounds(self, name):
        if name == "token":
            return 0, self.model.cfg.d_vocab - 1, True
        return super()._index_bounds(name)


class PositionSelection(Selection):
    """Selection trait ``position``: an index into the text, or -1 for none.
    A subclass gives the text length as ``_n_positions()``."""

    position = Index(-1).tag(sync=True)
    """int, default -1: selected position in the text (token index), -1 for none."""

    def _index_bounds(self, name):
        if name == "position":
            return 0, self._n_positions() - 1, True
        return super()._index_bounds(name)


class PairSelection(traitlets.HasTraits):
    """Selection trait ``selected_pair``: ``[l1, h1, l2, h2]`` with ``l1 < l2``, or ``[]`` for none.

    Selecting a pair also selects its later head (``layer``/``head`` = ``l2``/``h2``), as a
    composition cell click does. Bounds from ``self.model`` (the base sets it first).
    """

    selected_pair = traitlets.List(traitlets.Int()).tag(sync=True)
    """[l1, h1, l2, h2] with l1 < l2 (earlier head -> later head), or [] for none."""

    @traitlets.validate("selected_pair")
    def _valid_pair(self, proposal):
        pair = list(proposal["value"])
        if not pair:
            return []
        cfg = self.model.cfg
        ok = len(pair) == 4 and not any(isinstance(x, bool) for x in pair) and (
            0 <= pair[0] < pair[2] < cfg.n_layers and all(0 <= h < cfg.n_heads for h in pair[1::2]))
        if not ok:
            raise traitlets.TraitError(
                f"selected_pair must be [] or [l1, h1, l2, h2] with 0 <= l1 < l2 <= {cfg.n_layers - 1} and "
                f"heads in 0..{cfg.n_heads - 1}, got {pair}"
            )
        return pair

    @traitlets.observe("selected_pair")
    def _pair_selects_later_head(self, change):
        pair = change["new"]
        if pair and hasattr(self, "head"):
            with self.hold_trait_notifications():  # never (new layer, old head)
                self.layer, self.head = pair[2], pair[3]


def pair_key(pair) -> str:
    """``"l1,h1,l2,h2"``: the key of a pair in a view's embedded per-pair data."""
    return ",".join(str(int(x)) for x in pair)


def resolve_selection(current: dict, change: dict, token_ids, writer_of=None) -> dict:
    """The explorer's whole selection after ``change`` (some of ``layer``, ``head``, ``position``,
    ``token``, ``selected_pair``), kept consistent: a pair selects its later head; a head in layer
    >= 1 that is not the pair's later head brings the pair of its strongest K-composition writer
    (``writer_of(layer, head) -> (l1, h1) | None``); a position selects its token; a token selects
    its last position in the text (-1 if absent) unless the position already holds it; no token,
    no position. ``js/src/lib/selection.js`` ``resolveSelection`` is this rule for a page without a
    kernel (tests/browser/test_selection_rules_browser.py runs both on the same cases)."""
    out = {**current, **change}
    pair = out.get("selected_pair") or []
    if "selected_pair" in change and len(pair) == 4:
        out["layer"], out["head"] = pair[2], pair[3]
    elif (("layer" in change or "head" in change) and out["layer"] >= 1 and writer_of is not None
          and list(pair[2:]) != [out["layer"], out["head"]]):
        writer = writer_of(out["layer"], out["head"])
        if writer is not None:
            out["selected_pair"] = [*writer, out["layer"], out["head"]]
    if "position" in change and out["position"] >= 0:
        out["token"] = token_ids[out["position"]] if out["position"] < len(token_ids) else out["token"]
    elif "token" in change:
        t, p = out["token"], out["position"]
        if t < 0:
            out["position"] = -1
        elif p < 0 or p >= len(token_ids) or token_ids[p] != t:
            out["position"] = max((i for i, x in enumerate(token_ids) if x == t), default=-1)
    return out


def check_model(model, owner: str) -> None:
    """A clear error when ``model`` is not a weight view (``pcw.load_pretrained(...)`` etc.)."""
    missing = [a for a in ("cfg", "W_E", "W_Q", "W_K", "W_V", "W_O", "W_U") if not hasattr(model, a)]
    hint = weight_view_hint(model)
    if missing or hint:
        raise TypeError(
            f"{owner} needs a model with the weight view (e.g. pcw.load_pretrained('attn-only-2l'), "
            f"pcw.from_hf(hf_model, tokenizer)); got {type(model).__name__}"
            f"{' without ' + ', '.join(missing) if missing else ''}{hint}"
        )
    if model.cfg.n_layers < 1:
        raise ValueError(f"{owner} needs a model with attention layers, got n_layers=0")
