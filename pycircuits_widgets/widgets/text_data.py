"""Views whose data is computed from a ``text`` trait, on the view's runner.

A view defines ``_check_text(text)`` (cheap: tokenise, lengths; raises ``ValueError``/``TypeError``)
and ``_text_steps(text)`` (a :data:`~.runner.Steps` generator of trait updates: the heavy
work, run on the widget's runner as the kind ``"text"``, the newest text winning). A text the
model refuses fails validation: from Python it raises, from the browser it shows in ``error``
(``CircuitWidget.set_state``), and either way the last good text and data stay. A text that
passes the check but fails in the job shows in ``error`` and leaves the last good data.
"""

from __future__ import annotations

import traitlets

from .on_demand import OnDemand


class TextData(OnDemand):
    """Mixin: ``text`` checked in its validator, its data recomputed on the runner when active."""

    @traitlets.validate("text")
    def _valid_text(self, proposal):
        try:
            self._check_text(proposal["value"])
        except (ValueError, TypeError) as exc:
            raise traitlets.TraitError(f"text refused: {exc}") from None
        return proposal["value"]

    @traitlets.observe("text")
    def _text_changed(self, change):
        if self._computing:  # (not while the constructor sets the first text: the start submits it)
            self._submit_text()

    def _submit_text(self) -> None:
        text = self.text
        self._runner.submit("text", lambda: self._text_steps(text))

    def _start(self) -> None:
        self._submit_text()


def set_text(widget, text: str) -> None:
    """Set the first text in a constructor: a refused text is a ``ValueError`` there (a bad argument)."""
    try:
        widget.text = text
    except traitlets.TraitError as exc:
        raise ValueError(str(exc)) from None
