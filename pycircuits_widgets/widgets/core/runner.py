"""The one runner of a view's recomputes: per kind of result, the newest job wanted.

:class:`Runner` runs a widget's recomputes. Each request has a *kind* (a head's table, a
token query, a detail panel): per kind one job is wanted, and a newer request of a kind makes the
older one stale, stopped at its next chunk (``yield``); kinds never drop each other. Under a
Jupyter kernel the pieces run on the process's one scheduler (``scheduler.py``: a fixed set of
workers, one queue ordered by tier) and every result is applied on the kernel's IO-loop thread
(never ``setattr`` from a worker), holding :data:`APPLY`; in a plain script (no kernel) requests
run synchronously, so nothing is left running at exit. Every view has one (``CircuitWidget._runner``).

A job's tier (``scheduler``'s docstring) is its runner's (``Runner(tier=...)``: a view's clicks,
or an on-demand section's asked-for work) unless its submit names one: ``tier="fill"`` for work
nobody waits to see (the explorer's precompute, the kernel-less answers), ``tier="asked"`` for a
view's part the reader started (the measured composition). A click's steps may yield ``GIVE_WAY``:
the rest of it is asked-for work from there (the exact skip-trigram table after its partial one).

**Compute threads.** Every low-precision screen (the exact skip-trigram table's, and
``FactoredMatrix.topk``'s) runs its tiles on the process's one compute pool (``compute_pool``: a
single-thread worker per core), served by tier (:data:`PRIORITY`): a click's tiles first, then
asked-for work's, then the fill's, decided at each tile. The rest of a piece's torch work (a
forward, the exact table's exact GEMMs, eigenvalues) runs on its scheduler worker at torch's
intra-op count (``torch.get_num_threads()``), in every tier: the fill's results are then the very
numbers a click computes (a GEMM's float32 rounding can depend on its thread count).
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable, Iterator

from ... import compute_pool
from ... import progress as bars
from . import scheduler
from .scheduler import ASKED, CLICK, FILL, TIERS

# A recompute: a generator of trait updates (dicts name -> value; None is a checkpoint with
# no update; GIVE_WAY a checkpoint after which the rest is asked-for work). Each yield is a
# chunk boundary where stale work stops.
Steps = Iterator["dict | None"]


class _GiveWay:
    def __repr__(self) -> str:
        return "GIVE_WAY"


GIVE_WAY = _GiveWay()
"""Yielded by a click's steps where the rest of it can wait: from there the job is asked-for work
(``scheduler``), so the quick first part of a click (a partial table) is shown and the slow rest
lets the other views of the click, and every later click, go first, while it keeps its share
beside other asked-for work. Ignored when run synchronously."""
PRIORITY = {CLICK: 0, ASKED: 1, FILL: 2}
"""Each tier's priority on the compute pool (``compute_pool.priority``: lower goes first)."""


def give_way_between(steps):
    """``steps`` (a request's updates, one per piece of a long computation) with ``GIVE_WAY`` after
    the first: the rest of a click is asked-for work. Returns what ``steps`` returns
    (``result = yield from give_way_between(...)``)."""
    while True:
        try:
            item = next(steps)
        except StopIteration as stop:
            return stop.value
        yield item
        yield GIVE_WAY


_DONE = object()  # the end of a job's steps
TICK = 0.25
"""Seconds between the calls of ``wait``'s ``tick`` (a progress bar's redraw)."""


def _kernel_loop():
    """The running kernel's IO loop (tornado), or None outside a kernel."""
    if "ipykernel" not in sys.modules:
        return None
    from ipykernel.kernelbase import Kernel

    if not Kernel.initialized():
        return None
    return getattr(Kernel.instance(), "io_loop", None)


def _tier(name: str) -> int:
    if name not in TIERS:
        raise ValueError(f"a job's tier is one of {', '.join(map(repr, TIERS))}, got {name!r}")
    return TIERS[name]


class _Job:
    """One request: the scheduler's unit (``scheduler`` module docstring)."""

    __slots__ = ("generation", "kind", "make", "owner", "steps", "tier")

    def __init__(self, owner: Runner, kind: str, make: Callable[[], Steps], generation: int, tier: int):
        self.owner, self.kind, self.make, self.generation, self.tier = owner, kind, make, generation, tier
        self.steps = None  # the generator of updates, once its first piece began

    def stale(self) -> bool:
        return not self.owner.current(self)

    def step(self) -> bool:
        return self.owner._step(self)


APPLY = threading.RLock()
"""Held while a view's traits change: a runner applying results (on the kernel's IO loop, the main
thread), a browser message (``CircuitWidget._handle_msg``: JupyterLab 4 sends widget messages to a
kernel subshell, which ipykernel 7 serves on a thread of its own), and a cell's change: a trait
set with its observers (``CircuitWidget.__setattr__``) or a whole ``hold_sync`` or
``hold_trait_notifications`` block. Traitlets and ipywidgets' ``hold_sync`` are not thread-safe: a
result applied on one thread while a message is applied on the other could be lost on its way to
the page (a table left at the last head)."""

