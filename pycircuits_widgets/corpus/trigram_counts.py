"""Weights meet the corpus: how often a head's skip-trigrams occur in a sweep's windows, and how much
the head attends from destination to source where they do.

A skip-trigram ``[source] ... [destination] -> [out]`` (``analysis.skip_trigrams``) is read off the
weights; ``trigram_counts(sweep, model, layer, head, triples)`` checks it against the text swept
(``sweep.windows [N, T]``, the token ids the sweep ran the model on).

**Occurrence** (exact, integer): window ``w`` and destination position ``d`` with
``windows[w, d] == destination``, ``windows[w, d + 1] == out`` and ``source`` at some position
``s < d`` of the same window (so ``1 <= d <= T - 2``; a window may span documents, joined by the
separator, exactly as the model read them). One ``(w, d)`` counts **once**, however many earlier
copies of the source it has.

**Attention** at an occurrence: the head's total attention from ``d`` to the source token,
``sum_{s < d, windows[w, s] == source} pattern[w, layer, head, d, s]`` (with one earlier copy, its
attention to it), from ``model.run_with_cache`` on the window, as the sweep ran it. ``attention``
is its mean over the triple's occurrences (``max_windows``: those in the first ``max_windows`` windows
holding an occurrence of any triple, ``measured`` of them); None for a triple never seen (or none measured).

**Cost**, counted on demand (the sweep records nothing for it): the counts are a few elementwise
passes over the windows per triple, ``CHUNK_WINDOWS`` windows at a time (bounded memory; one
``cumsum`` per distinct source); the attention is one forward (``logits=False``) of each window
holding an occurrence, ``batch_size`` windows at a time (the sweep's), and per batch one
``[b, T, T] @ [b, T, n_sources]`` product. At most one forward per swept window (``max_windows``: at
most that many), whatever the number of triples; a progress bar shows both passes. Measured
(``benchmarks/bench_trigram_counts.py``): 20 triples over 2,000 windows of 128 tokens on the shipped
2-layer model count in 0.4 s, and the attention pass costs the bare forward of the windows it runs. Kept per model and head (``analysis.cache``: a weight
edit recomputes), so a revisited head answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..analysis.cache import RESULT, cached, stored
from ..analysis.circuits import check_head
from ..progress import progress
from .arguments import check_positive
from .sweeps import Sweep, checked_sweep

CHUNK_WINDOWS = 4096
"""Windows counted at a time: a few ``[CHUNK_WINDOWS, T]`` masks per triple (4 MiB of bools at T=1024)."""


@dataclass(frozen=True)
class TrigramCounts:
    """Each triple's occurrences in a sweep's windows (module docstring), in the order given."""

    layer: int
    head: int
    source: torch.Tensor
    """int64 [n]: each triple's source token id."""
    destination: torch.Tensor
    """int64 [n]: destination token id."""
    out: torch.Tensor
    """int64 [n]: out token id (the token right after the destination)."""
    count: torch.Tensor
    """int64 [n]: number of occurrences ``(window, d)``, exact."""
    attention: tuple[float | None, ...]
    """[n]: the head's mean attention from destination to source over the measured occurrences; None
    where ``measured == 0`` (never seen in the corpus, or only in windows past ``max_windows``)."""
    measured: torch.Tensor
    """int64 [n]: the occurrences ``attention`` is the mean of (``count`` unless ``max_windows`` cut)."""
    windows: int
    """Windows counted (all of the sweep's)."""
    windows_run: int
    """Windows the model was run on for the attention (those holding an occurrence, at most ``max_windows``)."""
    windows_holding: int
    """Windows holding an occurrence of any triple."""


def check_triples(model, triples) -> torch.Tensor:
    """``triples`` (pairs of ``(source, destination, out)`` ids, or an int tensor ``[n, 3]``) as int64
    ``[n, 3]`` on the CPU; refused unless each id is in ``0..d_vocab - 1``."""
    if isinstance(triples, torch.Tensor):
        t = triples
    else:
        try:
            t = torch.tensor([list(row) for row in triples])
        except (TypeError, ValueError) as exc:
            raise TypeError("triples must be a list of (source, destination, out) token ids or an int tensor "
                            f"[n, 3], got {triples!r:.200}") from exc
    if t.numel() == 0:
        t = t.reshape(0, 3).long()
    if t.ndim != 2 or t.shape[1] != 3 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"triples must be (source, destination, out) token ids, [n, 3] ints; got {t.dtype} "
                        f"{list(t.shape)}")
    t = t.to("cpu", torch.long)
    V = model.cfg.d_vocab
    bad = ((t < 0) | (t >= V)).any(1).nonzero().flatten()
    if len(bad):
        rows = ", ".join(str(tuple(t[i].tolist())) for i in bad[:3])
        raise ValueError(f"triples hold token ids outside the vocabulary 0..{V - 1}: {rows}"
                         f"{' ...' if len(bad) > 3 else ''}")
    return t


