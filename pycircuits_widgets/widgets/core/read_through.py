"""The embedding a view reads a deeper head's circuits through, as a view's control (issue "Circuits at
depth"): ``W_E`` (the paper's reading, exact at layer 0), ``W_E`` through block 0, or the corpus stream
entering the head's layer (``analysis.effective_embedding``)."""

from __future__ import annotations

import traitlets

from ...analysis.effective_embedding import EffectiveEmbedding, effective_embedding

READ_THROUGH = {"raw": "W_E", "mlp0": "W_E + block 0", "corpus": "the corpus stream"}
"""How a view names each embedding a head's circuits can be read through (``embedding``)."""


class ReadThrough(traitlets.HasTraits):
    """Mixin (before ``CircuitWidget``): trait ``embedding`` (a key of ``READ_THROUGH``), settable from the
    view's control (``js/src/components/ReadThrough.svelte``) or Python, ``embedding_kinds`` (why a choice
    cannot be made: ``"corpus"`` without a sweep) and ``read_through`` (what the shown result read, with
    what that reading leaves out).

    A subclass passes ``sweep`` on to ``super().__init__(model, sweep=..., ...)`` (kept as ``self._sweep``)
    and observes ``embedding``; ``self._read(layer)`` gives the ``EffectiveEmbedding`` a head of ``layer`` is read
    through now (None: ``W_E``) and its name, each computed once per kind and layer. A layer-0 head reads
    ``W_E`` itself, whatever the choice: it is exact there."""

    embedding = traitlets.Enum(list(READ_THROUGH), default_value="raw").tag(sync=True)
    """str, default "raw": what a head of layer >= 1 is read through (``pcw.effective_embedding``): "raw"
    (``W_E``), "mlp0" (``W_E`` through block 0) or "corpus" (each token's mean stream entering the head's
    layer over the sweep's positions)."""
    embedding_kinds = traitlets.Dict().tag(sync=True)
    """{kind: "" where available, else why not} (read-only), for each ``embedding`` choice."""
    read_through = traitlets.Unicode("").tag(sync=True)
    """str (read-only): what the shown result read ("W_E", "W_E + block 0", "the corpus stream at layer 1
    (812 tokens seen)"), with what that reading leaves out."""

    def __init__(self, model=None, sweep=None, **kwargs):
        view = type(self).__name__
        self._sweep = sweep
        self._embeddings: dict[tuple[str, int], EffectiveEmbedding] = {}
        kinds = {"raw": "", "mlp0": "", "corpus": "" if sweep is not None else
                 f"the corpus stream needs a sweep: {view}(model, sweep=...) (the explorer's)"}
        super().__init__(model, embedding_kinds=kinds, **kwargs)

    @traitlets.validate("embedding")
    def _valid_embedding(self, proposal):
        why = self.embedding_kinds.get(proposal["value"], "")
        if why:
            raise traitlets.TraitError(f"embedding={proposal['value']!r}: {why}")
        return proposal["value"]

    def _read(self, layer: int) -> tuple[EffectiveEmbedding | None, str]:
        """``(embedding, name)``: what a head of ``layer`` is read through now (None: ``W_E``) and how the
        view names it."""
        kind = self.embedding if layer > 0 else "raw"
        if kind == "raw":
            why = "" if layer > 0 or self.embedding == "raw" else " (a layer-0 head reads the embedding itself)"
            return None, f"W_E{why}"
        if (kind, layer) not in self._embeddings:
            self._embeddings[kind, layer] = effective_embedding(self.model, layer, kind, sweep=self._sweep if
                                                                kind == "corpus" else None)
        found = self._embeddings[kind, layer]
        named = READ_THROUGH[kind] + (f" at layer {layer} ({len(found.tokens):,} tokens seen)" if kind == "corpus"
                                      else "")
        return found, f"{named}: {found.note}"
