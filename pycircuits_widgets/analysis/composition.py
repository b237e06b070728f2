"""Q-, K- and V-composition scores between heads in different layers.

Paper (column convention), ``h1`` earlier than ``h2``: Q: ``||W_QK^{h2 T} W_OV^{h1}||_F``,
K: ``||W_QK^{h2} W_OV^{h1}||_F``, V: ``||W_OV^{h2} W_OV^{h1}||_F``, each divided by
``||W_QK or W_OV of h2||_F ||W_OV^{h1}||_F``. In the row convention (``W_OV = W_V W_O``,
``W_QK = W_Q W_K^T``; ``x @ W``) the composed matrices are the transposes:

* Q: ``W_OV^{h1} W_QK^{h2}``   (h1 writes what h2's queries read),
* K: ``W_OV^{h1} W_QK^{h2 T}`` (h1 writes what h2's keys read; equal norm to ``W_QK^{h2} W_OV^{h1 T}``),
* V: ``W_OV^{h1} W_OV^{h2}``   (h1 writes what h2's values read),

the same four-factor pattern ``A1 B1 C2 D2`` with ``A1 = W_V^{h1} [d_model, d_head]``,
``B1 = W_O^{h1}`` and ``(C2, D2) = (W_Q, W_K^T)``, ``(W_K, W_Q^T)`` or ``(W_V, W_O)`` of ``h2``.
This matches TransformerLens's ``all_composition_scores`` (tested on identical weights).

Speed: with ``A1 = Q R_A1`` and ``D2^T = Q R_D2`` (thin QR), ``||A1 B1 C2 D2||_F =
||(R_A1 B1)(C2 R_D2^T)||_F``: one ``[H d_head, d_model] @ [d_model, H' d_head]`` GEMM per
earlier layer scores every pair at once, then block-wise sums of squares. No ``d_model^2``
matrix per pair is ever formed.

The published erratum: the original diagram computed a cyclic permutation of the product,
which preserves the trace but NOT the Frobenius norm. The errata names two such rotations, both
``d_head x d_head`` products; with the paper's (column-convention) product ``X1 X2 X3 X4``
(K: ``W_Q^T W_K W_O W_V``; Q: ``W_K^T W_Q W_O W_V``; V: ``W_O^{h2} W_V^{h2} W_O^{h1} W_V^{h1}``):

* ``norm="erratum_left"``: ``||X2 X3 X4 X1||``, the first factor moved to the end
  (K: ``||W_K W_O W_V W_Q^T||``); row convention ``||D2 A1 B1 C2||``;
* ``norm="erratum_right"``: ``||X4 X1 X2 X3||``, the last factor moved to the front
  (K: ``||W_V W_Q^T W_K W_O||``); row convention ``||B1 C2 D2 A1||``.

Both are divided by the same rotation applied to each head's own pair of factors, which is the
``d_head``-side norm ``||B1 A1|| ||D2 C2||`` (paper: ``||W_V W_O^{h1}|| ||W_K W_Q^T||`` for K); the
errata does not state the denominators, so these are our reconstruction. They reproduce the
mistake for comparison only.

Output layout ``[l1, h1, l2, h2]``; entries with ``l1 >= l2`` are NaN (no composition is
possible there; NaN rather than TransformerLens's 0 so a heatmap and a subtracted baseline
cannot mistake "undefined" for "no composition").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..factored import FactoredMatrix, eigenvalues_of_product, frobenius_norm_of_product
from .circuits import Head, check_earlier
from .eigen import positivity, token_gram

KINDS = ("Q", "K", "V")
NORMS = ("correct", "erratum_left", "erratum_right")
BASELINE_SAMPLES = 256
BASELINE_SEED = 0


def _check(kind: str, norm: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if norm == "erratum":
        raise ValueError('norm="erratum" is ambiguous: the errata names two wrong forms; pass "erratum_left" '
                         '(||X2 X3 X4 X1||, first factor of the paper\'s product moved to the end) or "erratum_right" '
                         '(||X4 X1 X2 X3||, last factor moved to the front)')
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


def _factors(W_Q, W_K, W_V, W_O, kind: str):
    """``(A1, B1, C2, D2)`` with the composed matrix ``A1 B1 C2 D2`` (any leading dims)."""
    if kind == "Q":
        return W_V, W_O, W_Q, W_K.mT
    if kind == "K":
        return W_V, W_O, W_K, W_Q.mT
    return W_V, W_O, W_V, W_O


def _r_factor(X: torch.Tensor) -> torch.Tensor:
    """``R`` of the thin QR ``X = Q R``, ``X [..., m, k]`` -> ``[..., min(m, k), k]``."""
    return torch.linalg.qr(X, mode="r").R


def _correct_scores(A1, B1, C2, D2) -> torch.Tensor:
    """All-pairs correct scores ``[L, H, L, H]`` (NaN where ``l1 >= l2``); inputs ``[L, H, ...]``."""
    L, H = A1.shape[:2]
    left = _r_factor(A1) @ B1  # [L, H, r, d_model]:  ||left|| = ||W_OV^{h1}||
    right = C2 @ _r_factor(D2.mT).mT  # [L, H, d_model, r]: ||right|| = ||C2 D2||
    r1, r2 = left.shape[-2], right.shape[-1]
    left_norm = left.square().sum((-2, -1)).sqrt()
    right_norm = right.square().sum((-2, -1)).sqrt()
    out = torch.full((L, H, L, H), float("nan"), dtype=A1.dtype, device=A1.device)
    for l1 in range(L - 1):
        later = L - l1 - 1
        rows = left[l1].reshape(H * r1, -1)
        cols = right[l1 + 1 :].permute(2, 0, 1, 3).reshape(-1, later * H * r2)
        block = (rows @ cols).reshape(H, r1, later, H, r2)
        out[l1, :, l1 + 1 :] = block.square().sum((1, 4)).sqrt()
    return out / (left_norm[:, :, None, None] * right_norm[None, None])


def _erratum_scores(A1, B1, C2, D2, norm: str) -> torch.Tensor:
    """All-pairs erratum scores, layout as above: ``||D2 A1 B1 C2||`` ("erratum_left") or
    ``||B1 C2 D2 A1||`` ("erratum_right"), over ``||B1 A1|| ||D2 C2||``."""
    L, H = A1.shape[:2]
    k1, k2 = A1.shape[-1], D2.shape[-2]
    out = torch.full((L, H, L, H), float("nan"), dtype=A1.dtype, device=A1.device)
    for l1 in range(L - 1):
        later = L - l1 - 1
        # X[g2, h1] = D2 A1 and Y[h1, g2] = B1 C2, every pair from two GEMMs
        X = (D2[l1 + 1 :].reshape(-1, D2.shape[-1]) @ A1[l1].permute(1, 0, 2).reshape(A1.shape[-2], -1))
        Y = (B1[l1].reshape(H * k1, -1) @ C2[l1 + 1 :].permute(2, 0, 1, 3).reshape(C2.shape[-2], -1))
        X = X.reshape(later * H, k2, H, k1)
        Y = Y.reshape(H, k1, later * H, C2.shape[-1])
        # left: (D2 A1)(B1 C2) [k2, k2]; right: (B1 C2)(D2 A1) [k1, k1]
        Z = torch.einsum("gahb,hbgc->hgac" if norm == "erratum_left" else "hbgc,gchd->hgbd", *(
            (X, Y) if norm == "erratum_left" else (Y, X)))
        out[l1, :, l1 + 1 :] = Z.square().sum((-2, -1)).sqrt().reshape(H, later, H)
    n1 = torch.linalg.matrix_norm(B1 @ A1)
    n2 = torch.linalg.matrix_norm(D2 @ C2)
    return out / (n1[:, :, None, None] * n2[None, None])


def _pair_scores(A1, B1, C2, D2, norm: str) -> torch.Tensor:
    """One score per (h1, h2) pair for inputs with the same leading dims (no masking)."""
    if norm == "correct":
        num = frobenius_norm_of_product(A1, B1, C2, D2)
        return num / (frobenius_norm_of_product(A1, B1) * frobenius_norm_of_product(C2, D2))
    X, Y = D2 @ A1, B1 @ C2
    num = torch.linalg.matrix_norm(X @ Y if norm == "erratum_left" else Y @ X)
    return num / (torch.linalg.matrix_norm(B1 @ A1) * torch.linalg.matrix_norm(D2 @ C2))


@functools.lru_cache(maxsize=32)
def random_baseline(d_model: int, d_head: int, norm: str = "correct",
                    n_samples: int = BASELINE_SAMPLES, seed: int = BASELINE_SEED) -> float:
    """Expected composition score of random matrices with a head's shapes.

    Monte Carlo with a fixed seed: ``n_samples`` pairs of heads with i.i.d. Gaussian
    ``W_V, W_Q, W_K [d_model, d_head]`` and ``W_O [d_head, d_model]`` (the score is scale
    invariant, so the variance does not matter). Q, K and V share this value: their four
    factors have the same shapes and distribution. Standard error with the default 256
    samples: 0.08% of the value at GPT-2 shapes (0.036), 1.2% at d_model 32, d_head 4.
    Computed in float64, cached per shape.
    """
    _check("V", norm)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(d_model, d_head), (d_head, d_model)] * 2
    A1, B1, C2, D2 = (torch.randn(n_samples, *s, generator=gen, dtype=torch.float64) for s in shapes)
    return float(_pair_scores(A1, B1, C2, D2, norm).mean())


def composition_scores(model, kind: str, baseline: bool = True, norm: str = "correct") -> torch.Tensor:
    """Every head pair's ``kind``-composition score: ``[L, H, L, H]`` indexed ``[l1, h1, l2, h2]``.

    Q: ``||W_OV^{h1} W_QK^{h2}||_F``, K: ``||W_OV^{h1} W_QK^{h2 T}||_F``, V: ``||W_OV^{h1} W_OV^{h2}||_F``
    (row convention, see module docstring), each over ``||W_OV^{h1}||_F ||W_{QK|OV}^{h2}||_F``.
    ``baseline=True`` subtracts ``random_baseline`` (the score random matrices of the same
    shapes get), as the paper does; ``baseline=False`` equals TransformerLens's
    ``all_composition_scores`` on the defined entries. ``norm="erratum_left"`` / ``"erratum_right"``
    give the two cyclic-permutation scores the errata names (wrong; for comparison only; the
    module docstring says exactly what each computes).
    Entries with ``l1 >= l2`` are NaN. Float32 (computed in the weights' dtype).
    """
    _check(kind, norm)
    factors = _factors(model.W_Q, model.W_K, model.W_V, model.W_O, kind)
    scores = _correct_scores(*factors) if norm == "correct" else _erratum_scores(*factors, norm)
    if baseline:
        scores = scores - random_baseline(model.cfg.d_model, model.cfg.d_head, norm)
    return scores


@dataclass(frozen=True)
class CompositionDetail:
    """One head pair's composition, for a detail view.

    ``score`` and ``erratum_scores`` (``{"erratum_left": float, "erratum_right": float}``, see the
    module docstring) are without baseline (``baseline`` is the random-matrix value of ``score``);
    ``singular_values [r]`` of the composed ``[d_model, d_model]`` matrix (descending);
    ``eigenvalues [r]`` (complex) and ``positivity`` of the composed *token* circuit:
    Q: ``W_E W_OV^{h1} W_QK^{h2} W_E^T`` ``[token h1 moved (query side), src token]``;
    K: ``W_E W_QK^{h2} W_OV^{h1 T} W_E^T`` ``[dest token, token h1 moved (key side)]``;
    V: ``W_E W_OV^{h1} W_OV^{h2} W_U`` ``[src token, out token]``.
    """

    kind: str
    h1: Head
    h2: Head
    score: float
    erratum_scores: dict[str, float]
    baseline: float
    singular_values: torch.Tensor
    eigenvalues: torch.Tensor
    positivity: float


def composition_detail(model, kind: str, h1: Head, h2: Head) -> CompositionDetail:
    """Score, erratum scores, singular values and token-circuit positivity of one pair ``h1 -> h2``."""
    _check(kind, "correct")
    (l1, i1), (l2, i2) = check_earlier(model, h1, h2)
    _, _, C2, D2 = _factors(model.W_Q[l2, i2], model.W_K[l2, i2], model.W_V[l2, i2], model.W_O[l2, i2], kind)
    A1, B1 = model.W_V[l1, i1], model.W_O[l1, i1]
    composed = FactoredMatrix(A1, B1) @ FactoredMatrix(C2, D2)
    _, S, _ = composed.svd()
    if kind == "V":
        eigs = eigenvalues_of_product(*[x.double() for x in (A1, B1, C2, D2)], token_gram(model, "OV"))
    else:
        # token circuit W_E M W_E^T with M = A1 B1 C2 D2 (Q) or its transpose (K)
        chain = (A1, B1, C2, D2) if kind == "Q" else (D2.mT, C2.mT, B1.mT, A1.mT)
        eigs = eigenvalues_of_product(*[x.double() for x in chain], token_gram(model, "QK"))
    score = float(_pair_scores(A1, B1, C2, D2, "correct"))
    erratum = {norm: float(_pair_scores(A1, B1, C2, D2, norm)) for norm in NORMS[1:]}
    return CompositionDetail(
        kind=kind, h1=(l1, i1), h2=(l2, i2), score=score, erratum_scores=erratum,
        baseline=random_baseline(model.cfg.d_model, model.cfg.d_head),
        singular_values=S, eigenvalues=eigs, positivity=float(positivity(eigs)),
    )
