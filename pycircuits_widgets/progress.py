"""Progress of a wait the user sits through: one bar for every slow call.

``with progress("from_hf", total=4, unit="step") as bar: ... bar.update()`` shows nothing for
a wait under :data:`DELAY` seconds; past it, a bar appears where the user looks: in the
Jupyter cell that runs the call (an HTML bar updated in place through a display handle), or a
``tqdm`` console bar (stderr) in a script. It is removed when the wait ends and leaves nothing
behind: the cell's output is blanked, and since the cell bar is no widget, a saved notebook
(JupyterLab's save, or nbclient/nbconvert's ``store_widget_state``, which keeps even closed
widgets) holds no widget output or widget state of it.

``PCW_PROGRESS=0`` (or tqdm's own ``TQDM_DISABLE=1``) turns the bars off.

A view's worker thread computes under ``quiet()``: the view shows its own busy state there, and a
bar drawn from that thread would land in whichever cell ran last (ipykernel sends a thread's
output to the latest cell), not the one that made the view. A bar that thread updates is drawn
by the next update or tick of the thread that waits on it.
"""

from __future__ import annotations

import contextlib
import html
import os
import sys
import threading
import time
from typing import Self

DELAY = 1.0
"""Seconds a wait lasts before its bar is shown."""
REFRESH = 0.1
"""Least seconds between two redraws of a shown bar."""


_local = threading.local()


@contextlib.contextmanager
def quiet():
    """Within it, this thread draws no bar (module docstring)."""
    before = getattr(_local, "quiet", False)
    _local.quiet = True
    try:
        yield
    finally:
        _local.quiet = before


def enabled() -> bool:
    """Whether bars are shown at all (``PCW_PROGRESS=0`` or ``TQDM_DISABLE=1`` turn them off)."""
    return os.environ.get("PCW_PROGRESS", "1") != "0" and os.environ.get("TQDM_DISABLE", "") in ("", "0")


def in_notebook() -> bool:
    """True when the code runs in a Jupyter kernel (its output goes to a notebook cell)."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class Progress:
    """One wait's bar: ``update(n)`` counts work done, ``note(text)`` says what runs now,
    ``tick()`` lets a wait with nothing to count show the bar once it passes the delay.
    Thread-safe (a runner's worker may report). ``total=None``: a bar without an end (elapsed
    time and count only)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", *, delay: float | None = None):
        self.desc, self.total, self.unit = desc, total, unit
        self.n, self._note = 0, ""
        self._delay = DELAY if delay is None else delay
        self._start = time.monotonic()
        self._drawn = 0.0
        self._bar = None
        self._closed = False
        self._lock = threading.Lock()

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.n += n
        self._show()

    def note(self, text: str) -> None:
        with self._lock:
            self._note = text
        self._show(force=True)

    def tick(self) -> None:
        self._show()

    def _show(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if self._closed or not enabled() or now - self._start < self._delay or getattr(_local, "quiet", False):
                return
            if self._bar is None:
                self._bar = (CellBar if in_notebook() else ConsoleBar)(self.desc, self.unit, self.total)
            elif not force and now - self._drawn < REFRESH:
                return
            self._drawn = now
            self._bar.draw(self.n, self.total, self._note, now - self._start)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(desc: str, total: int | None = None, unit: str = "it", *, delay: float | None = None) -> Progress:
    """A :class:`Progress` bar for one wait (use it as a context manager)."""
    return Progress(desc, total, unit, delay=delay)


def steps(iterable, desc: str, total: int | None = None, unit: str = "it"):
    """Each item of ``iterable``, counting them on a bar (``total`` defaults to its ``len``)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    with progress(desc, total, unit) as bar:
        for item in iterable:
            yield item
            bar.update()


class ConsoleBar:
    """A ``tqdm`` bar on stderr, cleared when closed."""

    def __init__(self, desc: str, unit: str, total: int | None):
        from tqdm import tqdm

        self._bar = tqdm(desc=desc, unit=unit, total=total, leave=False, dynamic_ncols=True)

    def draw(self, n: int, total: int | None, note: str, elapsed: float) -> None:
        bar = self._bar
        bar.total, bar.n = total, n
        bar.start_t = bar._time() - elapsed  # the wait began before the bar was made
        bar.set_postfix_str(note, refresh=False)
        bar.refresh()

    def close(self) -> None:
        self._bar.close()


class CellBar:
    """An HTML bar in the running cell's output, redrawn in place; blanked when closed."""

    def __init__(self, desc: str, unit: str, total: int | None):
        from IPython.display import display

        self.desc, self.unit = desc, unit
        self._handle = display({"text/plain": desc}, raw=True, display_id=True)

    def draw(self, n: int, total: int | None, note: str, elapsed: float) -> None:
        from tqdm import tqdm

        meter = tqdm.format_meter(n, total, elapsed, unit=self.unit, postfix=note or None)
        value = f'value="{n}" max="{total}"' if total else ""  # no total: an indeterminate bar
        self._handle.update({
            "text/plain": meter,
            "text/html": f'<div class="pcw-progress"><progress {value} style="width:16em"></progress> '
                         f"<code>{html.escape(f'{self.desc}: {meter}')}</code></div>",
        }, raw=True)

    def close(self) -> None:
        self._handle.update({"text/plain": ""}, raw=True)
