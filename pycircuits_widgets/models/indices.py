"""The one check of an index into a model (a layer, a head, a neuron, a token id) and of a pair of them.

Every function that takes a head ``(layer, head)`` or a neuron ``(layer, neuron)`` checks it here, so a
wrong one is refused the same way everywhere: a ``TypeError`` for what is no int (``True`` is not layer
1, ``1.0`` is not head 1), a ``ValueError`` for an int out of range, each naming the value and the range.
"""

from __future__ import annotations

import operator


def check_index(value, name: str, size: int) -> int:
    """``value`` as an int in ``0..size-1`` (an int, numpy integer or 0-d integer tensor; not a bool,
    float or str), or the error naming ``name`` and the valid range."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int in 0..{size - 1}, got {value!r} (bool)")
    try:
        index = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int in 0..{size - 1}, got {value!r} ({type(value).__name__})") from None
    if not 0 <= index < size:
        raise ValueError(f"{name} must be in 0..{size - 1}, got {index} (out of range)")
    return index


def check_pair(pair, sizes: tuple[int, int], names: tuple[str, str] = ("layer", "head"),
               where: str = "") -> tuple[int, int]:
    """``pair`` (a tuple, list or 1-d tensor of two indices) as two ints within ``sizes``; errors name
    ``where`` (the argument: "h1", "path_patch: writer", "ablate: heads (2, 0)") and each index by its
    name in ``names``."""
    if hasattr(pair, "ndim") and hasattr(pair, "tolist") and pair.ndim == 1:  # a tensor or numpy array
        pair = tuple(pair.tolist())
    prefix = f"{where} " if where else ""
    if isinstance(pair, (str, bytes)) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"{where or names[1]} must be a ({names[0]}, {names[1]}) pair of ints, got {pair!r}")
    return (check_index(pair[0], f"{prefix}{names[0]}", sizes[0]),
            check_index(pair[1], f"{prefix}{names[1]}", sizes[1]))
