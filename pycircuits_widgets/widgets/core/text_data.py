"""Views whose data is computed from a ``text`` trait, on the view's runner.

A view passes ``(model, text, forward=..., one_token=...)`` to ``super().__init__``, says in
``_short_text`` why a one-token text is refused, and defines ``_text_steps(text)`` (a :data:`~.runner.Steps` generator of trait updates: the heavy
work, run on the widget's runner as the kind ``"text"``, the newest text winning). A text the
model refuses fails validation: from Python it raises, from the browser it shows in ``error``
(``CircuitWidget.set_state``), and either way the last good text and data stay. A text that
passes the check but fails in the job shows in ``error`` and leaves the last good data.
"""

from __future__ import annotations

import traitlets

from ...analysis.activations import run
from .on_demand import OnDemand


class TextData(OnDemand):
    """Mixin: ``text`` checked in its validator, its data recomputed on the runner when active.

    Args (of ``__init__``, before the base's):
        text: the first text (a refused one is a ``ValueError``).
        forward: ``forward(model, text) -> RunResult`` (default ``pcw.run``; the explorer passes
            its own, so one forward pass per text serves every view).
        one_token: accept a one-token text (nothing to show: the view is cleared) instead of
            refusing it with ``_short_text``."""

    _short_text = "it needs at least 2"

    def __init__(self, model, text, forward=None, one_token: bool = False, **kwargs):
        if not isinstance(text, str):
            raise TypeError(f"{type(self).__name__}(model, text): text must be a str, got {type(text).__name__}")
        self._first_text, self._forward, self._one_token = text, forward or run, one_token
        self._n_tokens = 0
        super().__init__(model, **kwargs)

    def _started(self) -> None:
        set_text(self, self._first_text)

    def _check_text(self, text: str) -> None:
        """Tokenise (the model refuses an unknown token or a text over ``n_ctx``) and count."""
        n = self.model.to_tokens(text).shape[-1]
        if n < 2 and not self._one_token:
            raise ValueError(f"the text has {n} token; {self._short_text}")
        self._n_tokens = n

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
