"""The one check of a count argument (``seq_len``, ``batch_size``, ``workers``, ...) shared by the corpus
modules: a refusal names the argument and what it takes, never a default taken in its place."""

from __future__ import annotations


def check_positive(name: str, value, what: str = "a positive int") -> None:
    """Refuse (``ValueError`` naming ``name`` and ``what`` it takes) anything but an int >= 1 (a bool is
    no count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be {what}, got {value!r}")