_shutting_down = threading.Event()


def _shut_down() -> None:
    _shutting_down.set()  # every job is stale: the scheduler drops them, pieces computing end
    existing = scheduler.existing()
    if existing is not None:
        existing.poke()


if hasattr(threading, "_register_atexit"):  # before the scheduler's workers are joined at exit
    threading._register_atexit(_shut_down)


class Runner:
    """One widget's recomputes: per kind of result, the newest job wanted.

    ``submit(kind, make)``: ``make()`` returns a :data:`Steps` generator. A newer submit of
    the same kind makes the older stale (stopped between chunks, its results dropped);
    other kinds are untouched. ``widget.busy`` is True while any job but the fill is wanted,
    computing or has results not yet applied. A failing job shows ``"<kind>: <error>"`` in
    ``widget.error`` and leaves the last good traits; the next success of that kind clears it.
    ``progress``: the view's ``progress`` at once (a count from the first second, before the job's
    first piece, which may wait behind other work).

    ``submit(kind, make, tier="fill")``: work nobody waits to see (the kernel-less answers,
    ``widgets/core/offline.py``): it never sets ``busy``; ``wait()`` still covers it. Under no
    kernel it is not run at all (``submit`` returns False): a script saves nothing until
    ``save_html``. ``giving_way`` is True while a job of the runner waits for other views' work.
    ``cancel(kind)`` stops a kind's jobs.

    ``close()`` (the view's ``close``) stops every kind for good and refuses later submits;
    ``join()`` waits until no piece of it computes. ``cancel_all()`` stops every kind (between
    pieces) and keeps the runner.

    ``loop``: where results are applied. Default: the running kernel's IO loop (the scheduler's
    workers compute, ``loop.add_callback`` applies); None: run synchronously in ``submit``.
    ``tier``: its requests' tier, "click" (default) or "asked" (``scheduler``).
    """

    def __init__(self, widget, loop="kernel", *, tier: str = "click"):
        self._widget = widget
        self.tier = _tier(tier)
        self._loop = _kernel_loop() if loop == "kernel" else loop
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation: dict[str, int] = collections.defaultdict(int)
        self._jobs: dict[str, _Job] = {}  # kind -> the job wanted (queued, or between pieces)
        self._handed = 0  # jobs with the scheduler (stale ones until it drops them)
        self._running: _Job | None = None  # the job whose piece computes now
        self._results: collections.deque = collections.deque()  # (job, update | exception)
        self._closed = False
        self._failed: dict[str, str] = {}  # kind -> message shown in error
        self._applying = False

    @property
    def giving_way(self) -> bool:
        """True while a job of this runner waits for other views' work (hold
        ``scheduler.shared().changed`` to watch it)."""
        return self._loop is not None and scheduler.shared().waiting(self)

    # -- requests (kernel thread) ------------------------------------------------------------
    def submit(self, kind: str, make: Callable[[], Steps], *, tier: str | None = None,
               progress: dict | None = None) -> bool:
        level = self.tier if tier is None else _tier(tier)
        if (level == FILL and self._loop is None) or self._closed:
            return False
        with self._lock:
            self._generation[kind] += 1
            job = self._jobs[kind] = _Job(self, kind, make, self._generation[kind], level)
            if self._loop is not None:
                self._handed += 1
        if progress is not None:
            self._widget.progress = progress
        if self._loop is None:
            if not self._applying:
                self._run_sync()
            return True
        if level != FILL:
            self._set_busy(True)
        scheduler.shared().add(job)
        return True

    def cancel(self, kind: str) -> None:
        """Stop ``kind``'s job: a queued one is dropped, a computing one stops at its next chunk
        (its later results are dropped)."""
        with self._lock:
            self._generation[kind] += 1
            self._jobs.pop(kind, None)
        if self._loop is not None:
            scheduler.shared().poke()

    def cancel_all(self) -> list[str]:
        """Stop every kind's jobs (``cancel``), the fill's included; the kinds that had a job
        wanted. ``busy`` goes off once the one computing has stopped at its next piece."""
        with self._lock:
            kinds = list(self._jobs)
        for kind in kinds:
            self.cancel(kind)
        if self._loop is not None:
            self._post()  # nothing left wanted: busy goes off at the next drain
        return kinds

    def close(self) -> None:
        """Stop for good (the view is closed): queued jobs are dropped, the one computing stops at
        its next chunk, results not yet applied are dropped and later submits are refused. Returns
        at once (``join`` waits for that chunk)."""
        with self._lock:
            self._closed = True
            for kind in list(self._generation):
                self._generation[kind] += 1
            self._jobs.clear()
            self._results.clear()
            self._changed.notify_all()
        if self._loop is not None:
            scheduler.shared().poke()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the scheduler holds no job of this runner (True), or ``timeout`` s (False):
        after ``close``, until its last piece has ended."""
        with self._lock:
            return self._changed.wait_for(lambda: self._handed == 0, timeout)

    def running_kind(self) -> str:
        """The kind of the job computing now, else of one wanted ("" for none): what a progress
        bar names."""
        with self._lock:  # (a worker may add or end a job meanwhile)
            job = self._running or next(iter(self._jobs.values()), None)
        return "" if job is None else job.kind

    def current(self, job: _Job) -> bool:
        return job.generation == self._generation[job.kind] and not self._closed and not _shutting_down.is_set()

    def wait(self, timeout: float | None = None, tick: Callable[[], None] | None = None, *,
             fill: bool = True) -> bool:
        """Block until every request is done and applied (True), or ``timeout`` s (False).
        Call it from the kernel thread (a cell, a test): it applies the results itself.
        ``tick`` (a progress bar's) is called at least every ``TICK`` s meanwhile.
        ``fill=False``: every request but the fill (which may go on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._drain():
            if not fill:
                with self._lock:
                    if self._shown():
                        return True
            if tick is not None:
                tick()
            with self._lock:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not self._results and (self._jobs or self._running is not None):
                    self._changed.wait(left if tick is None else min(TICK, TICK if left is None else left))
        return True

    # -- synchronous mode ----------------------------------------------------------------------
    def _run_sync(self) -> None:
        self._applying = True
        try:
            while self._jobs:
                job = next(iter(self._jobs.values()))
                for item in self._steps(job):
                    if item is not None and item is not GIVE_WAY:
                        self._apply(job, item)
                    if isinstance(item, BaseException) and not isinstance(item, Exception):
                        raise item  # Ctrl-C in a script still stops it, the view showing why
                self._ended(job)
        finally:
            self._applying = False

    # -- a scheduler worker: computes one piece, never touches traits ----------------------------
    def _step(self, job: _Job) -> bool:
        """One piece of ``job`` (the scheduler's ``step``); True while more remain."""
        if not self.current(job):  # stale before this piece: never computed
            if job.steps is not None:
                job.steps.close()
            self._ended(job, handed=True)
            return False
        if job.steps is None:
            job.steps = self._steps(job)
        with self._lock:
            self._running = job
        try:
            with bars.quiet(), compute_pool.priority(PRIORITY[job.tier]):
                item = next(job.steps, _DONE)  # (a view shows it is busy: a bar from here would go to the latest cell)
        finally:
            with self._lock:
                self._running = None
                self._changed.notify_all()
        if item is _DONE:
            self._ended(job, handed=True)
            return False
        if item is GIVE_WAY:
            job.tier = max(job.tier, ASKED)
        elif item is not None:
            with self._lock:
                self._results.append((job, item))
                self._changed.notify_all()
            self._post()
        return True

    def _ended(self, job: _Job, handed: bool = False) -> None:
        """``job`` is done, or dropped: no longer wanted, busy goes off at the next drain."""
        with self._lock:
            if self._jobs.get(job.kind) is job:
                del self._jobs[job.kind]
            if handed:
                self._handed -= 1
            self._changed.notify_all()
        if handed:
            self._post()

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
        except GeneratorExit:  # closed (stale, or dropped): nothing to report
            raise
        except BaseException as exc:  # noqa: BLE001 - shown in the view by _apply
            if self.current(job):
                yield exc
        finally:
            if steps is not None and hasattr(steps, "close"):
                steps.close()

    # -- applying (kernel thread) ----------------------------------------------------------------
    def _drain(self) -> bool:
        """Apply the queued results in order; True when all work is done (``busy`` goes off
        once all but the fill is done)."""
        with APPLY:
            while True:
                with self._lock:
                    entry = self._results.popleft() if self._results else None
                    idle = entry is None and not self._jobs and self._running is None
                    shown = entry is None and self._shown()
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
            with widget.hold_sync():  # the result, and busy off where it is the last: one message
                for name, value in item.items():
                    setattr(widget, name, value)
                with self._lock:
                    last = self._shown()
                if last:
                    self._set_busy(False)
        except Exception as exc:  # noqa: BLE001 - an observer of the update failed: say so, keep going
            self._failed[job.kind] = widget.error = f"{job.kind}: {type(exc).__name__}: {exc}"
            return
        shown = self._failed.pop(job.kind, None)
        if shown is not None and widget.error == shown:
            widget.error = ""

    def _shown(self) -> bool:
        """Whether every result asked for is applied: only the fill may be left (hold ``_lock``)."""
        return not self._results and all(j.tier == FILL for j in self._jobs.values()) and (
            self._running is None or self._running.tier == FILL)

    def _set_busy(self, value: bool) -> None:
        if self._widget.busy != value:
            self._widget.busy = value
