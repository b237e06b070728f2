"""A glob pattern's matches, with every real folder listed at most once per ``**``.

``glob.glob(pattern, recursive=True)`` follows links to folders under ``**`` with no memory of where it
has been: a link back to a folder above it is walked again and again until the path reaches the kernel's
limit on links in one path (40), so one such link lists the tree 41 times and two list it 2**40 times
(a walk that never ends). Here a ``**`` enters a folder only the first time it meets its real path.
Otherwise the matches are glob's: ``*``, ``?`` and ``[...]`` match within one name and never a name that
starts with ``.`` (unless the pattern's does); ``**`` alone in a segment matches zero or more folders
(hidden ones not entered); links are followed; a dangling link is a match (the caller decides what it is).
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Iterator


def expand(pattern: str) -> list[str]:
    """The paths ``pattern`` matches (module docstring), sorted, each once."""
    if os.altsep:
        pattern = pattern.replace(os.altsep, os.sep)
    parts = pattern.split(os.sep)
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))  # callers pass a pattern
    base = os.sep.join(parts[:first]) or (os.sep if first else "")  # "" is the current folder, as glob's
    return sorted(set(_match(base, parts[first:])))


def _match(base: str, parts: list[str], entries: list[os.DirEntry] | None = None) -> Iterator[str]:
    """Paths under the folder ``base`` matching the pattern segments ``parts``; ``entries``: ``base``'s,
    where the caller has listed it already."""
    if not parts:
        yield base
        return
    part, rest = parts[0], parts[1:]
    if part == "**":
        for folder, listed in _folders(base):
            if rest:
                yield from _match(folder, rest, listed)
            else:  # a final ** matches every name under base, as glob's does
                yield folder
                yield from (_join(folder, entry.name) for entry in listed if not _hidden(entry.name))
    elif not glob.has_magic(part):
        path = _join(base, part)
        if rest and os.path.isdir(path):
            yield from _match(path, rest)
        elif not rest and os.path.lexists(path):
            yield path
    else:
        for entry in _entries(base) if entries is None else entries:
            if (_hidden(part) or not _hidden(entry.name)) and fnmatch.fnmatch(entry.name, part):
                path = _join(base, entry.name)
                if not rest:
                    yield path
                elif _is_folder(entry):
                    yield from _match(path, rest)


def _folders(base: str) -> Iterator[tuple[str, list[os.DirEntry]]]:
    """``base`` and every folder under it, links followed, hidden ones not entered, each real folder once;
    each with its entries."""
    seen: set[str] = set()
    todo = [base]
    while todo:
        folder = todo.pop()
        real = os.path.realpath(folder or os.curdir)
        if real in seen:
            continue
        seen.add(real)
        entries = _entries(folder)
        yield folder, entries
        todo += [_join(folder, e.name) for e in entries if not _hidden(e.name) and _is_folder(e)]


def _entries(folder: str) -> list[os.DirEntry]:
    """The entries of ``folder`` (none if it cannot be listed: glob's rule)."""
    try:
        with os.scandir(folder or os.curdir) as entries:
            return list(entries)
    except OSError:
        return []


def _is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # through links
    except OSError:
        return False


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _join(folder: str, name: str) -> str:
    return os.path.join(folder, name) if folder else name
