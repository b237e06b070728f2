"""Views whose data can take minutes at large shapes: computed on the widget's Runner, on first use.

At GPT-2-small shapes the induction view's pair verdicts and tables took minutes and the
virtual heads two, so these views never compute in a constructor or an observer: their work
is a :class:`~.runner.Runner` job (per kind of result), started when the view is
``active``. A view built alone is active (under a kernel it shows "computing…" and fills in
when the job is done; in a script the job runs at once). The explorer builds its paper views
inactive, so building it costs nothing more; a view starts when its section's "compute"
button (or Python: ``view.active = True``) asks for it. ``wait()`` covers the jobs.

Its jobs are work the user asked for: they give way to clicks between pieces (``runner``), show
how far they are (``progress``, with an estimate where the job is metered: ``meter``), and stop
when cancelled: ``view.cancel()`` in Python, the view's "cancel" button in the browser (both
set ``active`` False). The view keeps what it had computed, says "cancelled", and its "restart"
button (or ``view.active = True``) starts it again.
"""

from __future__ import annotations

import html

import traitlets

from .meter import cancelled


class OnDemand(traitlets.HasTraits):
    """Mixin (before ``CircuitWidget``): ``active`` starts the view's jobs (``_start()``) on its
    runner, then its kernel-less answers (``_answers_offline``). A subclass implements ``_start()``
    (submit every job the current state needs) and ``_ready()`` (whether there is data to draw
    for the current selection); the base wires the rest."""

    # -- display --
    active = traitlets.Bool(True).tag(sync=True)
    """bool, default True: the view's data is wanted. False: nothing is computed until it is set
    True (the view's "compute" or "restart" button, or Python); set False while computing, it
    cancels (:meth:`cancel`)."""

    _tier = "asked"
    _computing = False  # whether the view's jobs are started (and not cancelled since)

    def _begin(self) -> None:
        self.observe(self._on_active, ["active"])
        if self.active:
            self._restart()

    def _restart(self) -> None:
        """(Re)submit every job the current state needs, then the kernel-less answers (after them:
        the runner runs one job at a time, in order)."""
        self._computing = True
        self.progress = {}
        self._start()
        if self._answers_offline:
            self._share_offline()

    def cancel(self) -> None:
        """Stop the view's jobs between two pieces (``active`` goes False). What was computed stays
        shown; ``progress`` says "cancelled" (with the count reached, if the job counted); setting
        ``active`` True again (the view's "restart" button) starts the work again."""
        self.active = False

    def _on_active(self, change):
        if change["new"] and not change["old"]:
            self._restart()
        elif change["old"] and not change["new"]:
            self._computing = False
            self._runner.cancel_all()
            self.progress = cancelled(self.progress)

    def _start(self) -> None:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _fallback_html(self) -> str:
        """The static picture, or a line saying why there is none yet (nothing computed, or
        nothing selected)."""
        if self._ready():
            return super()._fallback_html()
        why = "not computed yet (it is computed in a kernel on first use)" if not self.active else "nothing to show yet"
        return f"<p>{html.escape(type(self).__name__)}: {why}</p>"
