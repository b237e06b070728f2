"""The induction mechanism of one head pair: K-composition token circuit, positivities, verdict.

Paper ("Induction heads" in the two-layer section): a previous-token head ``h1`` writes "the
token before me was ``s``" into each position; an induction head ``h2`` reads it with its keys
(K-composition) and so attends from a token ``t`` to positions whose previous token is ``t``;
its OV circuit then copies the token it lands on. Two numbers carry that story:

* ``qk_positivity``: eigenvalue positivity ``sum(lambda) / sum(|lambda|)`` of the
  K-composition token circuit ``W_E W_QK^{h2} W_OV^{h1 T} W_E^T`` ``[dest token, token h1 moved]``
  (``composition_detail(model, "K", h1, h2).positivity``). Near +1: a query on ``t`` prefers keys
  where ``h1`` moved a ``t`` (matching); near -1: it avoids them.
* ``ov_positivity``: eigenvalue positivity of ``h2``'s full OV circuit ``W_E W_OV^{h2} W_U``
  (``eigenvalue_positivity(model, "OV")[l2, h2]``). Near +1: attending to a token raises its own logit (copying).

``classify_pair`` turns those two numbers, and nothing else, into one sentence with the
thresholds ``MATCH_THRESHOLD`` and ``COPY_THRESHOLD`` (both 0.5: at 0.5 the positive
eigenvalues carry three times the absolute mass of the negative ones).

Rotary models: ``h2``'s QK circuit depends on the offset between its query and the key position
``h1`` wrote to (``rotary``), so the K-composition term is read at one query - key offset: the one
given, or, over a window (default ``rotary.DEFAULT_OFFSETS``), the window's offset where its QK
positivity is largest (the offset at which ``h2`` matches best through ``h1``); every number of the
pair is at that offset (``InductionPair.offset``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..factored import chain_matmul, eigenvalues_of_product, linalg_dtype
from .circuits import Head, check_earlier, k_composition_circuit
from .composition import composition_detail, composition_scores
from .eigen import eigenvalue_positivity, positivity, token_gram
from .finite import naming_non_finite, require_finite
from .pieces import drained
from .rotary import offset_window, reduce_offsets, rotations

MATCH_THRESHOLD = 0.5
"""K-composition QK positivity at or above which the pair "matches" (attends to positions where
``h1`` moved the current token); at or below ``-MATCH_THRESHOLD`` it avoids them."""
COPY_THRESHOLD = 0.5
"""OV positivity of ``h2`` at or above which ``h2`` copies; at or below ``-COPY_THRESHOLD`` it suppresses."""


def head_name(head: Head) -> str:
    """A head written the one way the views write it: ``L1.H6``."""
    return f"L{head[0]}.H{head[1]}"


def classify_pair(h1: Head, h2: Head, qk_positivity: float, ov_positivity: float) -> tuple[str, str]:
    """``(kind, sentence)`` for the pair from its two positivities (module docstring).

    ``kind`` is ``"induction"`` (matches and copies), ``"match-only"`` (matches, no copying),
    ``"anti-induction"`` (matches and suppresses), ``"avoid"`` (avoids tokens ``h1`` moved) or
    ``"none"`` (no consistent token matching through ``h1``). Thresholds: ``MATCH_THRESHOLD``,
    ``COPY_THRESHOLD``.
    """
    a, b = head_name(h1), head_name(h2)
    qk = f"K-composition QK positivity {qk_positivity:+.2f}"
    ov = f"{b} OV positivity {ov_positivity:+.2f}"
    if qk_positivity >= MATCH_THRESHOLD:
        match = f"{b} attends to positions where {a} moved in the current token ({qk} ≥ {MATCH_THRESHOLD})"
        if ov_positivity >= COPY_THRESHOLD:
            return "induction", f"{match}, then copies the token it lands on ({ov} ≥ {COPY_THRESHOLD}): an induction pair."
        if ov_positivity <= -COPY_THRESHOLD:
            return "anti-induction", (f"{match}, then suppresses the token it lands on ({ov} ≤ {-COPY_THRESHOLD}): "
                                      "an anti-induction pair.")
        return "match-only", (f"{match}, but does not clearly copy ({ov}, |·| < {COPY_THRESHOLD}): "
                              "token matching without copying.")
    if qk_positivity <= -MATCH_THRESHOLD:
        return "avoid", (f"{b} avoids positions where {a} moved in the current token ({qk} ≤ {-MATCH_THRESHOLD}); "
                         f"{ov}: not an induction pair.")
    return "none", (f"{b} shows no consistent token matching through {a} ({qk}, |·| < {MATCH_THRESHOLD}); "
                    f"{ov}: not an induction pair.")


@dataclass(frozen=True)
class InductionPair:
    """The induction-mechanism numbers of one pair ``h1 -> h2`` (see ``induction_pair``).

    ``top_values/top_dest/top_src [k]``: the largest entries of the row-centred K-composition
    token circuit (``k_composition_top``); ``diagonal_rank``: ``k_composition_diagonal_rank``.
    """

    h1: Head
    h2: Head
    k_score: float
    k_baseline: float
    qk_positivity: float
    ov_positivity: float
    top_values: torch.Tensor
    top_dest: torch.Tensor
    top_src: torch.Tensor
    diagonal_rank: float
    kind: str
    sentence: str
    offset: int | None = None
    """Rotary models: the query - key offset every number above is read at (None otherwise)."""


@torch.no_grad()
def k_composition_top(model, h1: Head, h2: Head, k: int = 20, offset=None):
    """Top ``k`` entries of the row-centred K-composition token circuit ``[dest token, src token]``.

    ``M = W_E W_Q^{h2} (W_E W_V^{h1} W_O^{h1} W_K^{h2})^T`` (``k_composition_circuit``), each row
    minus its mean over source tokens (the softmax over keys ignores a per-query shift): entry
    ``[t, s]`` is how much more than average a query on ``t`` attends, through ``h2``'s keys, to a
    position where ``h1`` moved a token ``s``. Returns ``(values [k], dest [k], src [k])``, best
    first; never forms the ``d_vocab x d_vocab`` matrix (``FactoredMatrix.topk`` in row blocks).
    Rotary: at ``offset`` (``k_composition_circuit``).
    """
    circuit = k_composition_circuit(model, h1, h2, offset)
    key = circuit.B.float()  # [d_head, d_vocab]
    centred = type(circuit)(circuit.A.float(), key - key.mean(1, keepdim=True))
    values, dest, src = centred.topk(k)
    # an overflowing (inf) or NaN entry ranks first, so checking the top-k covers the circuit
    require_finite(values, "the K-composition token circuit's entries", model, ("W_E", "W_Q", "W_K", "W_V", "W_O"))
    return values, dest, src


@torch.no_grad()
def k_composition_diagonal_rank(model, h1: Head, h2: Head, block_rows: int = 4096, offset=None) -> float:
    """Mean over destination tokens ``t`` of the fraction of source tokens ``s`` with ``M[t, s] < M[t, t]``
    in the K-composition token circuit ``M`` (``k_composition_circuit``): how far up its own row the
    same token ranks (1: always first, 0.5: chance). Near 1 means a query on ``t`` prefers keys where
    ``h1`` moved another ``t`` over almost any other token. Row shifts do not change it. Computed in row
    blocks of ``block_rows`` (``[block_rows, d_vocab]`` floats at a time). Rotary: at ``offset``.
    """
    circuit = k_composition_circuit(model, h1, h2, offset)
    A, B = circuit.A.float(), circuit.B.float()
    V = A.shape[0]
    below = 0
    with torch.no_grad():
        for start in range(0, V, block_rows):
            block = A[start:start + block_rows] @ B  # [rows, V]
            rows = torch.arange(start, start + block.shape[0], device=block.device)
            diagonal = block[rows - start, rows]
            # one count for the block (an exact integer): 3x faster than a sum per row
            below += int(torch.count_nonzero(block < diagonal[:, None]))
    return below / (V * (V - 1))


def k_composition_positivity(model, offset=None, reduce: str = "max") -> torch.Tensor:
    """Eigenvalue positivity of every pair's K-composition token circuit: float32 ``[L, H, L, H]``
    indexed ``[l1, h1, l2, h2]``, NaN where ``l1 >= l2``.

    ``W_E W_Q^{h2} W_K^{h2 T} W_O^{h1 T} W_V^{h1 T} W_E^T`` has the nonzero spectrum of a
    ``d_head x d_head`` product (the vocab-sized part is the shared ``W_E^T W_E``); one batched
    ``eig`` per later layer. Equals ``composition_detail(model, "K", h1, h2).positivity``.
    Rotary: ``W_Q^{h2} R(offset)`` at an int ``offset``, or over a window (default
    ``rotary.DEFAULT_OFFSETS``) reduced per pair by ``reduce`` ("max", see
    ``k_composition_positivity_offsets`` for where, or "mean").
    """
    return k_composition_positivity_offsets(model, offset, reduce)[0]


def k_composition_positivity_offsets(model, offset=None, reduce: str = "max"):
    """``(positivity [L, H, L, H], offset [L, H, L, H] or None)``: ``k_composition_positivity`` and, for a
    rotary model reduced by "max" over a window, the offset of each pair's value (-1 where undefined)."""
    return drained(k_composition_positivity_steps(model, offset, reduce))


