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
Layer norm: its output is mean-zero, so what a head reads or writes along the all-ones
direction never reaches another head; those components are removed before scoring
(``_layer_factors``), which equals TransformerLens's scores on its folded (centred) weights.

Speed (``_correct_scores``): each head becomes one thin factor per side, ``X, Y [d_model, r]``
with ``||A1 B1 C2 D2||_F = ||X1^T Y2||_F``; every pair's square is then the inner product of
two ``d_model x d_model`` Grams, ``<X1 X1^T, Y2 Y2^T>``, taken tile by tile as GEMMs over all
heads at once: ``d_model^2`` FLOPs per pair instead of ``2 r^2 d_model`` for ``X1^T Y2``
(at GPT-2-XL shapes about 2.4 instead of 9.3 TFLOP). Float32 error bound and exact fallback:
``_correct_scores``. No ``d_model^2`` matrix per pair is ever formed.

Rotary models: Q/K-composition is scored at stated query-key offsets (``composition_scores(...,
offsets=...)``), never silently at offset 0; V-composition does not depend on position. Over a
window the offset-free part of every pair is computed once (``_window_correct_scores``: ``d_head^2``
per pair and offset), where that costs fewer operations than the Gram route at each offset; so is
the right erratum's (``_window_erratum_right_scores``: ``3 d_head^2`` per pair and offset), and the
left erratum does not move with the offset at all.

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
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ..factored import FactoredMatrix, eigenvalues_of_product, frobenius_norm_of_product, linalg_dtype
from ..linalg import cholesky_ex, eigh
from ..models.folding import center_reading_weights, center_writing_weights
from ..progress import steps
from .cache import MODEL, cached
from .circuits import Head, check_earlier
from .eigen import positivity, token_gram
from .finite import NonFiniteError, naming_non_finite, require_finite
from .rotary import (
    check_reduce,
    matmul_rotation,
    offset_window,
    reduce_offsets,
    rotation,
    rotation_matmul,
    rotation_parts,
    rotations,
    span,
)

WEIGHTS = ("W_Q", "W_K", "W_V", "W_O")
"""The weights composition scores read (named when a score is not finite)."""

KINDS = ("Q", "K", "V")
NORMS = ("correct", "erratum_left", "erratum_right")
BASELINE_SAMPLES = 256
BASELINE_SEED = 0
TILE = 160  # width of the d_model tiles of the Gram route (a [heads, TILE^2] block per side stays ~100 MB at 1200 heads)
ROW_CHUNKS = 8  # earlier-layer heads scored in this many chunks, so few pairs with l1 >= l2 are computed
MIN_CHUNK_ROWS = 128
FALLBACK_RELATIVE_ERROR = 1e-3  # recompute a pair exactly when the Gram route could be off by more than this
WINDOW_BLOCK_BYTES = 16 << 20  # float64 Z (and Z^T Z) of a block of writers against one layer's readers
FALLBACK_BATCH = 64  # pairs per exact recompute: two [64, d_model, r] gathers, 67 MB at d_model 2048 (256 took 0.27 GB)


