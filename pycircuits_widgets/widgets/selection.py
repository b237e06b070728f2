"""The selection every circuit view shares, and kernel-side recomputes that never block it.

``HeadSelection`` gives a view the synced traits ``layer``, ``head`` and ``busy``;
``TokenSelection`` adds ``token``. Every view names them the same way, so
``ipywidgets.link((table, "head"), (plot, "head"))`` (or ``jslink``) ties views together
and an explorer can drive them all.

``Recompute`` runs a view's recompute off the kernel's message thread. A newer request
supersedes an older one: the running computation is abandoned at its next checkpoint
(each partial result it yields) and its results are dropped, so a burst of clicks costs
at most one stale block of work, and the view ends on the newest selection.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator

import traitlets


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
        return _in_range("layer", proposal["value"], self.model.cfg.n_layers)

    @traitlets.validate("head")
    def _valid_head(self, proposal):
        return _in_range("head", proposal["value"], self.model.cfg.n_heads)


class TokenSelection(traitlets.HasTraits):
    """Selection trait ``token``: a vocabulary id, or -1 for none."""

    token = traitlets.Int(-1).tag(sync=True)
    """int, default -1: selected vocabulary id (``0..d_vocab-1``), -1 for none."""

    @traitlets.validate("token")
    def _valid_token(self, proposal):
        value = proposal["value"]
        return value if value == -1 else _in_range("token", value, self.model.cfg.d_vocab, none=True)


def _in_range(name: str, value: int, n: int, none: bool = False) -> int:
    if not 0 <= value < n:
        allowed = f"-1 (none) or in 0..{n - 1}" if none else f"in 0..{n - 1}"
        raise traitlets.TraitError(f"{name} must be {allowed} for this model, got {value}")
    return value


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
    """Runs ``widget``'s recomputes in one worker thread; the newest request wins.

    ``submit(steps)`` with ``steps()`` returning an iterator of trait updates. Each yielded
    update is applied (under ``hold_sync``) only while its request is still the newest;
    once a newer request arrives the iterator is closed at its next ``yield``. Failures of
    the newest request set ``widget.error`` and leave the last good traits in place.
    ``widget.busy`` is True from a submit until the newest request has finished.
    """

    def __init__(self, widget):
        self._widget = widget
        self._lock = threading.RLock()  # an applied update may trigger a submit
        self._generation = 0
        self._pending: tuple[int, Callable[[], Steps]] | None = None
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()

    def submit(self, steps: Callable[[], Steps]) -> None:
        with self._lock:
            self._generation += 1
            self._pending = (self._generation, steps)
            self._idle.clear()
            self._widget.busy = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="pcw-recompute", daemon=True)
                self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no request is pending or running (tests, scripts); True if idle."""
        return self._idle.wait(timeout)

    def current(self, generation: int) -> bool:
        return generation == self._generation

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._pending is None:
                    self._thread = None
                    self._widget.busy = False
                    self._idle.set()
                    return
                generation, steps = self._pending
                self._pending = None
            self._run(generation, steps)

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
