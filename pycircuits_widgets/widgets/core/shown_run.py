"""The one run of an explorer's text that its sections show: the clean run, or a causal check's run.

An explorer reads its text once (``pcw.run``: the clean run). A causal check (an ablated head today,
a patched run tomorrow) makes another run of the same text; the sections that show a run (the
per-token loss, the attention patterns, a header saying which run it is) show the one here. The
explorer writes a new text's clean run (:meth:`ShownRun.read`), a causal section its checked run
(:meth:`ShownRun.show`, :meth:`ShownRun.withdraw`; one section's run at a time); the sections observe it (``views.registry.ViewSpec.reads_run`` and
``shows_run``), so nobody pushes into a view by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import traitlets


@dataclass(frozen=True, eq=False)  # (identity: every change notifies, even to an equal run)
class Shown:
    """One state of a :class:`ShownRun`: ``text``, its clean run ``clean`` (a ``RunResult``: ``tokens
    [1, pos]``, ``str_tokens``, ``token_loss [1, pos - 1]``, ``cache``), the checked run ``result`` shown
    instead (an ``AblationResult``: ``loss`` and ``clean_loss`` ``[1, pos - 1]``, ``cache.patterns
    [1, L, H, pos, pos]``; None: the clean run), its ``label`` ("ablated: L1.H6 (zero)"; "" for the
    clean run) and the section that wrote it, ``by`` (None: the clean run)."""

    text: str
    clean: object
    result: object = None
    label: str = ""
    by: object = None


class ShownRun(traitlets.HasTraits):
    """The run of one text that an explorer's sections show. Observe ``clean`` (a new text's clean run:
    what depends on the text alone) or ``shown`` (a :class:`Shown`: what is displayed)."""

    clean = traitlets.Any(None)
    shown = traitlets.Instance(Shown, allow_none=True)

    def read(self, text: str, clean) -> None:
        """A new text and its clean run: shown first, then ``clean`` observers run (a causal check among them
        may show its run of the new text at once)."""
        self.shown = Shown(text, clean)
        self.clean = clean

    def show(self, text: str, label: str, result, by) -> bool:
        """Show ``result``, a checked run of ``text`` labelled ``label`` made by section ``by`` (one section's
        run at a time: the others' toggles go off, ``Shown.by``); False, and nothing shown, where the text
        was replaced meanwhile (a result computed in the background)."""
        if self.shown is None or text != self.shown.text:
            return False
        self.shown = Shown(text, self.shown.clean, result, label, by)
        return True

    def withdraw(self, text: str, by) -> None:
        """Section ``by`` no longer shows its run of ``text``: the clean run again, where its run is the one
        shown (another section's stays)."""
        if self.shown is not None and self.shown.text == text and self.shown.by is by:
            self.shown = Shown(text, self.shown.clean)

    def taken_from(self, section) -> bool:
        """Whether another section's run is shown now (``section``'s toggle then goes off)."""
        return self.shown is not None and self.shown.by not in (None, section)


class RunWriter(traitlets.HasTraits):
    """A section that writes an explorer's ``ShownRun`` (``self.run``) from its runner's jobs: a job yields
    ``{"_written_run": (text, label, result)}``, applied on the kernel's thread like every result, and shown
    while ``writing()`` holds; when another section's run is shown, ``taken()`` turns this one's toggle off;
    a new text reaches ``_on_text``. Closed, the section's run is shown no more and the run not followed."""

    _written_run = traitlets.Any(None)

    def _follow_run(self) -> None:
        """Observe ``self.run`` (from the section's ``_started``)."""
        self.run.observe(self._on_text, ["clean"])
        self.run.observe(self._on_shown, ["shown"])
        self._following = True

    def _on_text(self, change) -> None:
        """A new text's clean run (``ShownRun.read``)."""

    def close(self) -> None:
        if self.__dict__.pop("_following", False):  # (close runs again from __del__)
            self.run.unobserve(self._on_text, ["clean"])
            self.run.unobserve(self._on_shown, ["shown"])
            self.run.withdraw(self.run.shown.text, self)
        super().close()

    def writing(self) -> bool:
        """Whether a run that arrives now is still wanted (its toggle still on)."""
        return True

    def taken(self) -> None:
        """Another section's run is shown now: turn this section's toggle off."""

    @traitlets.observe("_written_run")
    def _show_written(self, change) -> None:
        if change["new"] is not None and self.writing():
            self.run.show(*change["new"], by=self)

    def _on_shown(self, change) -> None:
        if self.run.taken_from(self):
            self.taken()
