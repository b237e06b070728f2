"""Views whose data is computed from a ``text`` trait: computed in its validator, applied at once.

A view defines ``_compute(text) -> {trait: value}`` and keeps ``text`` as a synced trait. A text the
model refuses (too long, unknown token, ...) fails validation: from Python it raises, from the browser
it shows in ``error`` (``CircuitWidget.set_state``), and either way the last good text and data stay.
"""

from __future__ import annotations

import traitlets


class TextData(traitlets.HasTraits):
    """Mixin: ``text`` whose data is recomputed (by ``self._compute``) before the text is accepted."""

    _pending: dict | None = None

    @traitlets.validate("text")
    def _valid_text(self, proposal):
        try:
            self._pending = self._compute(proposal["value"])
        except (ValueError, TypeError) as exc:
            raise traitlets.TraitError(f"text refused: {exc}") from None
        return proposal["value"]

    @traitlets.observe("text")
    def _apply_text_data(self, change):
        data, self._pending = self._pending, None
        if data is not None:
            with self.hold_sync():
                self._before_apply(data)
                for name, value in data.items():
                    setattr(self, name, value)

    def _before_apply(self, data: dict) -> None:
        """Hook: adjust the selection to the new data (e.g. drop a position past the end)."""


def set_text(widget, text: str) -> None:
    """Set the first text in a constructor: a refused text is a ``ValueError`` there (a bad argument)."""
    try:
        widget.text = text
    except traitlets.TraitError as exc:
        raise ValueError(str(exc)) from None
