"""VirtualHeads: the strongest V-composition pairs as virtual attention heads."""

from __future__ import annotations

import traitlets

from ..analysis.virtual_heads import top_virtual_heads
from .base import CircuitWidget
from .pair_selection import PairSelection
from .selection import HeadSelection, check_model


class VirtualHeads(HeadSelection, PairSelection, CircuitWidget):
    """The ``k`` strongest virtual heads ``h1 -> h2`` (earlier -> later; paper: V-composition) by
    ``||W_OV^{h1} W_OV^{h2}||_F``, each with the eigenvalue positivity of its full OV circuit
    ``W_E W_OV^{h1} W_OV^{h2} W_U`` (copying) and the tokens it copies most
    (``pcw.analysis.virtual_heads``). Clicking a row selects the pair (and its later head).
    Everything is embedded: works without a kernel.

    Args:
        model: a weight view with at least 2 layers.
        k: virtual heads listed. n_copies: copied tokens per virtual head.
    """

    _view = traitlets.Unicode("VirtualHeads").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "selected_pair"})

    # -- data --
    heads = traitlets.List().tag(sync=True)
    """[{"pair": [l1, h1, l2, h2], "norm", "positivity", "copies": [{"id", "str", "score"}]}], strongest first."""

    def __init__(self, model, k: int = 12, n_copies: int = 8, **kwargs):
        check_model(model, "VirtualHeads")
        if model.cfg.n_layers < 2:
            raise ValueError(f"VirtualHeads needs at least 2 layers (a virtual head spans two), "
                             f"got n_layers={model.cfg.n_layers}")
        self.model = model
        strings = model.token_strings
        rows = [{
            "pair": [*v.h1, *v.h2], "norm": v.norm, "positivity": v.positivity,
            "copies": [{"id": i, "str": strings[i], "score": s} for i, s in v.copies],
        } for v in top_virtual_heads(model, k, n_copies)]
        super().__init__(heads=rows, **kwargs)