def trigram_counts(sweep: Sweep, model, layer: int, head: int, triples, *, max_windows: int | None = None,
                   batch_size: int | None = None) -> TrigramCounts:
    """How often each of head ``(layer, head)``'s skip-trigrams ``triples`` (``(source, destination,
    out)`` ids, ``[n, 3]``) occurs in ``sweep.windows`` and the head's mean attention from destination to
    source there (module docstring: exact counts, one per destination position; cost). ``model`` must
    be the sweep's (its fingerprint). ``max_windows``: the attention is measured on the first that many
    windows holding an occurrence (default: all; the counts are always over every window).
    ``batch_size``: windows per forward (default: the sweep's)."""
    key, work = _checked(sweep, model, layer, head, triples, max_windows, batch_size)
    return cached(model, key, work, tier=RESULT)


def kept_trigram_counts(sweep: Sweep, model, layer: int, head: int, triples, *, max_windows: int | None = None,
                        batch_size: int | None = None) -> TrigramCounts | None:
    """``trigram_counts``' result if the cache holds it now, else None (for a caller that saves only what
    was counted)."""
    return stored(model, _checked(sweep, model, layer, head, triples, max_windows, batch_size)[0])


def _checked(sweep, model, layer, head, triples, max_windows, batch_size):
    """``(cache key, the count as a thunk)`` of checked arguments (``trigram_counts``)."""
    if sweep is None:
        raise TypeError("trigram_counts: sweep must be a pcw.Sweep (pcw.sweep(model, corpus, store)), got None")
    checked_sweep(sweep, model, "trigram_counts")
    layer, head = check_head(model, (layer, head))
    t = check_triples(model, triples)
    batch_size = sweep.settings["batch_size"] if batch_size is None else batch_size
    for name, value in (("batch_size", batch_size), ("max_windows", 1 if max_windows is None else max_windows)):
        check_positive(name, value)
    # key[1:3] is the head, as for every per-head entry of the cache
    key = ("trigram_counts", layer, head, str(sweep.path.resolve()), tuple(map(tuple, t.tolist())), max_windows,
           batch_size)
    return key, lambda: _count(sweep.windows, model, layer, head, t, max_windows, batch_size)


def _hits(W: torch.Tensor, t: torch.Tensor):
    """Per triple, the occurrence mask ``[n_windows, T]`` at destinations ``d`` of windows ``W [n_windows, T]``;
    yields ``(triple index, mask)``. ``seen[:, d]``: the source is at some ``s <= d``."""
    n, T = W.shape
    seen = {}
    for src in t[:, 0].unique().tolist():
        seen[src] = (W == src).cumsum(1, dtype=torch.int32) > 0
    for i, (src, dest, out) in enumerate(t.tolist()):
        mask = torch.zeros(n, T, dtype=torch.bool)
        if T >= 3:
            mask[:, 1:-1] = (W[:, 1:-1] == dest) & (W[:, 2:] == out) & seen[src][:, :-2]
        yield i, mask


def _count(windows: torch.Tensor, model, layer: int, head: int, t: torch.Tensor, max_windows: int | None,
           batch_size: int) -> TrigramCounts:
    N = len(windows)
    n = len(t)
    count = torch.zeros(n, dtype=torch.long)
    holds = torch.zeros(N, dtype=torch.bool)  # windows with an occurrence of any triple
    chunks = range(0, N, CHUNK_WINDOWS)
    with progress("trigram counts", total=N, unit="window") as bar:
        bar.note("counting")
        for start in chunks:
            W = windows[start:start + CHUNK_WINDOWS]
            for i, mask in _hits(W, t):
                count[i] += int(mask.sum())
                holds[start:start + len(W)] |= mask.any(1)
            bar.update(len(W))
    holding = holds.nonzero().flatten()
    run = holding[:max_windows]
    total = torch.zeros(n, dtype=torch.float64)
    measured = torch.zeros(n, dtype=torch.long)
    if len(run):
        sources, which = t[:, 0].unique(return_inverse=True)  # triple i reads source column which[i]
        with progress("trigram attention", total=len(run), unit="window") as bar, torch.inference_mode():
            bar.note(f"L{layer}.H{head} on the windows holding a triple")
            for start in range(0, len(run), batch_size):
                W = windows[run[start:start + batch_size]]
                _, cache = model.run_with_cache(W.to(model.device), logits=False)
                P = cache.patterns[:, layer, head].to("cpu", torch.float32)  # [b, dest, src], causal
                is_src = (W[:, :, None] == sources).float()  # [b, T, n_sources]
                # attention from each d to every copy of each source at s <= d, less s = d itself
                to_src = P @ is_src - P.diagonal(dim1=1, dim2=2)[:, :, None] * is_src
                for i, mask in _hits(W, t):
                    total[i] += to_src[:, :, which[i]][mask].double().sum()
                    measured[i] += int(mask.sum())
                bar.update(len(W))
    attention = tuple(float(total[i] / measured[i]) if measured[i] else None for i in range(n))
    return TrigramCounts(layer, head, t[:, 0].clone(), t[:, 1].clone(), t[:, 2].clone(), count, attention,
                         measured, N, len(run), len(holding))
