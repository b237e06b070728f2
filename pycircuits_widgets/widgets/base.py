"""The base class of every pycircuits_widgets view.

A widget is an ``anywidget.AnyWidget`` whose front end is one Svelte file in
``js/src/views/``, chosen by the ``_view`` trait. The base class adds what every view
needs: an ``error`` trait shown in the view, rejection of bad browser input while keeping
the last good state, strict keyword arguments, and a self-contained HTML export.
"""

from __future__ import annotations

import functools
import pathlib

import anywidget
import traitlets

from . import standalone
from .bundle import ensure_carrier, stub_esm
from .fallback import fallback_html


class CircuitWidget(anywidget.AnyWidget):
    """Base of all views. Subclasses set ``_view`` to the name of their Svelte file."""

    # A stub that renders with the bundle of the kernel's one BundleCarrier: the bundle is
    # sent and saved once, not once per view (no ``_css`` either: the carrier has it).
    _esm = stub_esm()

    _view = traitlets.Unicode("").tag(sync=True)
    """str: name of the Svelte view (file name in js/src/views/ without extension)."""

    error = traitlets.Unicode("").tag(sync=True)
    """str, default "": message shown in the view's error panel; empty when all is well."""

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - set(self.trait_names()))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}"
            )
        ensure_carrier()  # its comm opens before this view's
        super().__init__(**kwargs)

    # -- browser input ---------------------------------------------------------------
    def set_state(self, sync_data):
        """Apply a state change from the browser. An invalid value (TraitError) is not
        applied: the view shows the message and is sent back the last good values."""
        try:
            super().set_state(sync_data)
        except traitlets.TraitError as exc:
            self.error = str(exc)
            self.send_state([key for key in sync_data if key in self.keys])
        else:
            if self.error and "error" not in sync_data:
                self.error = ""

    # -- sharing ---------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        """The widget view plus a static ``text/html`` fallback, which renderers without
        JavaScript (a code host's notebook preview) show instead of an empty cell."""
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        return {**data, "text/html": self._fallback_html()}, metadata

    def _fallback_html(self) -> str:
        """Static HTML picture of this view drawn from its data (escaped, under
        ``pictures.BUDGET`` bytes); override for a better one."""
        return fallback_html(self)

    def save_html(self, path, *, title: str | None = None, offline: bool = True) -> pathlib.Path:
        """Write a self-contained HTML file (bundle and data inlined, no CDN, no kernel)
        that shows this view with every interaction that needs no kernel. With ``offline``
        (default) the results other selections need (each head's skip-trigram table and
        eigenvalues, head pairs' composition detail) are precomputed into the page within
        a size budget (``widgets.offline.BUDGET``); seconds of work for a 2-layer model."""
        return standalone.save_html([self], path, title=title or type(self).__name__, offline=offline)


def check_range(name: str, value: int, lo: int, hi: int, *, none: bool = False) -> int:
    """``value`` if ``lo <= value <= hi`` (or -1 meaning "none" when ``none``); else a
    ``TraitError`` naming the trait, the valid range and the bad value. For ``@traitlets.validate``."""
    if lo <= value <= hi or (none and value == -1):
        return value
    allowed = f"-1 (none) or in {lo}..{hi}" if none else f"in {lo}..{hi}"
    raise traitlets.TraitError(f"{name} must be {allowed}, got {value}")


def reports_errors(method):
    """Run a kernel-side recompute; on failure show the error in the view and keep the
    last good state (traits are only replaced once the new result is complete)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            result = method(self, *args, **kwargs)
        except Exception as exc:  # shown to the user in the view, never swallowed
            self.error = f"{type(exc).__name__}: {exc}"
            return None
        if self.error:
            self.error = ""
        return result

    return wrapper
