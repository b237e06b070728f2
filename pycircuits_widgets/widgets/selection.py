"""The one selection every view shares, and the one runner that recomputes for it.

Selection vocabulary (same names and meaning in every view and the explorer):

* ``layer``, ``head``: a head, written ``L1.H6`` in every label (:func:`head_label`);
* ``position``: an index into the text (-1: none);
* ``token``: a vocabulary id (-1: none).

Each is a :class:`Index` trait: an ``int`` (``True`` is not one), range-checked by the
one validator :meth:`Selection._check_index` against the bounds a view gives in
``_index_bounds``. Views link by name, so ``ipywidgets.link((table, "head"), (plot, "head"))``
works, and the explorer drives them all.

:class:`Runner` runs a widget's recomputes. Each request has a *kind* (a head's table, a
token query, a detail panel): per kind at most one job runs and one waits, and a newer
request of a kind makes the older one stale, stopped at its next chunk (``yield``); kinds
never drop each other. Under a Jupyter kernel the work runs on one worker thread per widget
and every result is applied on the kernel's IO-loop thread (never ``setattr`` from the
worker); in a plain script (no kernel) requests run synchronously, so nothing is left
running at exit.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Callable, Iterator

import traitlets

from ..models import weight_view_hint
from .base import check_range


def head_label(layer: int, head: int) -> str:
    """The one way a head is written in the UI: ``L1.H6``."""
    return f"L{layer}.H{head}"


class Index(traitlets.Int):
    """A selection index: a Python ``int`` (``bool`` refused), range-checked by the owner's
    ``_index_bounds(name) -> (lo, hi, none_allowed)`` (``none_allowed``: -1 means none)."""

    info_text = "an int"

    def validate(self, obj, value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise traitlets.TraitError(f"{self.name} must be an int, got {value!r} ({type(value).__name__})")
        lo, hi, none = obj._index_bounds(self.name)
        return check_range(self.name, int(value), lo, hi, none=none)


class Selection(traitlets.HasTraits):
    """Base of the selection mixins: ``_index_bounds`` is chained through them."""

    def _index_bounds(self, name):
        raise traitlets.TraitError(f"{type(self).__name__} has no bounds for {name!r}")


class HeadSelection(Selection):
    """Selection ``layer``/``head`` and the model shape ``n_layers``/``n_heads`` (read-only).

    A subclass sets ``n_layers``/``n_heads`` (or ``self.model`` before ``super().__init__``).
    """

    # -- selection --
    layer = Index(0).tag(sync=True)
    """int, default 0: selected layer, in ``0..n_layers-1``."""
    head = Index(0).tag(sync=True)
    """int, default 0: selected head within ``layer``, in ``0..n_heads-1``."""

    # -- model shape (read-only, for the pickers) --
    n_layers = traitlets.Int().tag(sync=True)
    """int (read-only): layers of the model."""
    n_heads = traitlets.Int().tag(sync=True)
    """int (read-only): heads per layer."""

    @traitlets.default("n_layers")
    def _default_n_layers(self):
        return self.model.cfg.n_layers

    @traitlets.default("n_heads")
    def _default_n_heads(self):
        return self.model.cfg.n_heads

    def _index_bounds(self, name):
        # a model without heads (zero layers) keeps the default 0, shown nowhere
        if name == "layer":
            return 0, max(self.n_layers - 1, 0), False
        if name == "head":
            return 0, max(self.n_heads - 1, 0), False
        return super()._index_bounds(name)


class TokenSelection(Selection):
    """Selection trait ``token``: a vocabulary id, or -1 for none."""

    token = Index(-1).tag(sync=True)
    """int, default -1: selected vocabulary id (``0..d_vocab-1``), -1 for none."""

    def _index_bounds(self, name):
        if name == "token":
            return 0, self.model.cfg.d_vocab - 1, True
        return super()._index_bounds(name)


class PositionSelection(Selection):
    """Selection trait ``position``: an index into the text, or -1 for none.
    A subclass gives the text length as ``_n_positions()``."""

    position = Index(-1).tag(sync=True)
    """int, default -1: selected position in the text (token index), -1 for none."""

    def _index_bounds(self, name):
        if name == "position":
            return 0, self._n_positions() - 1, True
        return super()._index_bounds(name)


def resolve_selection(current: dict, change: dict, token_ids, writer_of=None) -> dict:
    """The explorer's whole selection after ``change`` (some of ``layer``, ``head``, ``position``,
    ``token``, ``selected_pair``), kept consistent: a pair selects its later head; a head in layer
    >= 1 that is not the pair's later head brings the pair of its strongest K-composition writer
    (``writer_of(layer, head) -> (l1, h1) | None``); a position selects its token; a token selects
    its last position in the text (-1 if absent) unless the position already holds it; no token,
    no position. ``js/src/lib/selection.js`` ``resolveSelection`` is this rule for a page without a
    kernel (tests/test_selection_rules.py runs both on the same cases)."""
    out = {**current, **change}
    pair = out.get("selected_pair") or []
    if "selected_pair" in change and len(pair) == 4:
        out["layer"], out["head"] = pair[2], pair[3]
    elif ("layer" in change or "head" in change) and out["layer"] >= 1 and writer_of is not None:
        if list(pair[2:]) != [out["layer"], out["head"]]:
            writer = writer_of(out["layer"], out["head"])
            if writer is not None:
                out["selected_pair"] = [*writer, out["layer"], out["head"]]
    if "position" in change and out["position"] >= 0:
        out["token"] = token_ids[out["position"]] if out["position"] < len(token_ids) else out["token"]
    elif "token" in change:
        t, p = out["token"], out["position"]
        if t < 0:
            out["position"] = -1
        elif p < 0 or p >= len(token_ids) or token_ids[p] != t:
            out["position"] = max((i for i, x in enumerate(token_ids) if x == t), default=-1)
    return out


def check_model(model, owner: str) -> None:
    """A clear error when ``model`` is not a weight view (``pcw.load_pretrained(...)`` etc.)."""
    missing = [a for a in ("cfg", "W_E", "W_Q", "W_K", "W_V", "W_O", "W_U") if not hasattr(model, a)]
    hint = weight_view_hint(model)
    if missing or hint:
        raise TypeError(
            f"{owner} needs a model with the weight view (e.g. pcw.load_pretrained('attn-only-2l'), "
            f"pcw.from_hf(hf_model, tokenizer)); got {type(model).__name__}"
            f"{' without ' + ', '.join(missing) if missing else ''}{hint}"
        )
    if model.cfg.n_layers < 1:
        raise ValueError(f"{owner} needs a model with attention layers, got n_layers=0")


# A recompute: a generator of trait updates (dicts name -> value; None is a checkpoint with
# no update). Each yield is a chunk boundary where stale work stops.
Steps = Iterator["dict | None"]


def _kernel_loop():
    """The running kernel's IO loop (tornado), or None outside a kernel."""
    if "ipykernel" not in sys.modules:
        return None
    from ipykernel.kernelbase import Kernel

    if not Kernel.initialized():
        return None
    return getattr(Kernel.instance(), "io_loop", None)


