"""Widgets as they run under a Jupyter kernel, for tests: every ``Runner`` gets a stand-in for
the kernel's IO loop that never runs callbacks by itself, so a worker's results are applied
only when the test (the "kernel thread") calls ``wait()``. Deterministic: no sleeps."""

from __future__ import annotations

import threading

import pytest

from pycircuits_widgets.widgets.core import runner


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


@pytest.fixture
def manual_kernel_loop(monkeypatch):
    loop = ManualLoop()
    monkeypatch.setattr(runner, "_kernel_loop", lambda: loop)
    return loop
