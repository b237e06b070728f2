"""Views whose data can take minutes at large shapes: computed on the widget's Runner, on first use.

At GPT-2-small shapes the induction view's pair verdicts and tables took minutes and the
virtual heads two, so these views never compute in a constructor or an observer: their work
is a :class:`~.runner.Runner` job (per kind of result), started when the view is
``active``. A view built alone is active (under a kernel it shows "computing…" and fills in
when the job is done; in a script the job runs at once). The explorer builds its paper views
inactive, so building it costs nothing more; a view starts when its section's "compute"
button (or Python: ``view.active = True``) asks for it. ``wait()`` covers the jobs.
"""

from __future__ import annotations

import html

import traitlets


class OnDemand(traitlets.HasTraits):
    """Mixin (before ``CircuitWidget``): ``active`` starts the view's jobs (``_start()``) on its
    runner, then its kernel-less answers (``_answers_offline``). A subclass implements ``_start()``
    (submit every job the current state needs) and ``_ready()`` (whether there is data to draw
    for the current selection); the base wires the rest."""

    # -- display --
    active = traitlets.Bool(True).tag(sync=True)
    """bool, default True: the view's data is wanted. False: nothing is computed until it is set
    True (the view's "compute" button, or Python); it cannot be turned off again."""

    # Whether the view's jobs were started. The validator reads this, not ``self.active``:
    # inside ``hold_trait_notifications`` (every browser write) traitlets validates after the
    # new value is already set, so ``self.active`` would read False there.
    _computing = False

    def _begin(self) -> None:
        self.observe(self._on_active, ["active"])
        if self.active:
            self._restart()

    def _restart(self) -> None:
        """(Re)submit every job the current state needs, then the kernel-less answers (after them:
        the runner runs one job at a time, in order)."""
        self._computing = True
        self._start()
        if self._answers_offline:
            self._share_offline()

    @traitlets.validate("active")
    def _valid_active(self, proposal):
        if self._computing and not proposal["value"]:
            raise traitlets.TraitError("active cannot be turned off once the view is computing")
        return proposal["value"]

    def _on_active(self, change):
        if change["new"] and not change["old"]:
            self._restart()

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
