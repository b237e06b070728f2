"""The window of query - key offsets a rotary model's QK circuits are read over, as a view's control."""

from __future__ import annotations

import traitlets

from ...analysis.rotary import describe, offset_window
from .base import rolls_back

MAX_OFFSETS = 256
"""Most offsets in a window (each is one more QK circuit to read)."""


class OffsetWindow(traitlets.HasTraits):
    """Mixin (before ``CircuitWidget``): trait ``offsets`` (the window; ``[]`` for a model whose
    positions are not rotary), settable from the view's control or Python, and ``offset_note``
    stating it in the view.

    A subclass passes ``offsets`` on to ``super().__init__(model, offsets=..., ...)``, names what
    the window is read for in ``_window_what`` (refusals say it), and implements ``_on_window()``
    (recompute what the window changes); ``_window_text`` is its note with ``{how}`` where
    ``rotary.describe`` goes. ``self._offsets`` is the window as a list, or None when not rotary."""

    offsets = traitlets.List(traitlets.Int()).tag(sync=True)
    """list[int]: rotary models: the query - key offsets the QK circuits are read over (the view's
    offset control sets a contiguous range); setting it recomputes. [] for other models."""
    offset_note = traitlets.Unicode("").tag(sync=True)
    """str (read-only): rotary models: which query - key offsets the QK circuits are read at ("" otherwise)."""

    _window_text = "Rotary positions: the QK circuits are read {how}."
    _window_what = "the QK circuit"

    def __init__(self, model=None, offsets=None, **kwargs):
        self._offsets = offset_window(model, offsets, self._window_what)
        self.observe(self._on_offsets, ["offsets"])
        super().__init__(model, offsets=self._offsets or [], offset_note=self._window_note(), **kwargs)

    def _window_note(self) -> str:
        return "" if self._offsets is None else self._window_text.format(how=describe(self._offsets))

    @traitlets.validate("offsets")
    def _valid_offsets(self, proposal):
        value = list(proposal["value"])
        if self.model.cfg.positional != "rotary":
            if value:
                raise traitlets.TraitError("offsets only apply to rotary models; this model's QK circuit has no offset")
            return []
        n_ctx = self.model.cfg.n_ctx
        if not value or len(value) > MAX_OFFSETS or min(value) < 0 or max(value) >= n_ctx:
            raise traitlets.TraitError(f"offsets must be 1..{MAX_OFFSETS} query - key offsets in 0..{n_ctx - 1} "
                                       f"(the model's context), got {value}")
        return value

    @rolls_back
    def _on_offsets(self, change):
        if getattr(self, "_offsets", None) is None or list(change["new"]) == self._offsets:
            return  # still in __init__, or the same window
        self._offsets = list(change["new"])
        self.offset_note = self._window_note()
        self._on_window()

    def _on_window(self) -> None:
        raise NotImplementedError

    def _window_needs_kernel(self) -> list[str]:
        """``["offsets"]`` for ``answers.needs_kernel`` when the control exists (rotary models)."""
        return [] if self._offsets is None else ["offsets"]
