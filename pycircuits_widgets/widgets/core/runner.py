"""The one runner that recomputes a view's results off the kernel thread.

:class:`Runner` runs a widget's recomputes. Each request has a *kind* (a head's table, a
token query, a detail panel): per kind at most one job runs and one waits, and a newer
request of a kind makes the older one stale, stopped at its next chunk (``yield``); kinds
never drop each other. Under a Jupyter kernel the work runs on one worker thread per widget
and every result is applied on the kernel's IO-loop thread (never ``setattr`` from the
worker), holding :data:`APPLY`; in a plain script (no kernel) requests run synchronously, so
nothing is left running at exit. Every view has one (``CircuitWidget._runner``).

Three tiers of work, across all runners (:data:`GATE`):

1. *Clicks*: a runner's requests (``Runner(requested=False)``, the default). They never wait,
   except where a click's steps say the rest can (``GIVE_WAY``: it waits for other clicks).
2. *Work the user asked for*: every request of a ``Runner(requested=True)`` (an on-demand section
   the reader started: the induction mechanism, path expansion, ...). Before each chunk (a piece:
   a layer pair, a table) it waits while another runner has click work (a ``GIVE_WAY`` rest
   included), and takes a turn: one such piece computes at a time across all runners, in turn
   (first come, first served), so two asked-for jobs alternate pieces rather than each running
   torch's thread pool on the same cores.
3. *Background* jobs (kernel-less answers, the explorer's precompute): at each chunk boundary one
   waits while any runner has a click or asked-for request pending or running.

So a click waits for nothing, and shares the CPU with other work for at most one piece already
started; a long job never blocks another head's views or a page save (``save_html`` waits for
neither asked-for work nor the fill past its budget). ``cancel`` stops a job between pieces.

**Compute threads.** Every low-precision screen (the exact skip-trigram table's, and
``FactoredMatrix.topk``'s) runs its tiles on the process's one compute pool (``compute_pool``: a
single-thread worker per core), shared by all three tiers and served by tier
(:data:`PRIORITY`): a click's tiles first, then asked-for work's, then the fill's, decided at
each tile, so a fill's table already started gives way to a click's within a tile (a few ms). The
rest of a job's torch work (a forward, the exact table's exact GEMMs, eigenvalues) runs on its
runner's thread at torch's intra-op count (``torch.get_num_threads()``, one per core by default),
in every tier: the fill's results are then the very numbers a click computes (a GEMM's float32
rounding can depend on its thread count). So the screens alone never use more threads than cores;
at most, at once: the pool's workers, the views of one click each at torch's count (they compute
together, each on its own runner's thread, while their screens wait for the pool), one asked-for
piece already started and one background chunk already started, each at torch's count.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable, Iterator

from ... import compute_pool
from ... import progress as bars


# A recompute: a generator of trait updates (dicts name -> value; None is a checkpoint with
# no update; GIVE_WAY a checkpoint where the rest waits for other runners). Each yield is a
# chunk boundary where stale work stops.
Steps = Iterator["dict | None"]


class _GiveWay:
    def __repr__(self) -> str:
        return "GIVE_WAY"


GIVE_WAY = _GiveWay()
"""Yielded by a request's steps where the rest of it can wait: under a kernel the job waits there
while another runner has a click that is not itself giving way (the first, quick part of a
click, say a partial table, is shown; the slow rest lets the other views of the click finish
first instead of sharing the CPU with them); asked-for work and the fill never hold it up.
Ignored when run synchronously."""
PRIORITY = {"click": 0, "asked": 1, "background": 2}
"""Each tier's priority on the compute pool (``compute_pool.priority``: lower goes first)."""


def give_way_between(steps):
    """``steps`` (a request's updates, one per piece of a long computation) with ``GIVE_WAY`` after
    each: the rest of a click waits, piece by piece, for other runners' clicks. Returns what
    ``steps`` returns (``result = yield from give_way_between(...)``)."""
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


class _Job:
    __slots__ = ("background", "generation", "kind", "make", "steps")
    # (a job's tier besides background is its runner's: ``Runner.requested``)

    def __init__(self, kind: str, make: Callable[[], Steps], generation: int, background: bool = False):
        self.kind, self.make, self.generation, self.background = kind, make, generation, background
        self.steps = None  # the running generator of updates, kept while a background job is parked


