"""Effective embeddings: the token representation a layer's heads actually read (issue 56).

The paper reads every head's circuits through ``W_E``. That is exact for a layer-0 head, whose input
*is* the token embedding; a head of layer 18 reads a residual stream that 18 layers rewrote, so its
circuits read through ``W_E`` describe inputs it never sees. Interpretability work reads such heads
through an *effective* embedding instead (the indirect-object paper: the embedding plus the first MLP).

``effective_embedding(model, layer, kind)`` gives, per token, the vector the heads of ``layer`` read
(after that layer's norm, as ``model.layer_read`` normalises a stream):

* ``"raw"``: ``W_E`` (the paper's reading; ``circuits.embedding``: normalised where that is exact);
* ``"mlp0"``: ``W_E`` through the first block alone, the token attending to itself (a one-token
  context: its attention pattern is 1) and then the first MLP: the extended embedding. Positions are
  left out (learned ones kept apart, as everywhere; rotary ones rotate nothing at a single position);
* ``"corpus"``: each token's mean residual stream entering ``layer`` over the positions of a sweep's
  windows that hold it, from one forward of the windows stopped at the layer (``run_with_cache(
  layers=)``); the count of positions kept per token, and tokens seen fewer than ``min_count`` times
  left out (counted in ``left_out``). Then normalised as the layer reads it (the norm of the mean
  stream: the heads' reading of the average context, not the average of their readings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.interventions import Interventions
from .ablation import check_model
from .cache import MODEL, keeper, stored
from .circuits import check_index, embedding

KINDS = ("raw", "mlp0", "corpus")
BATCH_WINDOWS = 16
"""Windows per forward of ``"corpus"`` (its peak memory is one batch's activations up to the layer)."""
MEANS_BYTES = 1 << 30
"""Most bytes of float64 sums one pass over a sweep holds (``corpus_means``): a reading of every layer, as
the eigenvalue plot's, is then a few passes, not one per layer."""


@dataclass(frozen=True)
class EffectiveEmbedding:
    """What the heads of ``layer`` read for each of ``tokens``, by ``kind`` (module docstring).

    ``tokens [n]`` (int64 ids, ascending), ``stream [n, d_model]`` (the residual stream entering the
    layer: ``W_E`` rows, the stream after block 0, or the corpus mean; float64 for ``"corpus"``),
    ``vectors [n, d_model]`` (what the layer's heads read of it, after its norm; the model's dtype),
    ``counts [n]`` (positions of the sweep holding each token; None but for ``"corpus"``),
    ``left_out`` (tokens the sweep holds fewer than ``min_count`` times), ``note`` (what it ignores).
    """

    layer: int
    kind: str
    tokens: torch.Tensor
    stream: torch.Tensor
    vectors: torch.Tensor
    counts: torch.Tensor | None
    left_out: int
    note: str


def effective_embedding(model, layer: int, kind: str = "raw", sweep=None, min_count: int = 1) -> EffectiveEmbedding:
    """The token representation the heads of ``layer`` read (module docstring). ``sweep`` (a finished
    ``pcw.sweep`` of this model) for ``kind="corpus"``; ``min_count``: fewest positions a token needs
    there to be kept."""
    check_model(model, "effective_embedding")
    L = model.cfg.n_layers
    check_index(layer, "effective_embedding: layer", L)
    if kind not in KINDS:
        raise ValueError(f"effective_embedding: kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    if (sweep is None) != (kind != "corpus"):
        raise ValueError("effective_embedding: kind='corpus' reads a sweep (sweep=pcw.sweep(...)); the other kinds "
                         f"read the weights alone (got kind={kind!r}, sweep={type(sweep).__name__})")
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise ValueError(f"effective_embedding: min_count must be an int >= 1, got {min_count!r}")
    if kind == "raw":
        tokens = torch.arange(model.cfg.d_vocab, device=model.device)
        return EffectiveEmbedding(layer, kind, tokens, model.W_E, embedding(model, layer), None, 0,
                                  "W_E as the paper reads it: exact at layer 0 only (deeper layers read a stream "
                                  "the layers before them rewrote).")
    if kind == "mlp0":
        if layer == 0:
            raise ValueError("effective_embedding: kind='mlp0' is the stream after block 0; layer 0's heads read "
                             "the stream before it (kind='raw')")
        stream = after_block_0(model)
        tokens = torch.arange(model.cfg.d_vocab, device=model.device)
        return EffectiveEmbedding(layer, kind, tokens, stream, model.layer_read(stream)[0], None, 0,
                                  "W_E through block 0 with the token attending to itself alone: what other tokens "
                                  "and blocks 1.. write is left out.")
    sweep.check_model(model, "effective_embedding")
    tokens, stream, counts = corpus_means(model, sweep, [layer])[layer]
    kept = counts >= min_count
    return EffectiveEmbedding(layer, kind, tokens[kept], stream[kept], model.layer_read(stream[kept].to(model.dtype))[0],
                              counts[kept], int((~kept).sum()),
                              f"the mean stream entering layer {layer} over the sweep's positions holding each token: "
                              "one vector per token for every context it came in.")


def after_block_0(model) -> torch.Tensor:
    """``[d_vocab, d_model]``: each token's stream after block 0 in a one-token context, positions left out:
    the forward's own first layer on ``W_E`` set as its input stream (``Interventions(resid=)``)."""
    W_E = model.W_E
    tokens = torch.zeros(W_E.shape[0], 1, dtype=torch.long, device=W_E.device)  # (the stream is set below)
    _, cache = model.run_with_cache(tokens, Interventions(resid={0: W_E[:, None]}), logits=False, layers=1)
    return cache.resid[:, 1, 0]


def corpus_means(model, sweep, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``{layer: (tokens [n], mean stream [n, d_model] float64, counts [n])}`` over the tokens ``sweep``'s
    windows hold: each token's mean residual stream entering each of ``layers`` (module docstring). Kept
    per model, sweep and layer (``cache``: a finished sweep never changes); the layers not kept yet are
    computed by ``corpus_means_of`` in groups whose sums fit ``MEANS_BYTES``, one pass per group, stopped
    at the group's last layer (one layer asked: one pass stopped there, its sums alone in memory)."""
    sweep.check_model(model, "corpus_means")
    key = ("corpus_means", str(sweep.path), sweep.manifest["digest"])
    found = {layer: stored(model, (*key, layer)) for layer in sorted(set(layers))}
    missing = [layer for layer, value in found.items() if value is None]
    if missing:
        n_seen = int(torch.unique(sweep.windows).numel())
        group = max(1, MEANS_BYTES // (n_seen * model.cfg.d_model * 8))
        for start in range(0, len(missing), group):
            part = missing[start:start + group]
            keep = {layer: keeper(model, (*key, layer), tier=MODEL) for layer in part}
            found.update({layer: keep[layer](value) for layer, value in corpus_means_of(model, sweep, part).items()})
    return found


def corpus_means_of(model, sweep, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``corpus_means`` of each of ``layers``, uncached: one forward of the windows stopped at the last of
    them, ``BATCH_WINDOWS`` at a time; sums in float64 over the tokens seen only (``tokens seen x d_model
    x 8`` bytes a layer)."""
    windows = sweep.windows.to(model.device)
    tokens, compact = torch.unique(windows, return_inverse=True)
    sums = {layer: torch.zeros(len(tokens), model.cfg.d_model, dtype=torch.float64, device=model.device)
            for layer in layers}
    counts = torch.bincount(compact.reshape(-1), minlength=len(tokens))
    with torch.no_grad():
        for start in range(0, len(windows), BATCH_WINDOWS):
            batch = windows[start:start + BATCH_WINDOWS]
            _, cache = model.run_with_cache(batch, logits=False, layers=max(*layers, 1))
            rows = compact[start:start + BATCH_WINDOWS].reshape(-1)
            for layer, total in sums.items():
                total.index_add_(0, rows, cache.resid[:, layer].reshape(-1, model.cfg.d_model).to(torch.float64))
    return {layer: (tokens, total / counts[:, None], counts) for layer, total in sums.items()}