def _check(kind: str, norm: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if norm == "erratum":
        raise ValueError('norm="erratum" is ambiguous: the errata names two wrong forms; pass "erratum_left" '
                         '(||X2 X3 X4 X1||, first factor of the paper\'s product moved to the end) or "erratum_right" '
                         '(||X4 X1 X2 X3||, last factor moved to the front)')
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


class OffsetsRequired(ValueError):
    """Q/K-composition of a rotary model was asked for without ``offsets`` (the message says why)."""


def _check_offsets(model, kind: str, offsets) -> list[int] | None:
    """``offsets`` as a list of ints (None when the scores do not depend on position)."""
    rotary = model.cfg.positional == "rotary"
    if offsets is None:
        if rotary and kind in "QK":
            raise OffsetsRequired(
                f"{kind}-composition of a rotary model depends on the relative position: head h2's QK circuit is "
                "W_Q R(offset) W_K^T, a different matrix for every offset between query and key (R rotates the "
                "first rotary_dim dims of each head). Pass offsets=range(0, 33) (for example) to get scores "
                "[n_offsets, L, H, L, H] over those offsets and their spread; V-composition needs none")
        return None
    if not rotary or kind == "V":
        why = "V-composition never depends on position" if rotary else (
            f"this model's positions are {model.cfg.positional!r}, not rotary: its QK circuit has no offset")
        raise ValueError(f"offsets only apply to Q/K-composition of rotary models; {why}")
    offsets = [int(o) for o in offsets]
    if not offsets or min(offsets) < 0:
        raise ValueError(f"offsets must be a non-empty range of query - key offsets >= 0 (causal), got {offsets}")
    return offsets


def _factors(W_Q, W_K, W_V, W_O, kind: str):
    """``(A1, B1, C2, D2)`` with the composed matrix ``A1 B1 C2 D2`` (any leading dims)."""
    if kind == "Q":
        return W_V, W_O, W_Q, W_K.mT
    if kind == "K":
        return W_V, W_O, W_K, W_Q.mT
    return W_V, W_O, W_V, W_O


def _layer_factors(model, kind: str, layer, offset: int | list[int] | None = None, head: int | None = None):
    """``_factors`` of ``model``'s heads ``[layer]`` (``head``: that one only) as the residual stream
    sees them; ``offset`` a list: the rotated factor gains a leading ``[n_offsets]`` dim before its
    matrix dims (the others broadcast).

    Layer norm never reads the all-ones direction (it subtracts the mean), so with
    ``normalization="layernorm"`` readers (``W_Q, W_K, W_V``) lose their mean over ``d_model`` and
    writers (``W_O``) their mean over the output: a function-preserving change (``+ 1 v^T`` on a
    reader) cannot move a score, and the denominators count only what the stream carries.
    Folding already does this where it can (``folding.center_readers``); Shortformer tables still
    read ``W_Q, W_K`` whole, and a hand-built model may not be centred. Rotary: ``W_Q R(offset)``.
    16-bit weights are widened to float32 (``linalg_dtype``)."""
    index = layer if head is None else (layer, head)
    W_Q, W_K, W_V, W_O = (W[index].to(linalg_dtype(W.dtype)) for W in (model.W_Q, model.W_K, model.W_V, model.W_O))
    if model.cfg.normalization == "layernorm":
        W_Q, W_K, W_V = (center_reading_weights(W) for W in (W_Q, W_K, W_V))
        W_O = center_writing_weights(W_O)
    if isinstance(offset, list):
        W_Q = W_Q.unsqueeze(-3) @ rotations(model.cfg, offset, W_Q.dtype, W_Q.device, layer=layer)
    elif offset is not None:
        W_Q = W_Q @ rotation(model.cfg, offset, W_Q.dtype, W_Q.device, layer=layer)
    return _factors(W_Q, W_K, W_V, W_O, kind)


def _gram_root(A: torch.Tensor, center: bool) -> torch.Tensor:
    """``T [..., k, k]`` with ``T T^T = A^T A`` for ``A [..., m, k]`` (``center``: ``A`` less its mean over
    ``m`` first), in ``A``'s dtype: Cholesky of the Gram (taken in float64), ``eigh`` for the heads
    where that fails (rank-deficient). The Gram is multiplied in ``A``'s dtype: its float32 rounding
    (at most ``m u ||a_i|| ||a_j||`` per entry, ``u = 2^-24``) moves a norm through ``T`` by under
    ``m u`` relative, 1e-4 at ``m = 1600``, inside the guard's 1e-3 (float64 copies of the weights
    were most of the thin factors' time). Not QR or ``eigh`` for all: on a loaded 2-core machine
    those LAPACK calls took seconds per layer where Cholesky takes milliseconds."""
    if center:
        A = A - A.mean(-2, keepdim=True)
    gram = (A.mT @ A).double()
    what = f"a head's Gram matrix (multiplied in {A.dtype})"
    root, info = cholesky_ex(gram, what)
    failed = info != 0
    if failed.any():
        values, vectors = eigh(gram[failed], what)
        root[failed] = vectors * values.clamp_min(0).sqrt()[..., None, :]
    return root.to(A.dtype)


def _thin_factors(model, kind: str, offset: int | None, readers: bool = True):
    """``X, Y [L * H, d_model, r]`` with ``||X_{h1}^T Y_{h2}||_F = ||A1 B1 C2 D2||_F`` for every pair:
    ``X = B1^T T_{A1}``, ``Y = C2 T_{D2^T}`` (``_gram_root``: ``X X^T = (A1 B1)^T (A1 B1)`` and
    ``Y Y^T = (C2 D2)(C2 D2)^T``), and their squared norms ``[L * H]`` (float64):
    ``||X_h||^2 = ||W_OV^h||^2``, ``||Y_h||^2 = ||C2 D2||^2``, all as ``_layer_factors`` sees the heads.
    ``readers=False``: the writers' side only (``Y, ny`` are None).

    ``A1, B1^T, C2, D2^T`` are all ``[d_model, r]``; under layer norm each is centred over
    ``d_model`` (``_layer_factors``). Centring is linear on that side, so ``B1^T`` and ``C2`` are
    centred after the product (``center(B1^T) T = center(B1^T T)``), in place in the output: one
    layer at a time into preallocated ``X, Y``, so no centred copy of the model's weights (or a
    second copy of ``X, Y``) ever exists: at GPT-2-XL shapes ``X, Y`` are 1 GB together."""
    cfg = model.cfg
    L, H, d, r = cfg.n_layers, cfg.n_heads, cfg.d_model, model.W_V.shape[-1]
    center = cfg.normalization == "layernorm"
    work = linalg_dtype(model.W_V.dtype)  # 16-bit weights: float32 (a bf16 Gram loses the score)
    device = model.W_V.device
    X, Y = (torch.empty(L * H, d, r, dtype=work, device=device) if side else None for side in (True, readers))
    nx, ny = (torch.empty(L * H, dtype=torch.float64, device=device) if side else None for side in (True, readers))
    for layer in range(L):
        W_Q, W_K, W_V, W_O = (W[layer].to(work) for W in (model.W_Q, model.W_K, model.W_V, model.W_O))
        if offset is not None:
            W_Q = W_Q @ rotation(cfg, offset, W_Q.dtype, W_Q.device, layer=layer)
        A1, B1, C2, D2 = _factors(W_Q, W_K, W_V, W_O, kind)
        heads = slice(layer * H, (layer + 1) * H)
        for out, side, inner, norm in ((X, B1.mT, A1, nx), (Y, C2, D2.mT, ny))[:1 + readers]:
            torch.matmul(side, _gram_root(inner, center), out=out[heads])
            if center:
                out[heads] -= out[heads].mean(-2, keepdim=True)
            norm[heads] = torch.linalg.vector_norm(out[heads].flatten(1), dim=-1).double().square()
    return X, Y, nx, ny


def _tiles(d: int) -> list[slice]:
    n = -(-d // TILE)
    edges = [round(i * d / n) for i in range(n + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


def _row_chunks(L: int, H: int) -> list[tuple[int, int]]:
    """``(first, last)`` earlier layers per chunk; a chunk is scored against every layer > first.
    At most ``ROW_CHUNKS``, each of at least ``MIN_CHUNK_ROWS`` heads (a thinner GEMM runs slowly)."""
    n = max(1, min(ROW_CHUNKS, L - 1, (L - 1) * H // MIN_CHUNK_ROWS))
    edges = [round(i * (L - 1) / n) for i in range(n + 1)]
    return list(itertools.pairwise(edges))


def _tile_pairs(d: int) -> list[tuple[slice, slice, int]]:
    """The upper triangle of ``TILE x TILE`` tiles of a symmetric ``[d, d]`` Gram as ``(I, J, k)``:
    ``k`` entries per head enter the pair GEMM, ``I x J`` for an off-diagonal tile (counted twice:
    its mirror), the ``w (w + 1) / 2`` upper-triangle entries of a diagonal one."""
    tiles = _tiles(d)
    return [(I, J, (I.stop - I.start) * (J.stop - J.start) if I != J else
             (I.stop - I.start) * (I.stop - I.start + 1) // 2) for i, I in enumerate(tiles) for J in tiles[i:]]


def gram_flops(n_layers: int, n_heads: int, d_model: int, r: int) -> int:
    """Floating-point operations of ``_gram_squares`` (multiply-add = 2): the tile Grams of
    both sides plus the pair inner products, QR and fallbacks not counted."""
    H, L = n_heads, n_layers
    n1, n2 = (L - 1) * H, (L - 1) * H  # heads with a later / earlier layer
    pairs = sum((last - first) * H * (L - first - 1) * H for first, last in _row_chunks(L, H))
    flops = 0
    for I, J, k in _tile_pairs(d_model):
        flops += 2 * (I.stop - I.start) * (J.stop - J.start) * r * (n1 + n2) + 2 * k * pairs
    return flops


def _gram_squares(X: torch.Tensor, Y: torch.Tensor, L: int, H: int):
    """``||X_{h1}^T Y_{h2}||_F^2`` for every pair with ``l1 < l2`` as ``[L H, L H]`` (float64; zero
    elsewhere), and the error scale of each: ``(||G1||_F, ||G2||_F)`` of the Grams below.

    Gram route: ``||X1^T Y2||_F^2 = <X1 X1^T, Y2 Y2^T>``, an inner product of two symmetric
    ``[d_model, d_model]`` Grams. Over the upper triangle of ``TILE x TILE`` tiles (off-diagonal
    tiles counted twice, diagonal tiles packed to their upper triangle with the off-diagonal
    entries counted twice) that is one GEMM ``[heads, k] @ [k, heads]`` per tile:
    ``~d_model^2`` per pair instead of the ``2 r^2 d_model`` of the direct ``X1^T Y2``, 5x fewer at
    GPT-2-XL shapes. Tile results are summed in float64. The tile buffers are allocated once and
    reused: a fresh 100 MB tensor per tile costs its page faults again (bmm ran at half speed)."""
    N, d = X.shape[0], X.shape[1]
    S = torch.zeros(N, N, dtype=torch.float64, device=X.device)
    g1 = torch.zeros(N, dtype=torch.float64, device=X.device)
    g2 = torch.zeros_like(g1)
    n = (L - 1) * H
    Xe, Yl = X[:n], Y[H:]  # only earlier heads write to, only later heads read from, a pair
    # ||X X^T||_F = ||X^T X||_F: the error scales from [r, r] Grams, not from every tile
    g1[:n] = torch.linalg.matrix_norm(Xe.mT @ Xe).double()
    g2[H:] = torch.linalg.matrix_norm(Yl.mT @ Yl).double()
    pairs = _tile_pairs(d)
    size = max((I.stop - I.start) * (J.stop - J.start) for I, J, _ in pairs)
    buffers = [X.new_empty(n * size) for _ in range(4)]  # two tile Grams, two packed diagonal ones
    for I, J, k in steps(pairs, "composition_scores: Gram tiles", unit="tile"):
        a, b = I.stop - I.start, J.stop - J.start
        G1, G2 = (torch.bmm(Z[:, I], Z[:, J].mT, out=buf[: n * a * b].view(n, a, b)).view(n, a * b)
                  for Z, buf in ((Xe, buffers[0]), (Yl, buffers[1])))
        weight = 2.0
        if I == J:  # upper triangle only; G1's off-diagonal entries doubled for the mirrored ones
            upper = torch.triu_indices(a, a, device=X.device)
            flat = upper[0] * a + upper[1]
            G1, G2 = (torch.index_select(G, 1, flat, out=buf[: n * k].view(n, k))
                      for G, buf in ((G1, buffers[2]), (G2, buffers[3])))
            G1.mul_(torch.where(upper[0] == upper[1], 1.0, 2.0).to(G1.dtype))
            weight = 1.0
        for first, last in _row_chunks(L, H):
            rows, cols = slice(first * H, last * H), slice((first + 1) * H, None)
            S[rows, cols] += weight * (G1[rows] @ G2[(first + 1) * H - H:].mT).double()
    return S, g1, g2


def _defined(L: int, H: int, device) -> torch.Tensor:
    """``[L, H, L, H]`` bool: the pairs ``[l1, h1, l2, h2]`` with ``l1 < l2`` (the rest are NaN)."""
    layers = torch.arange(L, device=device)
    return (layers[:, None, None, None] < layers[None, None, :, None]).expand(L, H, L, H)


def _correct_scores(model, kind: str, offset: int | None = None) -> torch.Tensor:
    """All-pairs correct scores ``[L, H, L, H]`` (NaN where ``l1 >= l2``), in the weights' ``linalg_dtype``.

    Gram route (``_gram_squares``) with a precision guard: with unit roundoff ``u`` the computed
    squared score carries an error of about ``eps = 4 u (TILE + sqrt(r)) ||G1|| ||G2|| /
    (||X1||^2 ||Y2||^2)`` (probabilistic rounding model, Higham & Mary 2019: tile sums of
    ``TILE^2`` terms, Grams of ``r`` terms, Cauchy-Schwarz over the tiles). Where that could move
    the score by more than ``FALLBACK_RELATIVE_ERROR`` (``eps > 2 * 1e-3 * score^2``, a composition
    far below ``||X1|| ||Y2||``), the pair is recomputed exactly as ``||X1^T Y2||_F``."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    X, Y, nx, ny = _thin_factors(model, kind, offset)
    S, g1, g2 = _gram_squares(X, Y, L, H)
    # an overflow shows here as inf or NaN; a zero head's 0 / 0 below is the NaN the layout promises
    if not all(bool(torch.isfinite(t).all()) for t in (nx, ny, S)):
        raise NonFiniteError(f"the squared norms of the heads or of their products overflow {X.dtype}")
    denom = nx[:, None] * ny[None, :]
    squared = S / denom
    defined = _defined(L, H, X.device).reshape(L * H, L * H)
    u = torch.finfo(X.dtype).eps / 2
    eps = 4 * u * (max(t.stop - t.start for t in _tiles(X.shape[1])) + X.shape[-1] ** 0.5) * g1[:, None] * g2[None, :] / denom
    unsure = defined & (eps > 2 * FALLBACK_RELATIVE_ERROR * squared.clamp_min(0))
    h1, h2 = unsure.nonzero(as_tuple=True)
    for start in range(0, h1.numel(), FALLBACK_BATCH):  # exact, in batches of [FALLBACK_BATCH, r, d_model] copies
        a, b = h1[start: start + FALLBACK_BATCH], h2[start: start + FALLBACK_BATCH]
        squared[a, b] = (X[a].mT @ Y[b]).double().square().sum((1, 2)) / denom[a, b]
    scores = squared.clamp_min(0).sqrt().masked_fill(~defined, float("nan"))
    return scores.reshape(L, H, L, H).to(X.dtype)


def _n_pairs(n_layers: int, n_heads: int) -> int:
    """Head pairs ``(h1, h2)`` with ``h1`` in an earlier layer than ``h2``."""
    return n_heads**2 * n_layers * (n_layers - 1) // 2


def _window_flops(n_layers: int, n_heads: int, d_model: int, r: int, n_offsets: int) -> int:
    """Floating-point operations of ``_window_correct_scores`` (multiply-add = 2): every pair's ``Z``,
    ``Z^T Z`` and its inner product with each offset's ``W(o)``."""
    return 2 * _n_pairs(n_layers, n_heads) * r * r * (d_model + r + n_offsets)


def _window_route_is_cheaper(cfg, r: int, n_offsets: int) -> bool:
    """Whether ``_window_correct_scores`` costs fewer operations than ``_correct_scores`` at each offset
    (its float64 operations counted twice: float64 GEMMs run at about half the float32 rate)."""
    L, H, d = cfg.n_layers, cfg.n_heads, cfg.d_model
    return 2 * _window_flops(L, H, d, r, n_offsets) < n_offsets * gram_flops(L, H, d, r)


def _window_correct_scores(model, kind: str, offsets: list[int]) -> torch.Tensor:
    """Q/K-composition correct scores of a rotary model at every offset of a window, ``[n_offsets, L, H,
    L, H]`` (NaN where ``l1 >= l2``), as ``_correct_scores`` at each offset, with the offset-free work
    done once: per pair ``d_head^2`` operations per offset instead of the Gram route's ``d_model^2``
    (plus every head's tile Grams again at each offset): 55 -> 5.4 s for 100 offsets at the LLaMA-135M
    shape (2 threads, AVX2 host: ``benchmarks/bench_composition.py --rotary 100``).

    With the writer's thin factor ``X1 [d_model, r]`` (``_thin_factors``) and h2's reader ``W2`` (Q:
    ``W_Q``, whose query the offset rotates; K: ``W_K``), the composed matrix's norm is
    ``||X1^T W2 P(o)||_F`` with ``P(o) = R(o) T_K`` (Q; ``T_K T_K^T = W_K^T W_K``, ``_gram_root``) or
    ``R(o)^T T_Q`` (K: ``W_K (W_Q R)^T``, and ``R^T T_Q`` is a root of ``(W_Q R)^T (W_Q R)``). So, with
    the offset-free ``Z = X1^T W2 [r, r]`` and ``W(o) = P(o) P(o)^T``,

        ||A1 B1 C2 D2||_F^2 = <Z^T Z, W(o)>,    ||C2 D2||_F^2 = ||T_{W2}^T P(o)||_F^2.

    In float64. Error: ``Z`` (``d_model`` terms), ``Z^T Z`` (``r``) and the inner product (``r^2``) give
    ``|error| <= (2 d_model + 2 r + r^2) u nx ||W2||_F^2 ||W(o)||_F`` to first order (``u = 2^-53``;
    ``||Z^T Z||_F <= nx ||W2||_F^2``), doubled for margin; where that could move the score by more than
    ``FALLBACK_RELATIVE_ERROR`` (the inner product cancels: ``Z``'s rows nearly orthogonal to ``P(o)``'s
    columns), the entry is recomputed as the sum of squares ``||Z P(o)||_F^2``. Memory: the writers'
    ``X``, one layer's ``W(o)`` (``[H, n_offsets, r, r]`` float64: 29 MB at the LLaMA-135M shape with 100
    offsets) and blocks of ``Z`` of ``WINDOW_BLOCK_BYTES``."""
    cfg = model.cfg
    L, H, d = cfg.n_layers, cfg.n_heads, cfg.d_model
    X, _, nx, _ = _thin_factors(model, kind, None, readers=False)
    r, work, n_off = X.shape[-1], X.dtype, len(offsets)
    if not bool(torch.isfinite(nx).all()):
        raise NonFiniteError(f"the squared norms of the heads overflow {work}")
    center = cfg.normalization == "layernorm"
    scores = torch.full((n_off, L * H, L * H), float("nan"), dtype=work, device=X.device)
    u = torch.finfo(torch.float64).eps / 2
    per_entry = 2 * (2 * d + 2 * r + r * r) * u
    for l2 in steps(range(1, L), f"composition_scores: {kind} over {n_off} offsets", unit="layer"):
        W_Q, W_K = (W[l2].double() for W in (model.W_Q, model.W_K))  # [H, d_model, r]
        W2, other = (W_Q, W_K) if kind == "Q" else (W_K, W_Q)
        if center:  # (X1 is centred: this changes no Z, only the reader's own norm)
            W2 = W2 - W2.mean(-2, keepdim=True)
        diagonal, paired, partner = (t.to(X.device) for t in rotation_parts(cfg, offsets, layer=l2))
        parts = (diagonal[:, None], paired[:, None], partner)  # [n_off, 1, r]: broadcast over the heads
        root = _gram_root(other, center)  # [H, r, r]
        # P(o) [n_off, H, r, r]: R(o) T_K (Q) or R(o)^T T_Q (K)
        P = rotation_matmul(parts, root) if kind == "Q" else matmul_rotation(root.mT, parts).mT
        W = (P @ P.mT).transpose(0, 1).reshape(H, n_off, r * r)  # W(o) per h2, flattened
        ny = (_gram_root(W2, False).mT @ P).square().sum((-2, -1))  # [n_off, H]
        if not bool(torch.isfinite(ny).all()):
            raise NonFiniteError("the squared norms of the heads overflow float64")
        w_norm = W.norm(dim=-1)  # [H, n_off]
        w2_square = W2.square().sum((-2, -1))  # [H]
        readers = W2.permute(1, 0, 2).reshape(d, H * r)  # every h2's W2 side by side: one GEMM per block
        n1 = l2 * H  # every earlier head writes to layer l2
        chunk = max(1, WINDOW_BLOCK_BYTES // (H * r * r * 8))
        for start in range(0, n1, chunk):
            rows = slice(start, min(start + chunk, n1))
            c = rows.stop - rows.start
            Xt = torch.empty(c, r, d, dtype=torch.float64, device=X.device).copy_(X[rows].mT)  # (one pass)
            Z = (Xt.view(c * r, d) @ readers).view(c, r, H, r).transpose(1, 2).contiguous()  # [c, H, r, r]
            S = (Z.mT @ Z).reshape(c, H, r * r)
            f = torch.einsum("chk,hok->cho", S, W)  # [c, H, n_off]
            eps = per_entry * nx[rows, None, None] * (w2_square[:, None] * w_norm)[None]
            unsure = (eps > 2 * FALLBACK_RELATIVE_ERROR * f.clamp_min(0)).nonzero(as_tuple=True)
            if unsure[0].numel():  # the direct sum of squares for the entries the inner product may have lost
                i, h, o = unsure
                f[i, h, o] = (Z[i, h] @ P[o, h]).square().sum((-2, -1))
            if not bool(torch.isfinite(f).all()):
                raise NonFiniteError("the squared norms of the heads' products overflow float64")
            squared = f / (nx[rows, None, None] * ny.T[None])
            scores[:, rows, l2 * H : (l2 + 1) * H] = squared.clamp_min(0).sqrt().permute(2, 0, 1)
    return scores.reshape(n_off, L, H, L, H)


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
    # (checked before the division: a zero head's 0 / 0 is the layout's NaN, not an overflow)
    if not all(bool(torch.isfinite(t).all()) for t in (n1, n2, out[_defined(L, H, out.device)])):
        raise NonFiniteError(f"the erratum products overflow {A1.dtype}")
    return out / (n1[:, :, None, None] * n2[None, None])


def _right_window_flops(n_layers: int, n_heads: int, d_model: int, r: int, n_offsets: int) -> int:
    """Floating-point operations of ``_window_erratum_right_scores`` (multiply-add = 2): every pair's
    ``P, Q`` and their Grams once, then a ``3 r^2`` inner product per offset."""
    return 2 * _n_pairs(n_layers, n_heads) * r * r * (2 * d_model + 2 * r + 3 * n_offsets)


def _right_window_is_cheaper(cfg, r: int, n_offsets: int) -> bool:
    """Whether ``_window_erratum_right_scores`` costs fewer operations than ``_erratum_scores`` at each
    offset (``2 r^2 (2 d_model + r)`` per pair and offset; float64 counted twice, as
    ``_window_route_is_cheaper``)."""
    L, H, d = cfg.n_layers, cfg.n_heads, cfg.d_model
    return 2 * _right_window_flops(L, H, d, r, n_offsets) < n_offsets * 2 * _n_pairs(L, H) * r * r * (2 * d + r)


def _window_erratum_right_scores(model, kind: str, offsets: list[int]) -> torch.Tensor:
    """``"erratum_right"`` Q/K scores of a rotary model at every offset of a window, ``[n_offsets, L, H,
    L, H]`` (NaN where ``l1 >= l2``), as ``_erratum_scores`` at each offset with the offset-free work
    done once per pair (``benchmarks/bench_composition.py --rotary N``).

    The rotation sits inside the product: Q: ``B1 C2 D2 A1 = W_O1 W_Q R W_K^T W_V1``; K: ``W_O1 W_K R^T
    W_Q^T W_V1``, whose transpose has the same norm. Both are ``||P R Q||_F`` with the offset-free
    ``P = X W_Q [k, r]`` and ``Q = W_K^T Y [r, k]``: ``(X, Y) = (W_O1, W_V1)`` for Q, ``(W_V1^T, W_O1^T)``
    for K. ``R = diag(a) + diag(b) Pi`` (``rotation_parts``: ``a`` the diagonal, ``b`` the partner's
    entry, ``Pi`` the partner permutation), so ``P R Q = [P P] diag(a; b) [Q; Pi Q]`` and

        ||P R Q||_F^2 = a^T (S ⊙ K) a + 2 a^T (S ⊙ K Pi) b + b^T (S ⊙ Pi K Pi) b,

    ``S = P^T P``, ``K = Q Q^T`` (``[r, r]`` per pair, once): one ``[pairs, 3 r^2] @ [3 r^2, n_offsets]``
    GEMM. The reader's own norm ``||D2 C2|| = ||W_K^T W_Q R||`` is taken at each offset (``[r, r]``
    per head).

    In float64. The Grams (``k`` terms), their products and the inner product (``3 r^2`` terms) give,
    to first order, ``|error| <= (3 r^2 + 2 k + 2) u beta^2`` with ``beta = sum_m |d_m| ||[P P]_m||
    ||[Q; Pi Q]_m||`` (``d = (a; b)``, columns and rows; ``u = 2^-53``), doubled for margin; where that
    could move the score by more than ``FALLBACK_RELATIVE_ERROR`` (the quadratic form cancels), the
    entry is the direct ``||(P R) Q||_F^2``. ``P`` and ``Q`` themselves are the same ``d_model``-term
    products the per-offset route forms. Memory: every head's factors in the weights' ``linalg_dtype``
    (as the per-offset route), in float64 one layer's readers and blocks of ``WINDOW_BLOCK_BYTES`` (the
    Gram products and ``P, Q`` of a block of writers against them)."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    A1, B1, C2, D2 = _model_factors(model, kind, None)  # centred as _erratum_scores reads them; unrotated
    W_Q, W_KT, X, Y = (C2, D2, B1, A1) if kind == "Q" else (D2.mT, C2.mT, A1.mT, B1.mT)
    work, device = X.dtype, X.device
    k, d, r, n_off = X.shape[-2], X.shape[-1], W_Q.shape[-1], len(offsets)
    # ||B1 A1|| (K: its transpose), one layer at a time in float64
    n1 = torch.cat([torch.linalg.matrix_norm(X[layer].double() @ Y[layer].double()) for layer in range(L)])
    overflow = NonFiniteError(f"the erratum products overflow {work}")
    if not bool(torch.isfinite(n1).all()):
        raise overflow
    scores = torch.full((n_off, L * H, L * H), float("nan"), dtype=work, device=device)
    per_entry = 2 * (3 * r * r + 2 * k + 2) * torch.finfo(torch.float64).eps / 2
    chunk = max(1, WINDOW_BLOCK_BYTES // (H * (7 * r * r + 2 * k * r) * 8))
    for l2 in steps(range(1, L), f"composition_scores: {kind} erratum_right over {n_off} offsets", unit="layer"):
        a, b, pi = (t.to(device) for t in rotation_parts(cfg, offsets, layer=l2))  # [n_off, r] x 2, [r]
        W_Q2, W_KT2 = W_Q[l2].double(), W_KT[l2].double()  # [H, d_model, r], [H, r, d_model]
        n2 = torch.linalg.matrix_norm(matmul_rotation(W_KT2 @ W_Q2, (a[:, None], b[:, None], pi)))  # [n_off, H]
        if not bool(torch.isfinite(n2).all()):
            raise overflow
        # d d^T per offset, as the three blocks the quadratic form reads: [n_off, 3 r^2]
        dd = torch.stack([a[:, :, None] * a[:, None], 2 * a[:, :, None] * b[:, None], b[:, :, None] * b[:, None]], 1)
        dd = dd.reshape(n_off, 3 * r * r)
        readers_q = W_Q2.permute(1, 0, 2).reshape(d, H * r)  # every h2 side by side: one GEMM per block
        readers_k = W_KT2.reshape(H * r, d)
        n_writers = l2 * H
        Xw, Yw = X[:l2].reshape(n_writers, k, d), Y[:l2].reshape(n_writers, d, k)
        for start in range(0, n_writers, chunk):
            rows = slice(start, min(start + chunk, n_writers))
            c = rows.stop - rows.start
            P = (Xw[rows].double().reshape(c * k, d) @ readers_q).view(c, k, H, r).transpose(1, 2)  # [c, H, k, r]
            Q = (readers_k @ Yw[rows].double().permute(1, 0, 2).reshape(d, c * k)).view(H, r, c, k).permute(2, 0, 1, 3)
            S, K = P.mT @ P, Q @ Q.mT  # [c, H, r, r]
            K_pi = K[..., pi]
            blocks = torch.stack([S * K, S * K_pi, S * K_pi[..., pi, :]], 2).reshape(c * H, 3 * r * r)
            f = blocks @ dd.T  # [c H, n_off]
            p_norm, q_norm = P.norm(dim=-2).reshape(c * H, r), Q.norm(dim=-1).reshape(c * H, r)
            beta = (p_norm * q_norm) @ a.abs().T + (p_norm * q_norm[:, pi]) @ b.abs().T
            unsure = (per_entry * beta.square() > 2 * FALLBACK_RELATIVE_ERROR * f.clamp_min(0)).nonzero(as_tuple=True)
            if unsure[0].numel():  # the direct sum of squares for the entries the quadratic form may have lost
                i, o = unsure
                PR = matmul_rotation(P.reshape(c * H, k, r)[i], (a[o], b[o], pi))
                f[i, o] = (PR @ Q.reshape(c * H, r, k)[i]).square().sum((-2, -1))
            # (checked before the division: a zero head's 0 / 0 is the layout's NaN, not an overflow)
            if not bool(torch.isfinite(f).all()):
                raise overflow
            num = f.clamp_min(0).sqrt().view(c, H, n_off)
            scores[:, rows, l2 * H : (l2 + 1) * H] = (num / (n1[rows, None, None] * n2.T[None])).permute(2, 0, 1)
    return scores.reshape(n_off, L, H, L, H)


def _model_factors(model, kind: str, offset: int | None):
    """``_layer_factors`` of every layer stacked: ``(A1, B1, C2, D2)`` each ``[L, H, ...]``."""
    per_layer = [_layer_factors(model, kind, layer, offset) for layer in range(model.cfg.n_layers)]
    return tuple(torch.stack(f) for f in zip(*per_layer))


def _pair_scores(A1, B1, C2, D2, norm: str) -> torch.Tensor:
    """One score per (h1, h2) pair for inputs with the same leading dims (no masking)."""
    if norm == "correct":
        num = frobenius_norm_of_product(A1, B1, C2, D2)
        return num / (frobenius_norm_of_product(A1, B1) * frobenius_norm_of_product(C2, D2))
    X, Y = D2 @ A1, B1 @ C2
    num = torch.linalg.matrix_norm(X @ Y if norm == "erratum_left" else Y @ X)
    return num / (torch.linalg.matrix_norm(B1 @ A1) * torch.linalg.matrix_norm(D2 @ C2))


def _gram_factor(rng, n: int, rows: int, r: int) -> torch.Tensor:
    """``F [n, k, r]`` with ``F^T F`` distributed as ``X^T X`` for ``X [rows, r]`` i.i.d. N(0, 1), float64:
    the Bartlett factor (upper triangular, ``F_ii = sqrt(chi2(rows - i))``, N(0, 1) above the
    diagonal; ``X = Q F``) when ``rows >= r``, else ``X`` itself."""
    if rows < r:
        return torch.from_numpy(rng.standard_normal((n, rows, r)))
    F = torch.from_numpy(rng.standard_normal((n, r, r))).triu_(1)
    F.diagonal(dim1=-2, dim2=-1).copy_(torch.from_numpy(np.sqrt(rng.chisquare(rows - np.arange(r), size=(n, r)))))
    return F


def _random_correct_scores(d_model: int, d_head: int, n: int, seed: int) -> torch.Tensor:
    """``n`` samples of the correct score ``||A1 B1 C2 D2|| / (||A1 B1|| ||C2 D2||)`` of i.i.d. Gaussian
    ``A1, C2 [d_model, d_head]``, ``B1, D2 [d_head, d_model]``, drawn with ``d_head``-sized matrices only.

    Exact in distribution: with ``A1 = Q_A F_A``, ``C2 = Q_C F_C``, ``D2^T = Q_D F_D`` (orthonormal
    ``Q``, ``_gram_factor``), the numerator is ``||F_A (B1 Q_C) F_C F_D^T||`` and ``||C2 D2|| =
    ||F_C F_D^T||``; ``B1`` splits into ``G = B1 Q_C`` and its part ``P`` off ``Q_C``'s columns, both
    Gaussian, independent of ``Q_C``, so ``||A1 B1||^2 = ||F_A G||^2 + ||F_A P||^2`` with ``P P^T``
    drawn as ``F_P^T F_P``. About ``3 d_head^2`` normal draws per sample instead of
    ``4 d_model d_head``: the GPT-2-sized Monte Carlo took a second, as long as five forward passes."""
    rng = np.random.default_rng(seed)
    F_A, F_C, F_D = (_gram_factor(rng, n, d_model, d_head) for _ in range(3))
    G = torch.from_numpy(rng.standard_normal((n, d_head, F_C.shape[1])))
    F_P = _gram_factor(rng, n, d_model - F_C.shape[1], d_head)
    AG, CD = F_A @ G, F_C @ F_D.mT
    left = (AG.square().sum((-2, -1)) + (F_A @ F_P.mT).square().sum((-2, -1))).sqrt()
    return torch.linalg.matrix_norm(AG @ CD) / (left * torch.linalg.matrix_norm(CD))


@functools.lru_cache(maxsize=32)
def random_baseline(d_model: int, d_head: int, norm: str = "correct",
                    n_samples: int = BASELINE_SAMPLES, seed: int = BASELINE_SEED) -> float:
    """Expected composition score of random matrices with a head's shapes.

    Monte Carlo with a fixed seed: ``n_samples`` pairs of heads with i.i.d. Gaussian
    ``W_V, W_Q, W_K [d_model, d_head]`` and ``W_O [d_head, d_model]`` (the score is scale
    invariant, so the variance does not matter). Q, K and V share this value: their four
    factors have the same shapes and distribution. Standard error with the default 256
    samples: 0.08% of the value at GPT-2 shapes (0.036), 1.2% at d_model 32, d_head 4.
    Computed in float64, cached per shape; the correct score's samples are drawn through
    ``d_head``-sized factors with the same distribution (``_random_correct_scores``).
    """
    _check("V", norm)
    if norm == "correct":
        return float(_random_correct_scores(d_model, d_head, n_samples, seed).mean())
    gen = torch.Generator().manual_seed(seed)
    shapes = [(d_model, d_head), (d_head, d_model)] * 2
    A1, B1, C2, D2 = (torch.randn(n_samples, *s, generator=gen, dtype=torch.float64) for s in shapes)
    return float(_pair_scores(A1, B1, C2, D2, norm).mean())


def composition_baseline(model, norm: str = "correct") -> float:
    """``random_baseline`` for ``model``'s heads: the residual stream a layer-norm model's heads
    compose through has ``d_model - 1`` dimensions (the all-ones direction is never read)."""
    d = model.cfg.d_model - (model.cfg.normalization == "layernorm")
    return random_baseline(d, model.cfg.d_head, norm)


@torch.no_grad()
def composition_scores(model, kind: str, baseline: bool = True, norm: str = "correct",
                       offsets=None, reduce: str | None = None) -> torch.Tensor:
    """Every head pair's ``kind``-composition score: ``[L, H, L, H]`` indexed ``[l1, h1, l2, h2]``.

    Q: ``||W_OV^{h1} W_QK^{h2}||_F``, K: ``||W_OV^{h1} W_QK^{h2 T}||_F``, V: ``||W_OV^{h1} W_OV^{h2}||_F``
    (row convention, see module docstring), each over ``||W_OV^{h1}||_F ||W_{QK|OV}^{h2}||_F``,
    with layer norm's unread all-ones direction removed (``_layer_factors``).
    ``baseline=True`` subtracts ``composition_baseline`` (the score random matrices of the same
    shapes get), as the paper does; ``baseline=False`` equals TransformerLens's
    ``all_composition_scores`` on its folded weights (the defined entries).
    ``norm="erratum_left"`` / ``"erratum_right"`` give the two cyclic-permutation scores the
    errata names (wrong; for comparison only; the module docstring says exactly what each computes).

    Rotary models: V-composition as above; Q- and K-composition depend on the offset between
    query and key (``W_QK(offset) = W_Q R(offset) W_K^T``, see ``rotation``), so they need
    ``offsets`` (e.g. ``range(0, 33)``) and return ``[n_offsets, L, H, L, H]``; without it they are
    refused, never silently taken at offset 0 (``"erratum_left"`` is the same at every offset: the
    rotation ends both of its products, so it is computed once and read-only; ``"erratum_right"`` does
    its offset-free work once per pair where that costs fewer operations: from 3 offsets at the
    LLaMA-135M shape). ``reduce`` ("max" or "mean", optional) reduces a window per pair to
    ``[L, H, L, H]`` (``rotary.reduce_offsets``: "max" is each pair's largest score over ``offsets``);
    scores without an offset dimension are returned as they are. Entries with ``l1 >= l2`` are NaN.
    Computed in the weights' dtype (16-bit weights: in float32, returned as float32); float32 precision
    of the correct score: see ``_correct_scores``. The table without baseline is computed once per model
    (``cache``).
    """
    _check(kind, norm)
    if reduce is not None:
        check_reduce(reduce)
    offsets = _check_offsets(model, kind, offsets)
    key = ("composition_scores", kind, norm, None if offsets is None else tuple(offsets))
    scores = cached(model, key, lambda: _composition_scores(model, kind, norm, offsets), tier=MODEL)
    if reduce is not None and offsets is not None:
        scores = reduce_offsets(scores, offsets, reduce)[0]
    if baseline:
        scores = scores - composition_baseline(model, norm)
    return scores


def _composition_scores(model, kind: str, norm: str, offsets: list[int] | None) -> torch.Tensor:
    """``composition_scores`` without baseline at the validated ``offsets``."""
    L, H = model.cfg.n_layers, model.cfg.n_heads

    def at(offset):
        if L < 2:
            return torch.full((L, H, L, H), float("nan"), dtype=linalg_dtype(model.W_Q.dtype), device=model.W_Q.device)
        if norm == "correct":
            return _correct_scores(model, kind, offset)
        return _erratum_scores(*_model_factors(model, kind, offset), norm)

    with naming_non_finite(f"the {kind}-composition scores", model, WEIGHTS, linalg_dtype(model.W_Q.dtype)):
        if offsets is None:
            scores = at(None)
        elif norm == "correct" and L >= 2 and _window_route_is_cheaper(model.cfg, model.W_V.shape[-1], len(offsets)):
            scores = _window_correct_scores(model, kind, offsets)
        elif (norm == "erratum_right" and L >= 2
              and _right_window_is_cheaper(model.cfg, model.W_V.shape[-1], len(offsets))):
            scores = _window_erratum_right_scores(model, kind, offsets)
        elif norm == "erratum_left":
            # R(o) = s^2 x an orthogonal map ends both products (Q: D2 A1 B1 W_Q R and W_K^T W_Q R; K: R^T
            # starts them): each norm is s^2 times the unrotated one, so the score is the same at every offset
            scores = at(offsets[0]).expand(len(offsets), L, H, L, H)
        else:
            scores = torch.stack([at(o) for o in steps(offsets, f"composition_scores: {kind} {norm}", unit="offset")])
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
    Rotary Q/K: ``offsets`` is the window read, ``scores_by_offset [n_offsets]`` the score at each, and
    everything else is at ``offset``, the window's offset with the largest score (``W_QK^{h2}`` is
    ``W_Q R(offset) W_K^T``); all three are None where the composition has no offset.
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
    offset: int | None = None
    offsets: list[int] | None = None
    scores_by_offset: torch.Tensor | None = None

    @property
    def offset_note(self) -> str:
        """How the offset was chosen ("" without one): ``"at query - key offset 3 (the largest score of
        offsets 0..32)"``."""
        if self.offset is None:
            return ""
        window = "" if len(self.offsets) == 1 else f" (the largest score of offsets {span(self.offsets)})"
        return f"at query - key offset {self.offset}{window}"


def _pair_factors(model, kind: str, l1: int, i1: int, l2: int, i2: int, offset: int | list[int] | None):
    """``(A1, B1, C2, D2)`` of the pair ``(l1, i1) -> (l2, i2)`` (``offset`` a list: ``[n_offsets]``
    leading dims where the rotation enters, ``_layer_factors``)."""
    A1, B1, _, _ = _layer_factors(model, kind, l1, offset, head=i1)
    _, _, C2, D2 = _layer_factors(model, kind, l2, offset, head=i2)
    return A1, B1, C2, D2


@torch.no_grad()
def composition_detail(model, kind: str, h1: Head, h2: Head, offset=None) -> CompositionDetail:
    """Score, erratum scores, singular values and token-circuit positivity of one pair ``h1 -> h2``.

    Rotary Q/K-composition is read at ``offset``: an int, or a window of offsets (default
    ``rotary.DEFAULT_OFFSETS``), in which case the detail is at the window's offset with the largest
    score and ``scores_by_offset`` holds every offset's score (``CompositionDetail``). Computed once
    per model and pair (``cache``)."""
    _check(kind, "correct")
    (l1, i1), (l2, i2) = check_earlier(model, h1, h2)
    offsets = None
    if kind == "V" or model.cfg.positional != "rotary":
        _check_offsets(model, kind, None if offset is None else _as_list(offset))
    else:
        offsets = offset_window(model, offset, f"{kind}-composition")
    return cached(model, ("composition_detail", kind, (l1, i1), (l2, i2), None if offsets is None else tuple(offsets)),
                  lambda: _composition_detail(model, kind, (l1, i1), (l2, i2), offsets))


def _composition_detail(model, kind: str, h1: Head, h2: Head, offsets: list[int] | None) -> CompositionDetail:
    """``composition_detail`` of the checked pair ``h1 -> h2`` over the validated ``offsets`` (None: the
    composition has no offset)."""
    (l1, i1), (l2, i2) = h1, h2
    by_offset, best = None, None
    if offsets is not None:
        # every offset in one batched score (the explorer's window is its text's length: ~100)
        by_offset = _pair_scores(*_pair_factors(model, kind, l1, i1, l2, i2, list(offsets)), "correct").double()
        best = offsets[int(by_offset.nan_to_num(float("-inf")).argmax())]
    A1, B1, C2, D2 = _pair_factors(model, kind, l1, i1, l2, i2, best)
    what = f"the {kind}-composition of {h1} -> {h2}"
    with naming_non_finite(what, model, WEIGHTS, A1.dtype):
        S = (FactoredMatrix(A1, B1) @ FactoredMatrix(C2, D2)).S
        # a zero head's score is 0 / 0 = NaN (as in composition_scores); an overflow shows in these
        own = torch.stack([frobenius_norm_of_product(A1, B1), frobenius_norm_of_product(C2, D2)])
    require_finite(torch.cat([S, own]), what, model, WEIGHTS)
    what = f"the eigenvalues of the {kind}-composition token circuit of {h1} -> {h2}"
    token_weights, gram_dtype = ("W_E", "W_U", *WEIGHTS), linalg_dtype(model.W_E.dtype)  # the vocab-sized Gram's
    with naming_non_finite(what, model, token_weights, gram_dtype):
        if kind == "V":
            eigs = eigenvalues_of_product(*[x.double() for x in (A1, B1, C2, D2)], token_gram(model, "OV"))
        else:
            # token circuit W_E M W_E^T with M = A1 B1 C2 D2 (Q) or its transpose (K)
            chain = (A1, B1, C2, D2) if kind == "Q" else (D2.mT, C2.mT, B1.mT, A1.mT)
            eigs = eigenvalues_of_product(*[x.double() for x in chain], token_gram(model, "QK"))
    require_finite(eigs, what, model, token_weights, gram_dtype)
    score = float(_pair_scores(A1, B1, C2, D2, "correct"))
    erratum = {norm: float(_pair_scores(A1, B1, C2, D2, norm)) for norm in NORMS[1:]}
    return CompositionDetail(
        kind=kind, h1=(l1, i1), h2=(l2, i2), score=score, erratum_scores=erratum,
        baseline=composition_baseline(model), singular_values=S, eigenvalues=eigs,
        positivity=float(positivity(eigs)), offset=best, offsets=offsets, scores_by_offset=by_offset,
    )


def _as_list(offset) -> list:
    """``offset`` (an int or an iterable) as a list, for ``_check_offsets``' refusals."""
    return list(offset) if hasattr(offset, "__iter__") else [offset]


def strongest_writers(k_scores) -> np.ndarray:
    """The strongest K-composition writer into every head: ``writers[l2, h2] = (l1, h1)``, the
    earlier head (``l1 < l2``) with the largest finite score ``k_scores[l1, h1, l2, h2]`` (the
    first in ``(l1, h1)`` order on ties), or ``(-1, -1)`` where there is none (layer 0, or no
    finite score: a zero head's NaN, or Q/K-composition refused without offsets).

    Args:
        k_scores: ``[L, H, L, H]`` K-composition scores (``composition_scores(model, "K")``
            layout; entries with ``l1 >= l2`` are NaN and never chosen).

    Returns:
        int32 ``[L, H, 2]``.
    """
    scores = np.asarray(k_scores, dtype=np.float64)
    L, H = scores.shape[0], scores.shape[1]
    if scores.shape != (L, H, L, H):
        raise ValueError(f"k_scores must have shape [L, H, L, H], got {list(scores.shape)}")
    writers = np.full((L, H, 2), -1, dtype=np.int32)
    for l2 in range(1, L):
        into = scores[:l2, :, l2, :].reshape(l2 * H, H)  # [earlier heads, h2]
        into = np.where(np.isfinite(into), into, -np.inf)
        best = into.argmax(0)  # the first maximum, as np.nanargmax
        found = np.isfinite(into[best, np.arange(H)])
        writers[l2, found] = np.stack(divmod(best[found], H), axis=1)
    return writers
