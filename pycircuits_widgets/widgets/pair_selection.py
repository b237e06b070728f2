"""Selection of a head pair (earlier head -> later head) for the views of composing heads."""

from __future__ import annotations

import traitlets


class PairSelection(traitlets.HasTraits):
    """Selection trait ``selected_pair``: ``[l1, h1, l2, h2]`` with ``l1 < l2``, or ``[]`` for none.

    Same name and meaning as ``CompositionMatrix.selected_pair``. Selecting a pair also selects
    its later head (``layer``/``head`` = ``l2``/``h2``), as a composition cell click does.
    A subclass sets ``self.model`` before ``super().__init__``.
    """

    selected_pair = traitlets.List(traitlets.Int()).tag(sync=True)
    """[l1, h1, l2, h2] with l1 < l2 (earlier head -> later head), or [] for none."""

    @traitlets.validate("selected_pair")
    def _valid_pair(self, proposal):
        pair = list(proposal["value"])
        if not pair:
            return []
        cfg = self.model.cfg
        ok = len(pair) == 4 and 0 <= pair[0] < pair[2] < cfg.n_layers and all(
            0 <= h < cfg.n_heads for h in pair[1::2])
        if not ok:
            raise traitlets.TraitError(
                f"selected_pair must be [] or [l1, h1, l2, h2] with 0 <= l1 < l2 <= {cfg.n_layers - 1} and "
                f"heads in 0..{cfg.n_heads - 1}, got {pair}"
            )
        return pair

    @traitlets.observe("selected_pair")
    def _pair_selects_later_head(self, change):
        pair = change["new"]
        if pair and hasattr(self, "head"):
            with self.hold_trait_notifications():
                self.layer, self.head = pair[2], pair[3]


def pair_key(pair) -> str:
    """``"l1,h1,l2,h2"``: the key of a pair in a view's embedded per-pair data."""
    return ",".join(str(int(x)) for x in pair)