def k_composition_positivity_steps(model, offset=None, reduce: str = "max"):
    """``k_composition_positivity_offsets`` in pieces: a generator that yields ``(done, total)``
    after each piece (one offset's one layer pair ``(l1, l2)``: one batched ``[H, H]`` eig, all
    pieces the same size) and returns its result (``StopIteration.value``), so a caller can stop
    between pieces."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    offsets = offset_window(model, offset, "the K-composition QK circuit")
    R = [None] if offsets is None else rotations(cfg, offsets, device=model.W_Q.device, layer=None)  # [n, L, ...]
    out = torch.full((len(R), L, H, L, H), float("nan"), device=model.W_Q.device)
    layer_pairs = [(l1, l2) for l1 in range(L - 1) for l2 in range(l1 + 1, L)]
    total = len(R) * len(layer_pairs)
    with torch.no_grad():
        G = token_gram(model, "QK")
        W_Q, W_K, W_V, W_O = (w.double() for w in (model.W_Q, model.W_K, model.W_V, model.W_O))
    refusal = ("the K-composition token circuits' eigenvalues", model, ("W_E", "W_Q", "W_K", "W_V", "W_O"),
               linalg_dtype(model.W_E.dtype))  # G's dtype
    done = 0
    for i, rot in enumerate(R):
        for l1, l2 in layer_pairs:
            with torch.no_grad():
                query = W_Q[l2] if rot is None else W_Q[l2] @ rot[l2]
                # [H1, H2] broadcast: chain W_Q^{h2} W_K^{h2 T} W_O^{h1 T} W_V^{h1 T} G
                with naming_non_finite(*refusal):
                    eigs = eigenvalues_of_product(query[None], W_K[l2].mT[None], W_O[l1].mT[:, None],
                                                  W_V[l1].mT[:, None], G)
                out[i, l1, :, l2] = positivity(require_finite(eigs, *refusal)).float()
            done += 1
            yield done, total
    if offsets is None or (offset is not None and not hasattr(offset, "__iter__")):
        return out[0], None
    values, at = reduce_offsets(out, offsets, reduce)
    return values, None if at is None else at.masked_fill(values.isnan(), -1)


@dataclass
class PairVerdict:
    """One pair's numbers and verdict (``pair_verdicts``): its K-composition score (no baseline),
    the two positivities and ``classify_pair``'s kind and sentence; rotary models: the query - key
    ``offset`` all of them are read at (the sentence says so), else None."""

    k_score: float
    qk_positivity: float
    ov_positivity: float
    kind: str
    sentence: str
    offset: int | None = None


EIGS_PER_PIECE = 128
"""About how many ``d_head x d_head`` eigenproblems one piece of ``pair_verdicts_steps`` solves (a
few hundredths of a second): ``EIGS_PER_PIECE // n_offsets`` head pairs a piece, at least one."""