APPLY = threading.RLock()
"""Held while a view's traits change: a runner applying results (on the kernel's IO loop, the main
thread), a browser message (``CircuitWidget._handle_msg``: JupyterLab 4 sends widget messages to a
kernel subshell, which ipykernel 7 serves on a thread of its own), and a cell's change: a trait
set with its observers (``CircuitWidget.__setattr__``) or a whole ``hold_sync`` or
``hold_trait_notifications`` block. Traitlets and ipywidgets' ``hold_sync`` are not thread-safe: a
result applied on one thread while a message is applied on the other could be lost on its way to
the page (a table left at the last head)."""

_shutting_down = threading.Event()
GATE = threading.Condition()
"""Guards :data:`_foreground`, :data:`_clicking` and the asked-for work's turns; notified whenever
a runner's requests start or end, a job starts or stops giving way or ends its turn, or a kind is
cancelled."""
_foreground: set = set()  # runners with a request (not background) pending or running
_clicking: set = set()  # of those, the runners whose requests are clicks (not ``requested``)
_turns: collections.deque = collections.deque()  # asked-for runners waiting for their turn, in order
_turn: list = [None]  # the runner whose asked-for piece computes now (None: none)


def _shut_down() -> None:
    _shutting_down.set()
    with GATE:
        GATE.notify_all()  # background jobs giving way stop waiting


if hasattr(threading, "_register_atexit"):  # before non-daemon threads are joined at exit
    threading._register_atexit(_shut_down)


