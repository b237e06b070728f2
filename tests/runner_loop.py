"""Widgets as they run under a Jupyter kernel, for tests: every ``Runner`` gets a stand-in for
the kernel's IO loop that never runs callbacks by itself, so a worker's results are applied
only when the test (the "kernel thread") calls ``wait()``. Deterministic: no sleeps."""

from __future__ import annotations

import threading

import pytest

from pycircuits_widgets.widgets.core import runner, scheduler

WAIT = 60  # seconds: a bound on a hang, never a timing assertion


class ManualLoop:
    """Records ``add_callback`` calls (from worker threads) without running them."""

    def __init__(self):
        self.posted = 0
        self._lock = threading.Lock()
        self._posted = threading.Condition(self._lock)

    def add_callback(self, callback, *args):
        with self._lock:
            self.posted += 1
            self._posted.notify_all()

    def wait_posted(self, n: int, timeout: float = 30) -> bool:
        """Block until ``n`` callbacks were posted in all (a worker posts one per result and one
        when its job ends), or ``timeout`` s (False)."""
        with self._lock:
            return self._posted.wait_for(lambda: self.posted >= n, timeout)


class BareView:
    """What a ``Runner`` drives, and nothing else: ``busy`` and ``error`` traits and ``hold_sync``."""

    busy, error = False, ""

    def hold_sync(self):
        return threading.Lock()


class Clock:
    """The scheduler's clock in a test: time passes only where a test's piece says (``now += s``), so
    the asked-for tier's shares are exact."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def piece_clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(scheduler.shared(), "clock", clock)
    return clock


@pytest.fixture
def manual_kernel_loop(monkeypatch):
    loop = ManualLoop()
    monkeypatch.setattr(runner, "_kernel_loop", lambda: loop)
    return loop


def giving_way(r: runner.Runner) -> bool:
    """Block until a job of ``r`` waits for other views' work (True), or ``WAIT`` s: the scheduler's
    own signal (``changed``, notified at every change of what is queued or computing)."""
    changed = scheduler.shared().changed
    with changed:
        return changed.wait_for(lambda: r.giving_way, WAIT)


class Blocker:
    """A request held on a runner until released: while it runs, that runner has work."""

    def __init__(self, r: runner.Runner):
        self.started, self.release = threading.Event(), threading.Event()
        r.submit("blocker", self._steps)
        assert self.started.wait(WAIT)

    def _steps(self):
        self.started.set()
        assert self.release.wait(WAIT)
        yield None