def pair_verdicts(model, offsets=None) -> dict[tuple[int, int, int, int], PairVerdict]:
    """The verdict of every pair ``(l1, h1, l2, h2)`` with ``l1 < l2``, in ``(l1, h1, l2, h2)`` order:
    ``k_composition_positivity`` ``[L, H, L, H]``, ``h2``'s OV positivity (``eigenvalue_positivity``
    ``[L, H]``) and the K-composition score ``composition_scores(model, "K", baseline=False)``, each
    pair through ``classify_pair``. Rotary models: over the window ``offsets`` (None: not rotary),
    each pair's positivity at the offset where it is largest, and its score at that same offset."""
    return drained(pair_verdicts_steps(model, offsets))


def pair_verdicts_steps(model, offsets=None, into: dict | None = None):
    """``pair_verdicts`` in pieces, strongest pairs first: yields ``(stage, done, total)`` after each
    piece and returns the verdicts (in ``(l1, h1, l2, h2)`` order). Stage "positivity" counts head pairs.

    Stage "scores" (2 pieces): h2's OV positivity, then every pair's K-composition score (each one
    batched call; rotary: at every offset of the window). Stage "positivity": the pairs' K-composition
    QK positivities in pieces of ``EIGS_PER_PIECE // n_offsets`` head pairs (at least one, with all its
    offsets), in order of their largest K-composition score, so the pairs most likely to matter get
    their verdicts first (at SmolLM2-135M's shape and a 100-token window, all of them take about an
    hour at 2 threads; the strongest, seconds). Each finished verdict is put in ``into`` (a dict the
    caller reads between pieces to show what is done); a pair already in it is not computed again
    (a restart after a cancel resumes). Every number equals ``pair_verdicts``' whatever the order: one
    pair's positivity over its offsets is ``eig(P R(o))``, ``P = W_K^T W_O^{h1 T} W_V^{h1 T} (W_E^T W_E)
    W_Q`` (the chain of ``k_composition_positivity`` rotated cyclically: the same spectrum)."""
    into = {} if into is None else into
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    window = offset_window(model, offsets, "the K-composition QK circuit")
    with torch.no_grad():  # (never across a yield: grad mode is the consumer's thread's)
        ov_pos = eigenvalue_positivity(model, "OV")
    yield "scores", 1, 2
    with torch.no_grad():
        scores = composition_scores(model, "K", baseline=False, offsets=window)  # rotary: [n_offsets, L, H, L, H]
    yield "scores", 2, 2
    strongest = scores if window is None else scores.nan_to_num(float("-inf")).amax(0)
    pairs = [(l1, h1, l2, h2) for l1 in range(L - 1) for h1 in range(H) for l2 in range(l1 + 1, L) for h2 in range(H)]
    rank = torch.stack([strongest[p] for p in pairs]) if pairs else torch.zeros(0)
    order = [pairs[i] for i in torch.argsort(rank.nan_to_num(float("-inf")), descending=True, stable=True).tolist()]
    todo = [p for p in order if p not in into]
    per_piece = max(1, EIGS_PER_PIECE // (1 if window is None else len(window)))
    with torch.no_grad():
        G = token_gram(model, "QK")
        W_Q, W_K, W_V, W_O = (w.double() for w in (model.W_Q, model.W_K, model.W_V, model.W_O))
        R = None if window is None else rotations(cfg, window, device=W_Q.device, layer=None)  # [n, L, d_head, d_head]
    refusal = ("the K-composition token circuits' eigenvalues", model, ("W_E", "W_Q", "W_K", "W_V", "W_O"),
               linalg_dtype(model.W_E.dtype))  # G's dtype
    for start in range(0, len(todo), per_piece):
        piece = todo[start:start + per_piece]
        l1, h1, l2, h2 = (torch.as_tensor(i) for i in zip(*piece))
        with torch.no_grad(), naming_non_finite(*refusal):
            P = chain_matmul(W_K[l2, h2].mT, W_O[l1, h1].mT, W_V[l1, h1].mT, G, W_Q[l2, h2])  # [n, d_head, d_head]
            eigs = eigenvalues_of_product(P) if R is None else eigenvalues_of_product(P[:, None], R[:, l2].transpose(0, 1))
            qk_pos = positivity(require_finite(eigs, *refusal)).float()  # [n] or [n, n_offsets]
        for i, (a, b, c, d) in enumerate(piece):
            if R is None:
                q, offset, score = float(qk_pos[i]), None, scores[a, b, c, d]
            else:
                best = int(qk_pos[i].argmax())  # the first offset of the largest (as reduce_offsets)
                q, offset, score = float(qk_pos[i, best]), window[best], scores[best, a, b, c, d]
            o = float(ov_pos[c, d])
            kind, sentence = classify_pair((a, b), (c, d), q, o)
            if offset is not None:
                sentence = f"At query - key offset {offset}: {sentence}"
            into[a, b, c, d] = PairVerdict(float(score), q, o, kind, sentence, offset)
        yield "positivity", start + len(piece), len(todo)  # counted in head pairs
    return {p: into[p] for p in pairs}


def induction_pair(model, h1: Head, h2: Head, k: int = 20, ov_positivity: torch.Tensor | None = None,
                   offset=None) -> InductionPair:
    """K-composition table, positivities and verdict of ``h1 -> h2`` (module docstring).

    ``ov_positivity [L, H]`` may be passed to reuse ``eigenvalue_positivity(model, "OV")``.
    Rotary models: at query - key ``offset`` (an int, or a window whose offset with the largest
    K-composition QK positivity is used; default ``rotary.DEFAULT_OFFSETS``). Refuses pairs not in
    increasing layers.
    """
    h1, h2 = check_earlier(model, h1, h2)
    with torch.no_grad():
        best = best_offset(model, h1, h2, offset)
        detail = composition_detail(model, "K", h1, h2, best)
        if ov_positivity is None:
            ov_positivity = eigenvalue_positivity(model, "OV")
        values, dest, src = k_composition_top(model, h1, h2, k, best)
        diagonal_rank = k_composition_diagonal_rank(model, h1, h2, offset=best)
    ov_pos = float(ov_positivity[h2])
    kind, sentence = classify_pair(h1, h2, detail.positivity, ov_pos)
    return InductionPair(
        h1=h1, h2=h2, k_score=detail.score, k_baseline=detail.baseline, qk_positivity=detail.positivity,
        ov_positivity=ov_pos, top_values=values, top_dest=dest, top_src=src, diagonal_rank=diagonal_rank, kind=kind,
        sentence=sentence, offset=best,
    )


def best_offset(model, h1: Head, h2: Head, offset=None) -> int | None:
    """The one query - key offset a rotary pair is read at (module docstring); None when not rotary."""
    offsets = offset_window(model, offset, "the K-composition QK circuit")
    if offsets is None or len(offsets) == 1:
        return None if offsets is None else offsets[0]
    (l1, i1), (l2, i2) = h1, h2
    G = token_gram(model, "QK")
    W_Q, W_K, W_V, W_O = (w.double() for w in (model.W_Q[l2, i2], model.W_K[l2, i2], model.W_V[l1, i1], model.W_O[l1, i1]))
    with naming_non_finite(f"the K-composition token circuit of {h1} -> {h2} over its offsets", model,
                           ("W_E", "W_Q", "W_K", "W_V", "W_O"), linalg_dtype(model.W_E.dtype)):
        eigs = eigenvalues_of_product(W_Q @ rotations(model.cfg, offsets, layer=l2), W_K.mT, W_O.mT, W_V.mT, G)
    return offsets[int(positivity(eigs).argmax())]
