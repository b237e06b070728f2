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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..factored import eigenvalues_of_product, linalg_dtype
from .circuits import Head, check_earlier, k_composition_circuit, refuse_rotary_qk
from .composition import composition_detail
from .eigen import eigenvalue_positivity, positivity, token_gram
from .finite import require_finite

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


def k_composition_top(model, h1: Head, h2: Head, k: int = 20):
    """Top ``k`` entries of the row-centred K-composition token circuit ``[dest token, src token]``.

    ``M = W_E W_Q^{h2} (W_E W_V^{h1} W_O^{h1} W_K^{h2})^T`` (``k_composition_circuit``), each row
    minus its mean over source tokens (the softmax over keys ignores a per-query shift): entry
    ``[t, s]`` is how much more than average a query on ``t`` attends, through ``h2``'s keys, to a
    position where ``h1`` moved a token ``s``. Returns ``(values [k], dest [k], src [k])``, best
    first; never forms the ``d_vocab x d_vocab`` matrix (``FactoredMatrix.topk`` in row blocks).
    """
    circuit = k_composition_circuit(model, h1, h2)
    key = circuit.B.float()  # [d_head, d_vocab]
    centred = type(circuit)(circuit.A.float(), key - key.mean(1, keepdim=True))
    values, dest, src = centred.topk(k)
    # an overflowing (inf) or NaN entry ranks first, so checking the top-k covers the circuit
    require_finite(values, "the K-composition token circuit's entries", model, ("W_E", "W_Q", "W_K", "W_V", "W_O"))
    return values, dest, src


def k_composition_diagonal_rank(model, h1: Head, h2: Head, block_rows: int = 4096) -> float:
    """Mean over destination tokens ``t`` of the fraction of source tokens ``s`` with ``M[t, s] < M[t, t]``
    in the K-composition token circuit ``M`` (``k_composition_circuit``): how far up its own row the
    same token ranks (1: always first, 0.5: chance). Near 1 means a query on ``t`` prefers keys where
    ``h1`` moved another ``t`` over almost any other token. Row shifts do not change it. Computed in row
    blocks of ``block_rows`` (``[block_rows, d_vocab]`` floats at a time).
    """
    circuit = k_composition_circuit(model, h1, h2)
    A, B = circuit.A.float(), circuit.B.float()
    V = A.shape[0]
    below = 0.0
    with torch.no_grad():
        for start in range(0, V, block_rows):
            block = A[start:start + block_rows] @ B  # [rows, V]
            rows = torch.arange(start, start + block.shape[0], device=block.device)
            diagonal = block[rows - start, rows]
            below += float((block < diagonal[:, None]).sum(1).double().sum())
    return below / (V * (V - 1))


def k_composition_positivity(model) -> torch.Tensor:
    """Eigenvalue positivity of every pair's K-composition token circuit: float32 ``[L, H, L, H]``
    indexed ``[l1, h1, l2, h2]``, NaN where ``l1 >= l2``.

    ``W_E W_Q^{h2} W_K^{h2 T} W_O^{h1 T} W_V^{h1 T} W_E^T`` has the nonzero spectrum of a
    ``d_head x d_head`` product (the vocab-sized part is the shared ``W_E^T W_E``); one batched
    ``eig`` per later layer. Equals ``composition_detail(model, "K", h1, h2).positivity``.
    """
    refuse_rotary_qk(model, "the K-composition QK circuit")
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    out = torch.full((L, H, L, H), float("nan"), device=model.W_Q.device)
    with torch.no_grad():
        G = token_gram(model, "QK")
        W_Q, W_K, W_V, W_O = (w.double() for w in (model.W_Q, model.W_K, model.W_V, model.W_O))
        for l1 in range(L - 1):
            for l2 in range(l1 + 1, L):
                # [H1, H2] broadcast: chain W_Q^{h2} W_K^{h2 T} W_O^{h1 T} W_V^{h1 T} G
                eigs = eigenvalues_of_product(W_Q[l2][None], W_K[l2].mT[None], W_O[l1].mT[:, None],
                                              W_V[l1].mT[:, None], G)
                require_finite(eigs, "the K-composition token circuits' eigenvalues", model,
                               ("W_E", "W_Q", "W_K", "W_V", "W_O"), linalg_dtype(model.W_E.dtype))  # G's
                out[l1, :, l2] = positivity(eigs).float()
    return out


def induction_pair(model, h1: Head, h2: Head, k: int = 20, ov_positivity: torch.Tensor | None = None) -> InductionPair:
    """K-composition table, positivities and verdict of ``h1 -> h2`` (module docstring).

    ``ov_positivity [L, H]`` may be passed to reuse ``eigenvalue_positivity(model, "OV")``.
    Refuses rotary models (no token x token QK circuit) and pairs not in increasing layers.
    """
    h1, h2 = check_earlier(model, h1, h2)
    with torch.no_grad():
        detail = composition_detail(model, "K", h1, h2)
        if ov_positivity is None:
            ov_positivity = eigenvalue_positivity(model, "OV")
        values, dest, src = k_composition_top(model, h1, h2, k)
        diagonal_rank = k_composition_diagonal_rank(model, h1, h2)
    ov_pos = float(ov_positivity[h2])
    kind, sentence = classify_pair(h1, h2, detail.positivity, ov_pos)
    return InductionPair(
        h1=h1, h2=h2, k_score=detail.score, k_baseline=detail.baseline, qk_positivity=detail.positivity,
        ov_positivity=ov_pos, top_values=values, top_dest=dest, top_src=src, diagonal_rank=diagonal_rank, kind=kind, sentence=sentence,
    )
