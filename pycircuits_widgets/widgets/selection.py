"""The selection every circuit view shares, and kernel-side recomputes that never block it.

``HeadSelection`` gives a view the synced traits ``layer``, ``head`` and ``busy``;
``TokenSelection`` adds ``token``. Every view names them the same way, so
``ipywidgets.link((table, "head"), (plot, "head"))`` (or ``jslink``) ties views together
and an explorer can drive them all.

``Recompute`` runs a view's recompute off the kernel's message thread. A newer request
supersedes an older one: it starts at once, the older computation is abandoned at its next
checkpoint (each partial result it yields) and its results are dropped, so the view always
ends on the newest selection.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import traitlets

from .base import check_range


class HeadSelection(traitlets.HasTraits):
    """Selection traits ``layer`` / ``head`` validated against ``self.model.cfg``, plus ``busy``.

    A subclass sets ``self.model`` before ``super().__init__`` and observes ``layer``/``head``.
    """

    # -- selection --
    layer = traitlets.Int(0).tag(sync=True)
    """int, default 0: selected layer, in ``0..n_layers-1``."""
    head = traitlets.Int(0).tag(sync=True)
    """int, default 0: selected head within ``layer``, in ``0..n_heads-1``."""

    # -- status --
    busy = traitlets.Bool(False).tag(sync=True)
    """bool: True while the kernel recomputes for the current selection (view shows a spinner)."""

    # -- model shape (read-only, for the pickers) --
    _n_layers = traitlets.Int().tag(sync=True)
    _n_heads = traitlets.Int().tag(sync=True)

    @traitlets.default("_n_layers")
    def _default_n_layers(self):
        return self.model.cfg.n_layers

    @traitlets.default("_n_heads")
    def _default_n_heads(self):
        return self.model.cfg.n_heads

    @traitlets.validate("layer")
    def _valid_layer(self, proposal):
        return check_range("layer", proposal["value"], 0, self.model.cfg.n_layers - 1)

    @traitlets.validate("head")
    def _valid_head(self, proposal):
        return check_range("head", proposal["value"], 0, self.model.cfg.n_heads - 1)


class TokenSelection(traitlets.HasTraits):
    """Selection trait ``token``: a vocabulary id, or -1 for none."""

    token = traitlets.Int(-1).tag(sync=True)
    """int, default -1: selected vocabulary id (``0..d_vocab-1``), -1 for none."""

    @traitlets.validate("token")
    def _valid_token(self, proposal):
        return check_range("token", proposal["value"], 0, self.model.cfg.d_vocab - 1, none=True)


def check_model(model, owner: str) -> None:
    """A clear error when ``model`` is not a weight view (``pcw.load_pretrained(...)`` etc.)."""
    missing = [a for a in ("cfg", "W_E", "W_Q", "W_K", "W_V", "W_O", "W_U") if not hasattr(model, a)]
    if missing:
        raise TypeError(
            f"{owner} needs a model with the weight view (e.g. pcw.load_pretrained('attn-only-2l')); "
            f"got {type(model).__name__} without {', '.join(missing)}"
        )
    if model.cfg.n_layers < 1:
        raise ValueError(f"{owner} needs a model with attention layers, got n_layers=0")


# A recompute: yields one or more states (dicts trait name -> value); the last is final.
Steps = Iterator[dict]


class Recompute:
    """Runs ``widget``'s recomputes off the kernel thread; the newest request wins.

    ``submit(steps)`` with ``steps()`` returning an iterator of trait updates. Each request
    gets its own thread, so a newer selection never waits behind an older computation (a
    torch call cannot be interrupted; a stale one finishes its current step on its own
    thread and its result is dropped). A request first waits ``DEBOUNCE_S`` and is skipped if
    a newer one arrived meanwhile, so a burst of clicks or held arrow keys costs one
    recompute. Each yielded update is applied (under ``hold_sync``) only while its request
    is the newest; a stale iterator is closed at its next ``yield``. A failure of the newest
    request sets ``widget.error`` and leaves the last good traits in place. ``widget.busy``
    is True from a submit until the newest request has finished.
    """

    DEBOUNCE_S = 0.02

    def __init__(self, widget):
        self._widget = widget
        self._lock = threading.RLock()  # an applied update may trigger a submit
        self._generation = 0
        self._finished = 0
        self._done = threading.Condition(self._lock)

    def submit(self, steps: Callable[[], Steps]) -> None:
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._widget.busy = True
        threading.Thread(target=self._thread, args=(generation, steps), name="pcw-recompute", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the newest request has finished (tests, scripts); True if it has."""
        with self._done:
            return self._done.wait_for(lambda: self._finished == self._generation, timeout)

    def current(self, generation: int) -> bool:
        return generation == self._generation

    def _thread(self, generation: int, steps: Callable[[], Steps]) -> None:
        try:
            time.sleep(self.DEBOUNCE_S)
            if self.current(generation):
                self._run(generation, steps)
        finally:
            with self._done:
                if self.current(generation):
                    self._finished = generation
                    self._widget.busy = False
                    self._done.notify_all()

    def _run(self, generation: int, steps: Callable[[], Steps]) -> None:
        widget = self._widget
        iterator = None
        try:
            iterator = steps()
            for update in iterator:
                with self._lock:  # apply atomically w.r.t. a newer submit
                    if not self.current(generation):
                        return
                    with widget.hold_sync():
                        for name, value in update.items():
                            setattr(widget, name, value)
                        if widget.error:
                            widget.error = ""
        except Exception as exc:  # shown in the view; the last good state stays
            with self._lock:
                if self.current(generation):
                    widget.error = f"{type(exc).__name__}: {exc}"
        finally:
            if iterator is not None and hasattr(iterator, "close"):
                iterator.close()


def apply_now(widget, steps: Steps) -> dict:
    """Run a recompute synchronously (direct calls from Python); returns the final update."""
    final: dict = {}
    for update in steps:
        with widget.hold_sync():
            for name, value in update.items():
                setattr(widget, name, value)
        final = update
    if widget.error:
        widget.error = ""
    return final
