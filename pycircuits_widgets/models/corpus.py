"""The training corpus every machine already has: CPython's bundled docs and stdlib sources.

Documents, in this fixed order: every topic of ``pydoc_data.topics`` (sorted by topic name),
then every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (sorted by relative POSIX
path), skipping ``site-packages`` and the test suites (``test``, ``tests``, ``idle_test``
directories). Python versions ship different stdlibs, so a checkpoint records the
``corpus_sha256`` it was trained on; the hash of the current machine may differ.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files() -> list[Path]:
    """Sorted stdlib source files used by the corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus_documents(source: str = "all") -> list[str]:
    """The corpus as a list of documents. ``source``: ``"pydoc"``, ``"stdlib"`` or ``"all"``."""
    if source not in ("pydoc", "stdlib", "all"):
        raise ValueError(f"corpus source must be 'pydoc', 'stdlib' or 'all', got {source!r}")
    docs: list[str] = []
    if source in ("pydoc", "all"):
        from pydoc_data.topics import topics

        docs += [topics[name] for name in sorted(topics)]
    if source in ("stdlib", "all"):
        docs += [p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files()]
    return docs


def corpus_sha256(documents: list[str]) -> str:
    """sha256 over the documents (each UTF-8 encoded, separated by a NUL byte)."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(doc.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()
