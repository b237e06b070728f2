"""VirtualHeads: the strongest V-composition pairs as virtual attention heads."""

from __future__ import annotations

import traitlets

from ...analysis.virtual_heads import top_virtual_heads_steps
from ..core.base import CircuitWidget
from ..core.meter import metered
from ..core.on_demand import OnDemand
from ..core.payload import JSON_BUFFER
from ..core.selection import HeadSelection, PairSelection, check_model


class VirtualHeads(OnDemand, HeadSelection, PairSelection, CircuitWidget):
    """The ``k`` strongest virtual heads ``h1 -> h2`` (earlier -> later; paper: V-composition) by
    ``||W_OV^{h1} W_OV^{h2}||_F``, each with the eigenvalue positivity of its full OV circuit
    ``W_E W_OV^{h1} W_OV^{h2} W_U`` (copying) and the tokens it copies most
    (``pcw.analysis.virtual_heads``). Clicking a row selects the pair (and its later head).
    Everything is embedded: works without a kernel. Computed on the widget's runner
    (``on_demand``; two minutes at GPT-2-small shapes), once ``active``; each virtual head is
    shown as it comes, strongest first.

    Args:
        model: a weight view with at least 2 layers.
        k: virtual heads listed. n_copies: copied tokens per virtual head.
        active: compute now (default) or when ``active`` is first set (``on_demand``).
    """

    _view = traitlets.Unicode("VirtualHeads").tag(sync=True)
    _browser_writable = frozenset({"layer", "head", "selected_pair", "active"})

    # -- data --
    heads = traitlets.List().tag(sync=True, **JSON_BUFFER)
    """[{"pair": [l1, h1, l2, h2], "norm", "positivity", "copies": [{"id", "str", "score"}]}], strongest first."""

    def __init__(self, model, k: int = 12, n_copies: int = 8, **kwargs):
        check_model(model, "VirtualHeads")
        if model.cfg.n_layers < 2:
            raise ValueError(f"VirtualHeads needs at least 2 layers (a virtual head spans two), "
                             f"got n_layers={model.cfg.n_layers}")
        if k < 1 or n_copies < 1:
            raise ValueError(f"k and n_copies must be >= 1, got k={k}, n_copies={n_copies}")
        self._k, self._n_copies = k, n_copies
        super().__init__(model, **kwargs)

    def _ready(self) -> bool:
        return bool(self.heads)

    def _start(self) -> None:
        self._runner.submit("heads", self._heads_steps)

    def _heads_steps(self):
        """``top_virtual_heads`` piece by piece (one virtual head each, metered, strongest first),
        each shown as it comes."""
        done = []
        steps = metered(top_virtual_heads_steps(self.model, self._k, self._n_copies, into=done),
                        {None: ("virtual heads", "heads")})
        shown = 0
        while True:
            try:
                report = next(steps)
            except StopIteration as stop:
                heads = stop.value
                break
            if len(done) > shown:
                shown = len(done)
                yield {"heads": self._payload(done), **(report or {})}
            else:
                yield report
        yield {"progress": {}, "heads": self._payload(heads)}

    def _payload(self, heads) -> list[dict]:
        strings = self.model.token_strings
        return [{"pair": [*v.h1, *v.h2], "norm": v.norm, "positivity": v.positivity,
                 "copies": [{"id": i, "str": strings[i], "score": s} for i, s in v.copies]} for v in heads]