class Runner:
    """One widget's recomputes: per kind of result, one job running and one pending.

    ``submit(kind, make)``: ``make()`` returns a :data:`Steps` generator. A newer submit of
    the same kind makes the older stale (stopped between chunks, its results dropped);
    other kinds are untouched. ``widget.busy`` is True while any job is pending, running or
    has results not yet applied. A failing job shows ``"<kind>: <error>"`` in
    ``widget.error`` and leaves the last good traits; the next success of that kind clears it.

    ``submit(kind, make, background=True)``: work nobody waits to see (the kernel-less answers,
    ``widgets/core/offline.py``): it never sets ``busy`` and yields to any other request at its
    next chunk, resuming once that is done; ``wait()`` still covers it. Under no kernel it is
    not run at all (``submit`` returns False): a script saves nothing until ``save_html``.
    At each chunk it also waits while another runner has requests (module docstring);
    ``giving_way`` is True meanwhile. ``cancel(kind)`` stops a kind's jobs.

    ``close()`` (the view's ``close``) stops every kind for good and refuses later submits; the
    worker thread then ends, and ``join()`` waits for that. ``cancel_all()`` stops every kind
    (between pieces) and keeps the runner.

    ``loop``: where results are applied. Default: the running kernel's IO loop (a worker
    thread computes, ``loop.add_callback`` applies); None: run synchronously in ``submit``.
    ``requested``: its requests are work the user asked for, not clicks (module docstring).
    """

    def __init__(self, widget, loop="kernel", *, requested: bool = False):
        self._widget = widget
        self.requested = requested
        self._loop = _kernel_loop() if loop == "kernel" else loop
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._generation: dict[str, int] = collections.defaultdict(int)
        self._pending: dict[str, _Job] = {}  # kind -> newest job not started
        self._running: _Job | None = None
        self._results: collections.deque = collections.deque()  # (job, update | exception)
        self._worker: threading.Thread | None = None  # the thread serving requests, None once it ends
        self._thread: threading.Thread | None = None  # the last worker started (``join`` waits on it)
        self._closed = False
        self._failed: dict[str, str] = {}  # kind -> message shown in error
        self._applying = False
        self.giving_way = False
        """True while a background job, or a request at ``GIVE_WAY``, waits for other runners'
        requests (set under GATE)."""

    # -- requests (kernel thread) ------------------------------------------------------------
    def submit(self, kind: str, make: Callable[[], Steps], *, background: bool = False) -> bool:
        if (background and self._loop is None) or self._closed:
            return False
        with self._lock:
            self._generation[kind] += 1
            self._pending[kind] = _Job(kind, make, self._generation[kind], background)
            if self._loop is not None:
                if self._worker is None:
                    self._worker = self._thread = threading.Thread(target=self._work, name="pcw-runner")
                    self._worker.start()
                self._changed.notify_all()
        if self._loop is not None:
            if not background:
                self._mark()
                self._set_busy(True)
        elif not self._applying:
            self._run_sync()
        return True

    def cancel(self, kind: str) -> None:
        """Stop ``kind``'s jobs: the pending one is dropped, the running one stops at its next
        chunk (its later results are dropped)."""
        with self._lock:
            self._generation[kind] += 1
            job = self._pending.pop(kind, None)
        if job is not None and job.steps is not None:
            job.steps.close()  # a parked background job: never resumed
        with GATE:
            GATE.notify_all()  # one giving way sees it is stale

    def cancel_all(self) -> list[str]:
        """Stop every kind's jobs (``cancel``), background ones included; the kinds that had a job
        pending or running. ``busy`` goes off once the running one has stopped at its next piece."""
        with self._lock:
            kinds = list(self._pending) + ([] if self._running is None else [self._running.kind])
        for kind in dict.fromkeys(kinds):
            self.cancel(kind)
        self._mark()
        if self._loop is not None:
            self._post()  # nothing left running: busy goes off at the next drain
        return kinds

    def close(self) -> None:
        """Stop for good (the view is closed): pending jobs are dropped, the running one stops at
        its next chunk, results not yet applied are dropped and later submits are refused. Returns
        at once; the worker thread ends after that chunk (``join``)."""
        with self._lock:
            self._closed = True
            for kind in list(self._generation):
                self._generation[kind] += 1
            dropped = list(self._pending.values())
            self._pending.clear()
            self._results.clear()
            self._changed.notify_all()
        for job in dropped:
            if job.steps is not None:
                job.steps.close()  # a parked background job: never resumed
        self._mark()  # no longer a runner others give way to; one giving way sees it is stale

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the worker thread has ended (True), or ``timeout`` s (False). True at once
        for a runner that never started one (no kernel, or no request yet)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def running_kind(self) -> str:
        """The kind of the job computing now ("" for none): what a progress bar names."""
        job = self._running
        return "" if job is None else job.kind

    def current(self, job: _Job) -> bool:
        return job.generation == self._generation[job.kind] and not self._closed and not _shutting_down.is_set()

    def wait(self, timeout: float | None = None, tick: Callable[[], None] | None = None, *,
             background: bool = True) -> bool:
        """Block until every request is done and applied (True), or ``timeout`` s (False).
        Call it from the kernel thread (a cell, a test): it applies the results itself.
        ``tick`` (a progress bar's) is called at least every ``TICK`` s meanwhile.
        ``background=False``: every request but background work (which may go on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._drain():
            if not background:
                with self._lock:
                    if self._shown():
                        return True
            if tick is not None:
                tick()
            with self._lock:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not self._results and (self._pending or self._running is not None):
                    self._changed.wait(left if tick is None else min(TICK, TICK if left is None else left))
        return True

    # -- synchronous mode ----------------------------------------------------------------------
    def _run_sync(self) -> None:
        self._applying = True
        try:
            while self._pending:
                kind = next(iter(self._pending))
                job = self._pending.pop(kind)
                for item in self._steps(job):
                    if item is not None and item is not GIVE_WAY:
                        self._apply(job, item)
                    if isinstance(item, BaseException) and not isinstance(item, Exception):
                        raise item  # Ctrl-C in a script still stops it, the view showing why
        finally:
            self._applying = False

    # -- worker thread: computes, never touches traits -------------------------------------------
    def _work(self) -> None:
        with bars.quiet():  # the view shows it is busy; a bar from here would go to the latest cell
            self._work_quietly()

    def _work_quietly(self) -> None:
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
                while True:
                    asked = self.requested and not job.background
                    if not (self._take_turn(job) if asked else self.current(job)):
                        job.steps.close()  # cancelled or stale before its next piece: never computed
                        break
                    try:
                        with self._compute(job):
                            item = next(job.steps, _DONE)
                    finally:
                        if asked:
                            self._end_turn()
                    if item is _DONE:
                        break
                    if item is GIVE_WAY:
                        self._give_way(job)
                        continue
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
                if not job.background:
                    self._mark()
                self._post()

    def _compute(self, job: _Job):
        """This job's tier's priority on the compute pool (module docstring, "Compute threads")."""
        tier = "background" if job.background else "asked" if self.requested else "click"
        return compute_pool.priority(PRIORITY[tier])

    def _requested(self) -> bool:
        """Whether a request (not background work) is pending or running (hold ``_lock``)."""
        return any(not j.background for j in self._pending.values()) or (
            self._running is not None and not self._running.background)

    def _mark(self) -> None:
        """Record in ``_foreground`` (and ``_clicking``) whether this runner has requests, waking
        who gives way."""
        with GATE:
            with self._lock:
                requested = self._requested()
            for tier, member in ((_foreground, requested), (_clicking, requested and not self.requested)):
                if member:
                    tier.add(self)
                else:
                    tier.discard(self)
            GATE.notify_all()

    def _give_way(self, job: _Job) -> None:
        """A click's ``GIVE_WAY``: wait while another runner has a click not giving way itself
        (two such requests never wait for each other; asked-for work never holds it up), the job
        current and no shutdown."""
        with GATE:
            self.giving_way = True
            GATE.notify_all()
            while (self.current(job) and not _shutting_down.is_set()
                   and any(r is not self and not r.giving_way for r in _clicking)):
                GATE.wait()
            self.giving_way = False
            GATE.notify_all()

    def _take_turn(self, job: _Job) -> bool:
        """Before an asked-for piece: wait (``giving_way``) while another runner has click work or
        another asked-for piece computes or was waiting first; then hold the turn. False (no turn)
        once the job is stale (cancelled, or a newer one of its kind) or at shutdown."""
        with GATE:
            _turns.append(self)
            self.giving_way = True
            GATE.notify_all()
            try:
                while self.current(job):
                    if not (_clicking - {self}) and _turn[0] is None and _turns[0] is self:
                        _turn[0] = self
                        return True
                    GATE.wait()
                return False
            finally:
                _turns.remove(self)
                self.giving_way = False
                GATE.notify_all()

    def _end_turn(self) -> None:
        """The piece is computed: the next waiting asked-for runner may take its turn."""
        with GATE:
            if _turn[0] is self:
                _turn[0] = None
            GATE.notify_all()

    def _park(self, job: _Job) -> bool:
        """A background job yields to waiting requests of its runner: back in the queue,
        resumed later (dropped if a newer request of its kind is waiting). While only other
        runners have requests it waits here, in place, until they are done; a stale one (a newer
        one of its kind, or cancelled) ends here, before computing another chunk."""
        with GATE:
            while True:
                with self._lock:
                    own = any(not j.background for j in self._pending.values())
                if own or not (_foreground - {self}) or not self.current(job):
                    break
                self.giving_way = True
                GATE.notify_all()
                GATE.wait()
            if self.giving_way:
                self.giving_way = False
                GATE.notify_all()
        if not self.current(job):  # cancelled (or a newer one submitted): no further chunk
            job.steps.close()
            return True
        if not own:
            return False
        with self._lock:
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
        except BaseException as exc:  # noqa: BLE001 - shown in the view by _apply
            if self.current(job):
                yield exc
        finally:
            if steps is not None and hasattr(steps, "close"):
                steps.close()

    # -- applying (kernel thread) ----------------------------------------------------------------
    def _drain(self) -> bool:
        """Apply the queued results in order; True when all work is done (``busy`` goes off
        once all but background work is done)."""
        with APPLY:
            while True:
                with self._lock:
                    entry = self._results.popleft() if self._results else None
                    idle = entry is None and not self._pending and self._running is None
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
        """Whether every result asked for is applied: only background work may be left (hold
        ``_lock``)."""
        return not self._results and all(j.background for j in self._pending.values()) and (
            self._running is None or self._running.background)

    def _set_busy(self, value: bool) -> None:
        if self._widget.busy != value:
            self._widget.busy = value
