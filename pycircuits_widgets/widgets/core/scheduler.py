"""The one scheduler of every view's work in a process: one queue of pieces, a fixed set of workers.

Every view's runner (``runner.Runner``) hands its jobs here. A job is a generator of pieces; the
scheduler runs one piece of one job at a time on a worker of a ``ThreadPoolExecutor`` and puts the
job back in the queue until it ends. Workers are threads of the standard library's executor: an idle
one blocks on the executor's own queue, and the queue here is looked at only when something happens
(a job arrives or is cancelled, a piece ends), never polled. So an idle kernel uses no CPU, however
many views wait (issue 51: four parked runner threads re-waking one another took 0.7 of 2 cores).

**Tiers** (``CLICK``, ``ASKED``, ``FILL``; a job's tier is its runner's unless it says otherwise):

- A *click* (``CLICK``: what a selection recomputes) starts on any free worker, whatever else runs.
  One worker is always free for one: non-click pieces run one at a time (each runs torch at its full
  intra-op count, so two would only share the same cores), and there are at least two workers.
- *Work the user asked for* (``ASKED``: an on-demand section, the measured composition, a click's
  slow rest after ``GIVE_WAY`` such as the exact skip-trigram table) runs while no click is queued
  or computing. The asked-for jobs *share* what clicks leave: the next piece goes to the view that
  has had the least of the tier's time since it began waiting (start-time fair queueing: a view
  arriving starts at the tier's current virtual time, so it neither waits for nor overtakes the ones
  there), first come first served between equals. So a section keeps its share while a stream of
  clicks restarts the exact table of the head clicked, and a click's rest keeps its share of a long
  section's time: each completes within about (views sharing) x its time alone.
- The *fill* (``FILL``: the explorer's precompute, the head-loss table, kernel-less answers) runs
  only while nothing else is queued or computing, first come first served.

A piece already started is never interrupted: a click shares the CPU with at most one non-click
piece. Pieces of one view never run at once (its jobs share the view's state), so a view's jobs of
one tier run in the order they came. A job whose result is no longer wanted (``stale()``: a newer
one of its kind, a cancel, a closed view) is dropped at once, before any piece of it computes.

A job is any object with ``owner`` (its view's runner), ``tier``, ``stale()`` and ``step()`` (compute
one piece; True while more remain). ``runner.Runner`` makes them.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor  # (imported now: its exit hook then runs after ``runner``'s)

from ... import compute_pool

CLICK, ASKED, FILL = 0, 1, 2
"""The tiers, first served first."""
TIERS = {"click": CLICK, "asked": ASKED, "fill": FILL}
THREAD_PREFIX = "pcw-scheduler"
"""Name prefix of the scheduler's worker threads."""


def worker_count() -> int:
    """Workers of the process's scheduler: one per core this process may run on, at least two (a
    click always finds one free while one non-click piece computes)."""
    return max(2, compute_pool.cores())


