"""Analyses in pieces: a generator that yields ``(done, total)`` (or a stage besides) after each
piece and returns its result (``StopIteration.value``), so a caller (a view's runner) can report
how far it is, give way or stop between pieces. The plain function is the generator run through
(:func:`drained`), so both give the same numbers by construction."""

from __future__ import annotations


def drained(steps):
    """The value a pieces generator returns, its pieces run through."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def counted(steps, desc: str, unit: str):
    """``drained``, its pieces counted on a progress bar named ``desc`` (shown past a second)."""
    from ..progress import progress

    with progress(desc, unit=unit) as bar:
        while True:
            try:
                *_, done, total = next(steps)
            except StopIteration as stop:
                return stop.value
            bar.total = total
            bar.update(done - bar.n)


def whole(compute, *args, **kwargs):
    """A pieces generator of no pieces that returns ``compute(*args, **kwargs)``: a quick computation
    where a caller expects pieces."""
    return compute(*args, **kwargs)
    yield  # (makes this a generator)
