"""How far a long job is, and how long it has left: the ``progress`` trait a view shows.

A job cut into pieces (an on-demand section's layer pairs, ranked tables; the explorer's heads)
reports ``{"text", "done", "total", "unit", "left_s"}``: ``left_s`` is the time the pieces left
would take at the rate measured over the pieces done (wall time since the job's first piece
began, clicks it gave way to included, divided by the pieces done). That is an honest estimate
only where the pieces cost the same; a job whose pieces differ meters each kind of piece apart
(one :class:`Meter` per stage), and a stage of one piece has no estimate.
"""

from __future__ import annotations

import time

EVERY = 0.5
"""Least seconds between two reports (each is a message to the page); the first and last always go."""


class Meter:
    """The ``progress`` reports of one stage of ``total`` equal pieces. ``at(done)`` after each
    piece: ``{"progress": {...}}`` when a report is due, else None (the runner's chunk boundary)."""

    def __init__(self, text: str, total: int, unit: str = "", start: float | None = None):
        """``start``: when the stage's first piece began (``time.monotonic()``; default now)."""
        self.text, self.total, self.unit = text, total, unit
        self._start = time.monotonic() if start is None else start
        self._sent = None  # when the last report went

    def first(self) -> dict:
        """The report before the first piece: the count, no estimate yet."""
        self._sent = time.monotonic()
        return {"progress": self.report(0)}

    def at(self, done: int) -> dict | None:
        now = time.monotonic()
        if self._sent is not None and done < self.total and now - self._sent < EVERY:
            return None
        self._sent = now
        return {"progress": self.report(done, now)}

    def report(self, done: int, now: float | None = None) -> dict:
        """The ``progress`` value after ``done`` pieces (``left_s`` None before the first)."""
        elapsed = (time.monotonic() if now is None else now) - self._start
        left = None if done <= 0 else elapsed / done * (self.total - done)
        return {"text": self.text, "done": done, "total": self.total, "unit": self.unit, "left_s": left}


def metered(steps, names: dict):
    """Runner steps of an analysis in pieces (``analysis.pieces``: yields ``(done, total)`` or
    ``(stage, done, total)``): a report (or None, a chunk boundary) after each piece, one
    :class:`Meter` per stage, named ``names[stage]`` = ``(text, unit)`` (stage None for pairs).
    Returns the analysis's result: ``result = yield from metered(...)``."""
    meters = {}
    while True:
        began = time.monotonic()  # a stage's clock starts with its first piece, not after it
        try:
            item = next(steps)
        except StopIteration as stop:
            return stop.value
        stage, done, total = item if len(item) == 3 else (None, *item)
        if stage not in meters:
            text, unit = names[stage]
            meters[stage] = Meter(text, total, unit, start=began)
            yield meters[stage].first() if done == 0 else meters[stage].at(done)
        else:
            yield meters[stage].at(done)


def cancelled(progress: dict) -> dict:
    """The ``progress`` value of a job cancelled after the report ``progress`` (its count kept:
    "cancelled at 12/48 source blocks"; no estimate)."""
    reached = {k: v for k, v in progress.items() if k in ("text", "done", "total", "unit")}
    return {**reached, "state": "cancelled"}