class _Job:
    __slots__ = ("kind", "make", "generation", "background", "steps")

    def __init__(self, kind: str, make: Callable[[], Steps], generation: int, background: bool = False):
        self.kind, self.make, self.generation, self.background = kind, make, generation, background
        self.steps = None  # the running generator of updates, kept while a background job is parked


_shutting_down = threading.Event()
if hasattr(threading, "_register_atexit"):  # before non-daemon threads are joined at exit
    threading._register_atexit(_shutting_down.set)


class Runner:
    """One widget's recomputes: per kind of result, one job running and one pending.

    ``submit(kind, make)``: ``make()`` returns a :data:`Steps` generator. A newer submit of
    the same kind makes the older stale (stopped between chunks, its results dropped);
    other kinds are untouched. ``widget.busy`` is True while any job is pending, running or
    has results not yet applied. A failing job shows ``"<kind>: <error>"`` in
    ``widget.error`` and leaves the last good traits; the next success of that kind clears it.

    ``submit(kind, make, background=True)``: work nobody waits to see (the kernel-less answers,
    ``widgets/offline.py``): it never sets ``busy`` and yields to any other request at its
    next chunk, resuming once that is done; ``wait()`` still covers it. Under no kernel it is
    not run at all (``submit`` returns False): a script saves nothing until ``save_html``.

    ``loop``: where results are applied. Default: the running kernel's IO loop (a worker
    thread computes, ``loop.add_callback`` applies); None: run synchronously in ``submit``.
    """

    def __init__(self, widget, loop="kernel"):
        self._widget = widget
        self._loop = _kernel_loop() if loop == "kernel" else loop
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation: dict[str, int] = collections.defaultdict(int)
        self._pending: dict[str, _Job] = {}  # kind -> newest job not started
        self._running: _Job | None = None
        self._results: collections.deque = collections.deque()  # (job, update | exception)
        self._worker: threading.Thread | None = None
        self._failed: dict[str, str] = {}  # kind -> message shown in error
        self._applying = False

    # -- requests (kernel thread) ------------------------------------------------------------
    def submit(self, kind: str, make: Callable[[], Steps], *, background: bool = False) -> bool:
        if background and self._loop is None:
            return False
        with self._lock:
            self._generation[kind] += 1
            self._pending[kind] = _Job(kind, make, self._generation[kind], background)
            if self._loop is not None:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._work, name="pcw-runner")
                    self._worker.start()
                self._changed.notify_all()
        if self._loop is not None:
            if not background:
                self._set_busy(True)
        elif not self._applying:
            self._run_sync()
        return True

    def current(self, job: _Job) -> bool:
        return job.generation == self._generation[job.kind] and not _shutting_down.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every request is done and applied (True), or ``timeout`` s (False).
        Call it from the kernel thread (a cell, a test): it applies the results itself."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._drain():
            with self._lock:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not self._results and (self._pending or self._running is not None):
                    self._changed.wait(left)
        return True

    # -- synchronous mode ----------------------------------------------------------------------
    def _run_sync(self) -> None:
        self._applying = True
        try:
            while self._pending:
                kind = next(iter(self._pending))
                job = self._pending.pop(kind)
                for item in self._steps(job):
                    if item is not None:
                        self._apply(job, item)
                    if isinstance(item, BaseException) and not isinstance(item, Exception):
                        raise item  # Ctrl-C in a script still stops it, the view showing why
        finally:
            self._applying = False

    # -- worker thread: computes, never touches traits -------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._pending or _shutting_down.is_set():
                    self._pending.clear()
                    self._worker = None
                    self._changed.notify_all()
                    return
                kind = next((k for k, j in self._pending.items() if not j.background), next(iter(self._pending)))
                job = self._running = self._pending.pop(kind)
            try:
                if job.steps is None:
                    job.steps = self._steps(job)
                for item in job.steps:
                    if item is not None:
                        with self._lock:
                            self._results.append((job, item))
                            self._changed.notify_all()
                        self._post()
                    if job.background and self._park(job):
                        break
            finally:  # whatever ends the job, the runner takes the next one (busy goes off)
                with self._lock:
                    self._running = None
                    self._changed.notify_all()
                self._post()

    def _park(self, job: _Job) -> bool:
        """A background job yields to waiting requests: back in the queue, resumed later
        (dropped if a newer request of its kind is waiting)."""
        with self._lock:
            if not any(not j.background for j in self._pending.values()):
                return False
            if job.kind in self._pending:
                job.steps.close()
            else:
                self._pending[job.kind] = job
            return True

    def _post(self) -> None:
        try:
            self._loop.add_callback(self._drain)
        except RuntimeError:  # the kernel's loop is closed (shutting down): nothing to show
            pass

    def _steps(self, job: _Job):
        """The job's updates while it is current (stale: stop at the next chunk), None at
        each chunk boundary; a failure is yielded as the exception. That includes a
        ``KeyboardInterrupt``/``SystemExit`` raised by the job: on a worker it would otherwise
        end the thread and leave ``busy`` on and every later request unserved (synchronously,
        ``_run_sync`` raises it again once the view shows it)."""
        steps = None
        try:
            steps = job.make()
            for update in steps:
                if not self.current(job):
                    return
                yield update or None
        except GeneratorExit:  # closed (stale, or a parked job dropped): nothing to report
            raise
        except BaseException as exc:  # shown in the view by _apply
            if self.current(job):
                yield exc
        finally:
            if steps is not None and hasattr(steps, "close"):
                steps.close()

    # -- applying (kernel thread) ----------------------------------------------------------------
    def _drain(self) -> bool:
        """Apply the queued results in order; True when all work is done (``busy`` goes off
        once all but background work is done)."""
        while True:
            with self._lock:
                entry = self._results.popleft() if self._results else None
                idle = entry is None and not self._pending and self._running is None
                shown = entry is None and all(j.background for j in self._pending.values()) and (
                    self._running is None or self._running.background)
            if entry is None:
                if shown:
                    self._set_busy(False)
                return idle
            job, item = entry
            if self.current(job):
                self._apply(job, item)

    def _apply(self, job: _Job, item) -> None:
        widget = self._widget
        if isinstance(item, BaseException):
            message = f"{job.kind}: {type(item).__name__}" + (f": {item}" if str(item) else "")
            self._failed[job.kind] = message
            widget.error = message
            return
        try:
            with widget.hold_sync():
                for name, value in item.items():
                    setattr(widget, name, value)
        except Exception as exc:  # an observer of the update failed: say so, keep going
            self._failed[job.kind] = widget.error = f"{job.kind}: {type(exc).__name__}: {exc}"
            return
        shown = self._failed.pop(job.kind, None)
        if shown is not None and widget.error == shown:
            widget.error = ""

    def _set_busy(self, value: bool) -> None:
        if self._widget.busy != value:
            self._widget.busy = value