class Scheduler:
    """``workers`` threads running the pieces of every job added (module docstring). ``changed``:
    a condition notified after every change of what is queued or computing (a test or a benchmark
    waits on it); hold it to read ``waiting`` and ``started``. ``clock``: the time pieces are charged in
    for the asked-for tier's shares (``time.monotonic``; a test gives its own)."""

    def __init__(self, workers: int, clock=time.monotonic):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
            raise ValueError(f"a scheduler needs at least 2 workers (one stays free for clicks), got {workers!r}")
        self.workers = workers
        self.clock = clock
        self.changed = threading.Condition()
        self.started = [0] * len(TIERS)
        """Pieces started so far, per tier (dropped stale jobs not counted)."""
        self.served = [0.0] * len(TIERS)
        """Seconds (``clock``) of pieces computed so far, per tier: a test or a benchmark waits on
        ``changed`` for a tier to have had so much more."""
        self._ready: list = []  # jobs waiting for a piece
        self._running: set = set()  # jobs whose piece computes now
        self._arrival: dict = {}  # job -> its place in its tier's first-come order
        self._service = weakref.WeakKeyDictionary()  # owner -> seconds of its ASKED pieces, on the tier's virtual clock
        self._virtual = 0.0  # the service of the asked-for view served last (SFQ's start tag)
        self._order = itertools.count()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=THREAD_PREFIX)

    def add(self, job) -> None:
        """Queue ``job`` for its first piece (or again, at its tier's end, after its tier changed)."""
        with self.changed:
            self._arrival[job] = next(self._order)
            self._queue(job)
            self._dispatch()

    def poke(self) -> None:
        """Look at the queue again: a job went stale (dropped now), or a view closed."""
        with self.changed:
            self._dispatch()

    def waiting(self, owner) -> bool:
        """Whether ``owner`` has a job queued that waits for other views' work, not for a worker nor
        for its own piece computing (hold ``changed``)."""
        return (len(self._running) < self.workers and not any(j.owner is owner for j in self._running)
                and any(j.owner is owner for j in self._ready))

    # -- hold ``changed`` ------------------------------------------------------------------------
    def _queue(self, job) -> None:
        if job.tier == ASKED and not self._asked_by(job.owner):
            # a view arriving starts where it left off, or at the tier's virtual time if that is later:
            # it neither overtakes the views there nor keeps credit for the time it was away
            self._service[job.owner] = max(self._service.get(job.owner, 0.0), self._virtual)
        self._ready.append(job)

    def _asked_by(self, owner) -> bool:
        return any(j.owner is owner and j.tier == ASKED for j in itertools.chain(self._ready, self._running))

    def _next(self):
        """The job whose piece starts next on a free worker, or None (module docstring)."""
        busy = {j.owner for j in self._running}
        stale = next((j for j in self._ready if j.owner not in busy and j.stale()), None)
        if stale is not None:
            return stale  # dropped at once: its step closes it
        present = [j.tier for j in itertools.chain(self._ready, self._running)]
        if not present:
            return None
        free = [j for j in self._ready if j.owner not in busy]
        clicks = [j for j in free if j.tier == CLICK]
        if clicks:
            return min(clicks, key=self._arrival.__getitem__)
        if any(j.tier != CLICK for j in self._running):
            return None  # one non-click piece at a time
        tier = min(present)
        free = [j for j in free if j.tier == tier]
        if tier == CLICK or not free:
            return None
        if tier == ASKED:
            return min(free, key=lambda j: (self._service[j.owner], self._arrival[j]))
        return min(free, key=self._arrival.__getitem__)

    def _dispatch(self) -> None:
        while len(self._running) < self.workers and (job := self._next()) is not None:
            try:
                self._executor.submit(self._run, job)
            except RuntimeError:  # the interpreter is exiting: its executors take no more work
                break
            self._ready.remove(job)
            self._running.add(job)
            if not job.stale():  # (one dropped computes nothing)
                self.started[job.tier] += 1
            if job.tier == ASKED:
                self._virtual = self._service[job.owner]
        self.changed.notify_all()

    # -- a worker ------------------------------------------------------------------------------
    def _run(self, job) -> None:
        tier, began = job.tier, self.clock()
        more = False
        try:
            more = job.step()
        finally:
            with self.changed:
                self._running.discard(job)
                took = self.clock() - began
                self.served[tier] += took
                if tier == ASKED:
                    self._service[job.owner] += took
                if more:
                    if job.tier != tier:  # a click's rest (GIVE_WAY): it joins the asked-for tier's end
                        self._arrival[job] = next(self._order)
                    self._queue(job)
                else:
                    self._arrival.pop(job, None)
                self._dispatch()


_shared: list = []  # [pid, Scheduler], set on first use
_shared_lock = threading.Lock()


def shared() -> Scheduler:
    """The process's scheduler (``worker_count()`` workers), started on first use; a forked child
    (a Ray worker) gets its own."""
    with _shared_lock:
        if not _shared or _shared[0] != os.getpid():
            _shared[:] = [os.getpid(), Scheduler(worker_count())]
        return _shared[1]


def existing() -> Scheduler | None:
    """This process's scheduler if one exists (``shared`` made it), else None."""
    with _shared_lock:
        return _shared[1] if _shared and _shared[0] == os.getpid() else None


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # (another thread may have held it at the fork)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
