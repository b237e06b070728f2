"""PositionalQK: a head's attention score by relative offset from the positional QK term, beside
its measured attention by offset on a text."""

from __future__ import annotations

import torch
import traitlets

from ...analysis.circuits import model_name
from ...analysis.positional import attention_by_offset, positional_scores_by_offset_steps
from ..core.arrays import Array
from ..core.base import CircuitWidget
from ..core.meter import metered
from ..core.selection import HeadSelection, check_model
from ..core.text_data import TextData

MAX_OFFSET = 256
"""Largest offset computed by default (clipped to the text's length - 1): every head's window lies within."""
MIN_WINDOW = 16
"""Fewest offsets past 0 a head's window shows (a previous-token head peaks at 1); fewer on a shorter text."""
WINDOW_SHARE = 0.05
"""A head's window reaches the farthest offset whose attention mass on the text (all the attention its
positions pay that far back) is at least this share of its largest, plus one offset (so that the farthest
is not the window's edge). Mass, not the mean: the few positions at far offsets all attend the first
token when nothing else fits, which would pull every window to the text's length."""


def head_windows(measured: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Each head's window, the largest offset it shows: ``measured [L, H, K + 1]`` (mean attention by
    offset on a text of ``n_tokens``) -> int32 ``[L, H]`` in ``min(MIN_WINDOW, K)..K`` (module constants)."""
    K = measured.shape[-1] - 1
    mass = measured * (n_tokens - torch.arange(K + 1))  # offset k averages over n_tokens - k positions
    held = mass >= WINDOW_SHARE * mass.amax(-1, keepdim=True)
    farthest = torch.where(held, torch.arange(K + 1), 0).amax(-1)
    return (farthest + 1).clamp(min(MIN_WINDOW, K), K).to(torch.int32)


RULES = {
    "table": "positional term of the QK circuit: mean over i of (W_pos W_Q W_K^T W_pos^T)[i, i - k] / attn_scale",
    "rotary": "rotary rule: mean query · R(k) · mean key / attn_scale (no positional table in a rotary model)",
}


class PositionalQK(TextData, HeadSelection, CircuitWidget):
    """For the selected head (``layer``/``head``): the attention score against relative offset
    ``k`` (destination minus source position) from the positional term of its QK circuit (the
    pointer arithmetic of a previous-token head), next to its measured mean attention by offset
    on ``text`` (``pcw.analysis.positional``). Rotary models use the rotary rule, not a table.
    Both curves of every head are embedded, so switching heads works without a kernel. They are
    computed on the widget's runner (``on_demand``), once ``active``.

    Args:
        model: a weight view with positional information (Shortformer, learned or rotary).
        text: the text whose attention is measured (and, for rotary models, whose mean query and key are used).
        max_offset: largest offset computed (clipped to the text's length - 1); each head's chart shows
            the offsets where its attention is (``window``), and every offset when the reader widens it.
        forward: ``forward(model, text) -> RunResult`` (default ``pcw.run``; the explorer passes its own).
        active: compute now (default) or when ``active`` is first set (``on_demand``).
        one_token: accept a one-token text (no offsets: the view is cleared) instead of refusing
            it; the explorer, which reads any text, passes True.
    """

    _view = traitlets.Unicode("PositionalQK").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "text", "active"})

    # -- data --
    text = traitlets.Unicode("").tag(sync=True)
    """str: the text; setting it re-measures (a bad text is refused, the last good one stays)."""
    positional = Array("float32", ndim=3).tag(sync=True)
    """float32 [L, H, max_offset + 1] (None before the first text): positional attention score by offset (see ``rule``)."""
    measured = Array("float32", ndim=3).tag(sync=True)
    """float32 [L, H, max_offset + 1]: mean attention weight A[i, i - k] on ``text``."""
    window = Array("int32", ndim=2).tag(sync=True)
    """int32 [L, H]: the largest offset each head's chart shows by default, where its attention mass on
    ``text`` is (``head_windows``); the reader widens it to every offset computed."""
    rule = traitlets.Unicode("").tag(sync=True)
    """str: how ``positional`` was computed (positional table or rotary rule)."""
    n_tokens = traitlets.Int(0).tag(sync=True)
    """int: tokens in ``text`` (the measured curve averages over them)."""

    def __init__(self, model, text: str, max_offset: int = MAX_OFFSET, forward=None, one_token: bool = False,
                 **kwargs):
        check_model(model, "PositionalQK")
        if model.cfg.positional == "none":
            raise ValueError(f"model {model_name(model)!r} has no positional information: no positional QK to show")
        self._max_offset = int(max_offset)
        if self._max_offset < 1:
            raise ValueError(f"max_offset must be >= 1, got {max_offset}")
        super().__init__(model, text, forward, one_token, **kwargs)

    _short_text = "offsets need at least 2"

    def _ready(self) -> bool:
        return self.positional is not None

    def _text_steps(self, text: str):
        """The text's forward, then the positional scores one layer at a time (metered), then the
        measured attention and the windows."""
        out = self._forward(self.model, text)
        n = out.tokens.shape[-1]
        if n < 2:  # no offsets to show
            yield {"positional": None, "measured": None, "window": None, "n_tokens": n}
            return
        k = min(self._max_offset, n - 1)
        positional = yield from metered(positional_scores_by_offset_steps(self.model, n, k, cache=out.cache),
                                        {None: ("positional: scores by offset", "layers")})
        measured = attention_by_offset(out.patterns[0], k)
        yield {"progress": {},
            "positional": positional, "measured": measured, "window": head_windows(measured, n),
            "rule": RULES["rotary" if self.model.cfg.positional == "rotary" else "table"], "n_tokens": n,
        }
