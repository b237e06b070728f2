"""ColoredTokens: tokens coloured by one value each (e.g. per-token loss)."""

from __future__ import annotations

import numpy as np
import traitlets

from ...models.tokenizer import escape_invisible
from ..core.arrays import Array
from ..core.base import CircuitWidget
from ..core.payload import to_numpy
from ..core.selection import PositionSelection


class ColoredTokens(PositionSelection, CircuitWidget):
    """Tokens coloured by one value per token, with a legend; hover shows token and value,
    clicking a token sets ``position``: its index in the text, ``first_position + i`` for
    ``tokens[i]`` (the per-token loss starts at text position 1: nothing predicts token 0).

    Args:
        tokens: ``list[str]`` of length ``n_tokens`` (shown as text, whitespace made visible;
            invisible and bidi characters kept as escapes such as ``\\u202e``).
        values: ``[n_tokens]`` tensor, array or list of finite numbers.
        label: what the values are, shown in the legend (e.g. "loss").
        colormap: "auto" (diverging when values have both signs), "sequential" or "diverging".
        vmin, vmax: optional ends of the colour scale.
        first_position: text position of ``tokens[0]`` (default 0).
        position: the selected text position, -1 for none.
    """

    _view = traitlets.Unicode("ColoredTokens").tag(sync=True)
    _browser_writable = frozenset({"position"})

    # -- data --
    tokens = traitlets.List(traitlets.Unicode()).tag(sync=True)
    """list[str]: the tokens, in order."""
    values = Array("float32", ndim=1).tag(sync=True)
    """float32 [n_tokens] (one binary buffer on the wire, see core/arrays.py); set via ``set_values``."""

    # -- display --
    label = traitlets.Unicode("value").tag(sync=True)
    """str, default "value": name of the values, shown in the legend."""
    colormap = traitlets.Enum(["auto", "sequential", "diverging"], default_value="auto").tag(sync=True)
    """str, default "auto": colour scale; auto is diverging around 0 if values have both signs."""
    vmin = traitlets.Float(None, allow_none=True).tag(sync=True)
    """float | None: lower end of the colour scale (default: min of values)."""
    vmax = traitlets.Float(None, allow_none=True).tag(sync=True)
    """float | None: upper end of the colour scale (default: max of values)."""
    note = traitlets.Unicode("").tag(sync=True)
    """str, default "": how to read the scale, shown beside the legend."""

    first_position = traitlets.Int(0).tag(sync=True)
    """int, default 0 (read-only): text position of ``tokens[0]``."""

    def __init__(self, tokens, values, **kwargs):
        tokens = _check_tokens(tokens)
        super().__init__(tokens=tokens, values=_check_values(values, len(tokens)), **kwargs)

    def set_values(self, tokens, values):
        """Replace tokens and values together (keeps them consistent)."""
        tokens = _check_tokens(tokens)
        values = _check_values(values, len(tokens))
        with self.hold_sync():
            self.position = -1
            self.tokens = tokens
            self.values = values

    def show_values(self, values, **display):
        """Replace the values of the same tokens, keeping the selected position; ``display``
        (``label``, ``colormap``, ``vmin``, ``vmax``, ``note``) changes with them, in one message."""
        unknown = sorted(set(display) - {"label", "colormap", "vmin", "vmax", "note"})
        if unknown:
            raise TypeError(f"show_values: unknown display trait(s) {unknown}; expected label, colormap, vmin, vmax, note")
        values = _check_values(values, len(self.tokens))
        with self.hold_sync():
            self.values = values
            for name, value in display.items():
                setattr(self, name, value)

    def _n_positions(self) -> int:
        # positions before first_position are in the text but not shown: selectable, not highlighted
        return self.first_position + len(self.tokens)


def _check_tokens(tokens) -> list[str]:
    """The tokens as shown: invisible, bidi and lone-surrogate characters as escapes (the view
    and its picture show every character; the widget's state is valid Unicode)."""
    if isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens):
        raise TypeError("tokens must be a list of strings (e.g. model.to_str_tokens(text))")
    return [escape_invisible(t) for t in tokens]


def _check_values(values, n_tokens: int) -> np.ndarray:
    arr = to_numpy(values, name="values").astype(np.float64)
    if arr.ndim != 1 or arr.shape[0] != n_tokens:
        raise ValueError(f"values must have shape [n_tokens] = [{n_tokens}], got {list(arr.shape)}")
    if not np.isfinite(arr).all():
        bad = np.flatnonzero(~np.isfinite(arr))[:5].tolist()
        raise ValueError(f"values must be finite; non-finite at token positions {bad}")
    too_big = np.abs(arr) > np.finfo(np.float32).max  # sent as float32: would arrive as Infinity
    if too_big.any():
        bad = np.flatnonzero(too_big)[:5].tolist()
        raise ValueError(f"values must fit in float32 (|value| <= {np.finfo(np.float32).max:.4g}); "
                         f"too large at token positions {bad}")
    return arr
