"""FactoredMatrix against dense torch computations and TransformerLens's FactoredMatrix.

Tolerances (``tests/tolerance.py``): two evaluations of the same product of factors, in their dtype
and in any order or kernel, agree within ``product_tol`` (``gamma`` of the inner dimensions times
``|A| |B|``, entry by entry); results of SVDs and QRs within ``factorization_tol`` (LAPACK's own
acceptance bound, ``n eps`` times the input's norm). Eigenvalue comparisons run in float64.
"""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pycircuits_widgets import factored, screen
from pycircuits_widgets.factored import (
    FactoredMatrix,
    chain_matmul,
    eigenvalues_of_product,
    frobenius_norm_of_product,
)
from tolerance import assert_within, factorization_tol, gamma, product_tol, reduction_tol

LEADS = [(), (3,), (2, 3)]
FAST = settings(max_examples=25, deadline=None)


def norms(A, B):
    """``||A||_F ||B||_F [..., 1, 1]`` in float64: the size of ``A @ B`` a factorization's error scales with."""
    return (torch.linalg.matrix_norm(A.double()) * torch.linalg.matrix_norm(B.double()))[..., None, None]


def svd_tol(A, B, computations):
    """``factorization_tol`` of the SVD route (``FactoredMatrix._svd``: SVDs of ``A``, of ``B`` and of
    their ``[k, k]`` core, joined by products) on matrices of at most ``max(m, k, n)`` rows or columns."""
    return factorization_tol(max(A.shape[-2:] + B.shape[-1:]), norms(A, B), A.dtype, computations)


@st.composite
def factor_pairs(draw, square=False):
    """Random A [lead_a, m, k], B [lead_b, k, n] whose leading dims broadcast."""
    lead = draw(st.sampled_from(LEADS))
    # drop or shrink leading dims on one side to exercise broadcasting
    lead_a = lead[draw(st.integers(0, len(lead))) :]
    lead_b = tuple(1 if draw(st.booleans()) else s for s in lead)
    m, k = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    n = m if square else draw(st.integers(1, 9))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    A = torch.randn(*lead_a, m, k, generator=gen, dtype=dtype)
    B = torch.randn(*lead_b, k, n, generator=gen, dtype=dtype)
    return A, B


def close_sets(ours, ref, atol):
    """Each complex value of ``ours`` is near one of ``ref`` and vice versa (eigenvalue order is arbitrary)."""
    dist = (ours[..., :, None] - ref[..., None, :]).abs()
    assert dist.min(-1).values.max() < atol and dist.min(-2).values.max() < atol


# ------------------------------------------------------------------ dense equivalence
@FAST
@given(factor_pairs())
def test_dense_shape_transpose_and_norm_match_dense(pair):
    A, B = pair
    fm, M = FactoredMatrix(A, B), A @ B
    assert fm.shape == M.shape and fm.ldim == A.shape[-2] and fm.rdim == B.shape[-1]
    assert fm.mdim == fm.rank == A.shape[-1]
    # A @ B twice (broadcast leading dims may take another kernel): product_tol
    assert_within(fm.dense(), M, product_tol(A, B))
    assert_within(fm.AB, M, product_tol(A, B))
    assert_within(fm.T.AB, M.mT, product_tol(A, B).mT)
    # the Gram or QR route against the dense product's norm: a factorization's bound on each side
    assert_within(fm.norm(), torch.linalg.matrix_norm(M), svd_tol(A, B, 2)[..., 0, 0])
    # (2.5 A) B against 2.5 (A B): one more rounding on each side, k + 1 in all
    assert_within((fm * 2.5).AB, 2.5 * M,
                  reduction_tol(A.shape[-1] + 1, 2.5 * (A.double().abs() @ B.double().abs()), A.dtype, 2))


@FAST
@given(factor_pairs(square=True))
def test_trace_ba_and_eigenvalues_match_dense(pair):
    A, B = pair
    A, B = A.double(), B.double()  # dense eig of a singular matrix needs float64 to compare
    fm, M = FactoredMatrix(A, B), A @ B
    torch.testing.assert_close(fm.trace(), torch.diagonal(M, dim1=-2, dim2=-1).sum(-1))
    torch.testing.assert_close(fm.BA, B @ A)
    ours = fm.eigenvalues
    r = min(A.shape[-2], A.shape[-1])
    # TransformerLens's count: k = mdim values, eig(BA); where m < k the last k - m are exact zeros
    assert ours.shape == (*M.shape[:-2], fm.mdim) and ours.is_complex()
    assert torch.equal(ours[..., r:], torch.zeros_like(ours[..., r:]))
    dense = torch.linalg.eigvals(M)
    top = dense.gather(-1, dense.abs().argsort(-1, descending=True)[..., :r])
    # float64: backward errors ~1e-14 ||M||; the nonzero eigenvalues of a rank-deficient non-normal
    # matrix can be ill-conditioned, and 1e-6 leaves them a condition number of 1e7
    close_sets(ours[..., :r], top, atol=1e-6)


@FAST
@given(factor_pairs())
def test_svd_reconstructs_and_matches_dense_singular_values(pair):
    A, B = pair
    fm, M = FactoredMatrix(A, B), A @ B
    U, S, V = fm.svd()  # TransformerLens's convention: M = U diag(S) V^T
    r = min(fm.ldim, fm.mdim, fm.rdim)
    assert U.shape[-2:] == (fm.ldim, r) and S.shape[-1] == r and V.shape[-2:] == (fm.rdim, r)
    # ours: three SVDs and the products joining them (4 bounds); the reference: one product (and,
    # for the singular values, its SVD: 5); orthogonality: two factors' and their product's (3)
    dense = M.broadcast_to(U.shape[:-2] + M.shape[-2:])
    assert_within(U @ (S[..., :, None] * V.mT), dense, svd_tol(A, B, 4))
    assert_within(S, torch.linalg.svdvals(M)[..., :r], svd_tol(A, B, 5)[..., 0])
    eye = torch.eye(r, dtype=A.dtype).broadcast_to(S.shape + (r,))
    orthogonal = factorization_tol(max(A.shape[-2:] + B.shape[-1:]), 1.0, A.dtype, 3)
    assert_within(U.mT @ U, eye, orthogonal)
    assert_within(V.mT @ V, eye, orthogonal)
    assert_within(U @ fm.collapse_l(), dense, svd_tol(A, B, 4))
    assert_within(fm.collapse_r() @ V.mT, dense, svd_tol(A, B, 4))


@FAST
@given(factor_pairs(), st.data())
def test_rows_cols_entries_and_leading_indexing_match_dense(pair, data):
    A, B = pair
    fm, M = FactoredMatrix(A, B), A @ B
    i = data.draw(st.integers(-fm.ldim, fm.ldim - 1))
    j = data.draw(st.integers(-fm.rdim, fm.rdim - 1))
    bound = product_tol(A, B)  # each entry of A @ B, evaluated twice (a row at a time against the whole)
    assert_within(fm.row(i), M[..., i, :], bound[..., i, :])
    assert_within(fm.col(j), M[..., :, j], bound[..., :, j])
    assert_within(fm.entry(i, j), M[..., i, j], bound[..., i, j])
    assert_within(fm.rows([i, 0]).AB, M[..., [i, 0], :], bound[..., [i, 0], :])
    cols = slice(0, j + 1 if j >= 0 else None)
    assert_within(fm.cols(cols).AB, M[..., :, cols], bound[..., :, cols])
    if fm.ndim > 2:
        assert_within(fm[-1].AB, M[-1], bound[-1])
        assert_within(fm[..., 0, :, :].AB, M[..., 0, :, :], bound[..., 0, :, :])
        assert_within(fm[:1].AB, M[:1], bound[:1])


def test_indexing_keeps_shared_factor_unexpanded():
    W_V, W_O = torch.randn(2, 3, 8, 4), torch.randn(4, 8)
    head = FactoredMatrix(W_V, W_O)[1, 2]
    assert head.shape == (8, 8) and head.B.shape == (4, 8)
    assert_within(head.AB, W_V[1, 2] @ W_O, product_tol(W_V[1, 2], W_O))
    layer = FactoredMatrix(W_V, W_O)[1]
    # B reads back broadcast over the 3 heads, as a view of the one stored W_O (stride 0)
    assert layer.B.shape == (3, 4, 8) and layer.B.stride(0) == 0 and layer.B.data_ptr() == W_O.data_ptr()


# ------------------------------------------------------------------ matmul
@FAST
@given(factor_pairs(), st.integers(1, 9), st.integers(1, 9))
def test_matmul_keeps_factored_form_split_at_smallest_inner_dim(pair, p, q):
    A, B = pair
    fm, M = FactoredMatrix(A, B), A @ B
    right = torch.randn(fm.rdim, p, dtype=A.dtype)
    left = torch.randn(q, fm.ldim, dtype=A.dtype)
    # each side a chain of the same factors multiplied in another order: product_tol of the chain
    out = fm @ right
    assert isinstance(out, FactoredMatrix) and out.mdim == min(fm.mdim, fm.rdim)
    assert_within(out.AB, M @ right, product_tol(A, B, right))
    out = left @ fm
    assert isinstance(out, FactoredMatrix) and out.mdim == min(fm.ldim, fm.mdim)
    assert_within(out.AB, left @ M, product_tol(left, A, B))
    other = FactoredMatrix(torch.randn(fm.rdim, p, dtype=A.dtype), torch.randn(p, q, dtype=A.dtype))
    out = fm @ other
    assert out.mdim == min(fm.mdim, fm.rdim, p)
    assert_within(out.AB, M @ other.AB, product_tol(A, B, other.A, other.B))
    assert_within(fm @ right[:, 0], M @ right[:, 0], product_tol(A, B, right[:, :1])[..., 0])
    assert_within(left[0] @ fm, left[0] @ M, product_tol(left[:1], A, B)[..., 0, :])


def test_bottleneck_split_of_two_factored_matrices():
    # (A B) @ (C D) with inner dims 6, 20, 2: the product must be split at the 2
    A, B, C, D = torch.randn(10, 6), torch.randn(6, 20), torch.randn(20, 2), torch.randn(2, 11)
    out = FactoredMatrix(A, B) @ FactoredMatrix(C, D)
    assert out.A.shape == (10, 2) and out.B.shape == (2, 11)
    assert_within(out.AB, A @ B @ C @ D, product_tol(A, B, C, D))


def test_chain_matmul_multiplies_shared_factors_once_and_matches_dense():
    W_E, W_U = torch.randn(50, 16), torch.randn(16, 50)
    W_V, W_O = torch.randn(2, 3, 16, 4), torch.randn(2, 3, 4, 16)
    dense = W_O @ W_U @ W_E @ W_V
    assert_within(chain_matmul(W_O, W_U, W_E, W_V), dense, product_tol(W_O, W_U, W_E, W_V))


# ------------------------------------------------------------------ norms and spectra
def test_norm_matches_dense_where_cyclic_permutation_does_not():
    # the paper's erratum: ||ABCD||_F was computed as ||BCDA||_F, valid only for the trace
    gen = torch.Generator().manual_seed(0)
    A, B, C, D = (torch.randn(6, 6, generator=gen, dtype=torch.float64) for _ in range(4))
    truth = torch.linalg.matrix_norm(A @ B @ C @ D)
    cyclic = torch.linalg.matrix_norm(B @ C @ D @ A)
    assert not torch.isclose(cyclic, truth, rtol=0.05)
    torch.testing.assert_close(frobenius_norm_of_product(A, B, C, D), truth)
    torch.testing.assert_close((FactoredMatrix(A, B) @ FactoredMatrix(C, D)).norm(), truth)
    # the trace, in contrast, is cyclic: both agree there
    torch.testing.assert_close(torch.trace(B @ C @ D @ A), torch.trace(A @ B @ C @ D))


@FAST
@given(st.lists(st.integers(1, 12), min_size=2, max_size=6), st.sampled_from(LEADS), st.integers(0, 2**31))
def test_frobenius_norm_of_product_matches_dense_with_broadcast_heads(dims, lead, seed):
    gen = torch.Generator().manual_seed(seed)
    # every other factor has leading dims, like per-head W_V/W_O between shared W_E/W_U
    factors = [
        torch.randn(*(lead if i % 2 else ()), a, b, generator=gen, dtype=torch.float64)
        for i, (a, b) in enumerate(itertools.pairwise(dims))
    ]
    dense = factors[0]
    for f in factors[1:]:
        dense = dense @ f
    torch.testing.assert_close(frobenius_norm_of_product(*factors), torch.linalg.matrix_norm(dense))


def test_composition_style_norms_for_all_head_pairs():
    # ||W_QK^{h2 T} W_OV^{h1}||_F in row convention: (W_Q W_K^T)^T (W_V W_O) over head pairs
    W_Q, W_K, W_V, W_O = (torch.randn(3, d, e, dtype=torch.float64) for d, e in [(16, 4)] * 3 + [(4, 16)])
    h2 = (slice(None), None)  # [3, 1, ...] broadcasts against h1 [1, 3, ...]
    norms = frobenius_norm_of_product(W_K[h2], W_Q.mT[h2], W_V[None], W_O[None])
    dense = torch.linalg.matrix_norm((W_Q @ W_K.mT).mT[:, None] @ (W_V @ W_O)[None])
    assert norms.shape == (3, 3)
    torch.testing.assert_close(norms, dense)


def test_eigenvalues_of_full_circuit_chain_match_dense():
    W_E = torch.randn(40, 12, dtype=torch.float64)
    W_V, W_O = torch.randn(2, 12, 3, dtype=torch.float64), torch.randn(2, 3, 12, dtype=torch.float64)
    W_U = torch.randn(12, 40, dtype=torch.float64)
    ours = eigenvalues_of_product(W_E, W_V, W_O, W_U)
    assert ours.shape == (2, 3)
    dense = torch.linalg.eigvals(W_E @ W_V @ W_O @ W_U)
    top = dense.gather(-1, dense.abs().argsort(-1, descending=True)[..., :3])
    close_sets(ours, top, atol=1e-6)  # float64 (see test_trace_ba_and_eigenvalues_match_dense)


# ------------------------------------------------------------------ top-k
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_matches_dense_on_3000_square_product(dtype):
    gen = torch.Generator().manual_seed(1)
    A, B = torch.randn(3000, 16, generator=gen, dtype=dtype), torch.randn(16, 3000, generator=gen, dtype=dtype)
    fm, M = FactoredMatrix(A, B), A @ B
    # every entry evaluated twice within product_tol: the k-th largest moves by at most the largest bound
    bound = product_tol(A, B)
    for largest in (True, False):
        values, rows, cols = fm.topk(100, largest=largest, block_bytes=4 << 20)  # many blocks
        dense = torch.topk(M.flatten(), 100, largest=largest).values
        assert_within(values, dense, bound.max())
        assert_within(M[rows, cols], values, bound[rows, cols])
        assert len(set(zip(rows.tolist(), cols.tolist()))) == 100


@pytest.fixture(params=screen.describe().usable())
def route(request, monkeypatch):
    """Every screen route measured usable here (not only the chosen one) as the top-k's route; float32
    runs the exact blocks with no screen."""
    monkeypatch.setattr(screen, "exact_route", lambda device_type="cpu": request.param)
    return request.param


def test_topk_with_ties_equals_dense_exactly(route):
    # small integers: every summation order is exact, and the product has massive ties
    gen = torch.Generator().manual_seed(2)
    A = torch.randint(-2, 3, (3000, 4), generator=gen).float()
    B = torch.randint(-2, 3, (4, 3000), generator=gen).float()
    fm, M = FactoredMatrix(A, B), A @ B
    values, rows, cols = fm.topk(500, block_bytes=1 << 20)
    assert torch.equal(values, torch.topk(M.flatten(), 500).values)
    assert torch.equal(M[rows, cols], values)
    assert len(set(zip(rows.tolist(), cols.tolist()))) == 500
    row_values, row_cols = fm.topk_per_row(7, block_bytes=1 << 20)
    assert torch.equal(row_values, torch.topk(M, 7, dim=-1).values)
    assert torch.equal(M.gather(-1, row_cols), row_values)


def test_topk_dense_blocks_stay_within_block_bytes(route, monkeypatch):
    # every entry ties at the level, which defeats any screen (an exact one too: a tie is a candidate),
    # so its (large) screening blocks fall back to exact GEMMs: those must still come in blocks of at
    # most block_bytes
    sizes, candidates = [], factored._candidates
    monkeypatch.setattr(factored, "_candidates",
                        lambda block, k, t: sizes.append(block.numel() * block.element_size()) or candidates(block, k, t))
    A, B = torch.full((3000, 4), 2.0), torch.full((4, 3000), -1.0)
    values, _, _ = FactoredMatrix(A, B).topk(500, block_bytes=1 << 20)
    assert torch.equal(values, torch.topk((A @ B).flatten(), 500).values)
    assert len(sizes) > 3 and max(sizes) <= 1 << 20


def test_topk_keeps_entries_that_bf16_screening_cannot_tell_apart(route):
    # the top entries differ by ~1e-6 relative: equal in bf16, distinct in float32; the rest
    # are small, so the screened path (not its exact-block fallback) must keep them all
    a = torch.full((3000,), 0.1)
    a[:100] = 1 + torch.arange(100, dtype=torch.float32) * 1e-6
    fm = FactoredMatrix(a[:, None], a.flip(0)[None, :].roll(100, dims=1))
    M = fm.dense()
    values, rows, cols = fm.topk(50, block_bytes=1 << 20)
    assert torch.equal(values, torch.topk(M.flatten(), 50).values)
    assert torch.equal(M[rows, cols], values)


def test_bottom_k_of_a_positive_matrix_with_rows_of_very_different_norms(route):
    """The smallest entries come from the rows of smallest norm, whose screened int8 outputs all sit at
    the bottom of their range while the running level (of the negated matrix) lies far below what their
    scale can express: the screen must keep them (found by the property test below on an AVX2 host)."""
    g = torch.Generator().manual_seed(4)
    A = torch.rand(300, 1, generator=g) * torch.exp(torch.linspace(0, -12, 300))[:, None]
    B = torch.rand(1, 200, generator=g) + 10  # (every product of a row within 10%: all its int8 outputs saturate)
    M = A.double() @ B.double()
    values, rows, cols = FactoredMatrix(A, B).topk(7, largest=False, block_bytes=64)
    # inner dimension 1: each float32 entry is one rounded product, within u relative of float64's
    rel = gamma(1)
    torch.testing.assert_close(values.double(), torch.topk(M.flatten(), 7, largest=False).values, rtol=rel, atol=0)
    torch.testing.assert_close(M[rows, cols], values.double(), rtol=rel, atol=0)


@FAST
@given(factor_pairs(), st.integers(1, 9), st.booleans())
def test_topk_variants_match_dense_with_leading_dims(pair, k, largest):
    A, B = pair
    fm, M = FactoredMatrix(A, B), A @ B
    # as in test_topk_matches_dense_on_3000_square_product: a k-th value moves by at most the largest
    # product_tol among the entries it is chosen from; a chosen entry by its own
    bound = product_tol(A, B)
    k_all = min(k, fm.ldim * fm.rdim)
    values, rows, cols = fm.topk(k_all, largest=largest, block_bytes=64)
    flat = bound.flatten(-2)
    assert_within(values, torch.topk(M.flatten(-2), k_all, largest=largest).values, flat.amax(-1, keepdim=True))
    at = rows * fm.rdim + cols
    assert_within(M.flatten(-2).gather(-1, at), values, flat.broadcast_to(at.shape[:-1] + flat.shape[-1:]).gather(-1, at))
    k_row = min(k, fm.rdim)
    row_values, row_cols = fm.topk_per_row(k_row, largest=largest, block_bytes=64)
    assert_within(row_values, torch.topk(M, k_row, dim=-1, largest=largest).values, bound.amax(-1, keepdim=True))
    assert_within(M.gather(-1, row_cols), row_values, bound.broadcast_to(M.shape).gather(-1, row_cols))
    k_col = min(k, fm.ldim)
    col_values, col_rows = fm.topk_per_col(k_col, largest=largest)
    assert_within(col_values, torch.topk(M.mT, k_col, dim=-1, largest=largest).values, bound.mT.amax(-1, keepdim=True))
    assert_within(M.mT.gather(-1, col_rows), col_values, bound.broadcast_to(M.shape).mT.gather(-1, col_rows))


# ------------------------------------------------------------------ TransformerLens oracle
def test_agrees_with_transformer_lens_factored_matrix():
    from transformer_lens import FactoredMatrix as TLFactoredMatrix

    gen = torch.Generator().manual_seed(3)
    W_V = torch.randn(2, 3, 32, 8, generator=gen, dtype=torch.float64)
    W_O = torch.randn(2, 3, 8, 32, generator=gen, dtype=torch.float64)
    ours, theirs = FactoredMatrix(W_V, W_O), TLFactoredMatrix(W_V, W_O)
    # float64 throughout: assert_close's float64 defaults (1e-7) and 1e-8 on the eigenvalues are far
    # above factorization_tol(32, ||W_V|| ||W_O||, float64) ~ 1e-11 of these 32 x 32 products
    torch.testing.assert_close(ours.norm(), theirs.norm())
    close_sets(ours.eigenvalues, theirs.eigenvalues, atol=1e-8)
    U, S, V = ours.svd()
    torch.testing.assert_close(S, theirs.S)
    # singular vectors are unique up to sign when singular values are distinct
    torch.testing.assert_close((U * theirs.U).sum(-2).abs(), torch.ones_like(S))
    torch.testing.assert_close((V * theirs.V).sum(-2).abs(), torch.ones_like(S))
    torch.testing.assert_close(ours.collapse_l().abs(), theirs.collapse_l().abs())


# ------------------------------------------------------------------ errors
def test_shape_mismatch_errors_name_both_shapes():
    with pytest.raises(ValueError, match=r"\(5, 3\).*\(4, 6\)"):
        FactoredMatrix(torch.randn(5, 3), torch.randn(4, 6))
    fm = FactoredMatrix(torch.randn(5, 3), torch.randn(3, 6))
    with pytest.raises(ValueError, match=r"\(5, 6\).*\(7, 2\)"):
        fm @ torch.randn(7, 2)
    with pytest.raises(ValueError, match=r"\(2, 4\).*\(5, 6\)"):
        torch.randn(2, 4) @ fm
    with pytest.raises(ValueError, match=r"\(2, 5, 3\).*\(4, 3, 6\)"):
        FactoredMatrix(torch.randn(2, 5, 3), torch.randn(4, 3, 6))
    with pytest.raises(TypeError, match="float64"):
        FactoredMatrix(torch.randn(5, 3), torch.randn(3, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"square.*\(5, 6\)"):
        fm.eigenvalues
    with pytest.raises(IndexError, match="entry\\(i, j\\)"):
        fm[0, 0, 0]  # fm[0] is row 0 (TransformerLens's indexing); three indices are too many


def test_dense_guard_names_shape_and_size(monkeypatch):
    fm = FactoredMatrix(torch.randn(50257, 64), torch.randn(64, 50257))
    with pytest.raises(MemoryError, match=r"\(50257, 50257\).*9\.41 GiB"):
        fm.AB
    small = FactoredMatrix(torch.randn(100, 4), torch.randn(4, 100))
    with pytest.raises(MemoryError, match=r"\(100, 100\).*0\.04 MiB"):
        small.dense(max_bytes=1000)
    monkeypatch.setattr(factored, "DENSE_LIMIT_BYTES", 1000)
    with pytest.raises(MemoryError):
        small.AB
    assert small.dense(max_bytes=math.inf).shape == (100, 100)


def test_norm_of_a_nearly_cancelling_product_falls_back_from_the_gram_route():
    # A's last column nearly repeats a mix of the others and B's rows follow that mix, so
    # ||AB|| ~ 1e-3 ||A|| ||B||: the float32 Gram route loses the result, the QR route does not
    g = torch.Generator().manual_seed(0)
    A = torch.randn(3, 300, 8, generator=g, dtype=torch.float64)
    c = torch.randn(3, 7, 1, generator=g, dtype=torch.float64)
    A[..., 7:] = A[..., :7] @ c + 1e-3 * torch.randn(3, 300, 1, generator=g, dtype=torch.float64)
    v = torch.cat([c, -torch.ones(3, 1, 1, dtype=torch.float64)], 1)  # A v ~ 1e-3
    B = v @ torch.randn(3, 1, 200, generator=g, dtype=torch.float64)
    A32, B32 = A.float(), B.float()
    truth = torch.linalg.matrix_norm(A32.double() @ B32.double())
    assert (truth / (torch.linalg.matrix_norm(A32.double()) * torch.linalg.matrix_norm(B32.double()))).max() < 1e-2
    gram = ((A32.mT @ A32) * (B32 @ B32.mT)).sum((-2, -1)).clamp_min(0).sqrt().double()
    assert ((gram - truth).abs() / truth).max() > 1e-2  # the plain Gram route is off here
    ours = FactoredMatrix(A32, B32).norm().double()
    # no norm-wise bound reaches below the result here (a backward error ~ u ||A|| ||B|| is 10^4 times
    # ||AB|| u): the QR route is held to what frobenius_norm_of_product promises, GRAM_REL_TOL
    torch.testing.assert_close(ours, truth, rtol=factored.GRAM_REL_TOL, atol=0)
    well = torch.randn(3, 300, 8, generator=g), torch.randn(3, 8, 200, generator=g)
    A, B = (w.double() for w in well)
    truth = torch.linalg.matrix_norm(A @ B)
    # the Gram route's worst case: A^T A and B B^T (m and n terms), their product and its k^2-term sum
    # are within gamma(m + n + 1 + k^2) of sum((|A|^T |A|) * (|B| |B|^T)) = || |A| |B| ||_F^2, and the
    # square root halves the relative error of ||AB||_F^2
    m, k, n = A.shape[-2], A.shape[-1], B.shape[-1]
    squares = (A.abs() @ B.abs()).square().sum((-2, -1))
    assert_within(FactoredMatrix(*well).norm(), truth, gamma(m + n + 1 + k * k) * squares / (2 * truth) + gamma(1) * truth)


# ------------------------------------------------------------------ leading dims through products
# Oracle: the dense float64 product of the same operands, by torch.matmul's broadcasting. Entries are
# sums of at most 5 x 5 products of N(0, 1) values (|entry| < ~50); float64 rounding of a chain of
# 4 factors is ~4 * 5 * eps * 50 ~ 1e-13, so assert_close's float64 default (1e-7) has room to spare.
def operand(rows, cols, lead, how, seed):
    """A float64 [*lead, rows, cols]: "expand": one random matrix broadcast as stride-0 views (as
    ``Tensor.expand`` and ``einops.repeat`` build them), "random": a different one per leading index."""
    g = torch.Generator().manual_seed(seed)
    if how == "expand":
        return torch.randn(rows, cols, generator=g, dtype=torch.float64).expand(*lead, rows, cols)
    return torch.randn(*lead, rows, cols, generator=g, dtype=torch.float64)


def product_case(kind, lead_left, lead_right, how):
    """``(FactoredMatrix product, dense product)``, a [..., 4, 4] square, inner dims 3, 5, 2 (fm @ fm)."""
    if kind == "fm@fm":
        A, B, C, D = (operand(*shape, lead, how, seed) for shape, lead, seed in
                      (((4, 3), lead_left, 1), ((3, 5), lead_left, 2), ((5, 2), lead_right, 3), ((2, 4), lead_right, 4)))
        return FactoredMatrix(A, B) @ FactoredMatrix(C, D), (A @ B) @ (C @ D)
    if kind == "fm@tensor":
        A, B, T = operand(4, 3, lead_left, how, 5), operand(3, 5, lead_left, how, 6), operand(5, 4, lead_right, how, 7)
        return FactoredMatrix(A, B) @ T, (A @ B) @ T
    T, C, D = operand(4, 4, lead_left, how, 8), operand(4, 3, lead_right, how, 9), operand(3, 4, lead_right, how, 10)
    return T @ FactoredMatrix(C, D), T @ (C @ D)


@pytest.mark.parametrize("kind", ["fm@fm", "fm@tensor", "tensor@fm"])
@pytest.mark.parametrize("how", ["expand", "random"])
@pytest.mark.parametrize("lead_left, lead_right", [((2,), ()), ((), (2,)), ((2, 9), (9,)), ((2, 1), (3,)), ((2,), (2,))])
def test_products_keep_broadcast_leading_dims_through_every_result(kind, how, lead_left, lead_right):
    P, dense = product_case(kind, lead_left, lead_right, how)
    lead = dense.shape[:-2]
    assert P.shape == dense.shape and P.ndim == dense.ndim
    assert P.A.shape[:-2] == P.B.shape[:-2] == lead
    torch.testing.assert_close(P.AB, dense)
    r = P.mdim
    U, S, V = P.svd()
    assert U.shape == (*lead, 4, r) and S.shape == (*lead, r) and V.shape == (*lead, 4, r)
    torch.testing.assert_close(U @ torch.diag_embed(S) @ V.mT, dense)
    torch.testing.assert_close(S, torch.linalg.svdvals(dense)[..., :r])
    torch.testing.assert_close(P.collapse_l(), S[..., :, None] * V.mT)
    torch.testing.assert_close(P.collapse_r(), U * S[..., None, :])
    assert P.collapse_l().shape == (*lead, r, 4) and P.collapse_r().shape == (*lead, 4, r)
    torch.testing.assert_close(P.norm(), torch.linalg.matrix_norm(dense))
    torch.testing.assert_close(P.trace(), dense.diagonal(dim1=-2, dim2=-1).sum(-1))
    eigs = P.eigenvalues
    assert eigs.shape == (*lead, r)
    dense_eigs = torch.linalg.eigvals(dense)  # rank r: r nonzero eigenvalues, the rest rounding noise
    top = dense_eigs.gather(-1, dense_eigs.abs().argsort(-1, descending=True)[..., :r])
    close_sets(eigs, top, atol=1e-8)
    for i in np.ndindex(*lead):  # every leading index reads its own matrix, as the dense product does
        torch.testing.assert_close(P[i].AB, dense[i])
        torch.testing.assert_close(P[i].eigenvalues, eigs[i])
        torch.testing.assert_close(P[i].S, S[i])


def test_the_issue_case_of_expanded_factors():
    a, b = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    fm = FactoredMatrix(a.expand(2, 4, 4), b.expand(2, 4, 4))
    for product in (fm @ fm, fm @ a, a @ fm):
        assert product.shape == (2, 4, 4)
        assert product.eigenvalues.shape == (2, 4)
        torch.testing.assert_close(product[1].AB, product.AB[1])
    torch.testing.assert_close((fm @ fm).AB[1], a @ b @ a @ b)


def test_products_whose_expanded_leading_dims_do_not_broadcast_are_refused():
    a, b = torch.randn(4, 3), torch.randn(3, 4)
    two, three = FactoredMatrix(a.expand(2, 4, 3), b), FactoredMatrix(a.expand(3, 4, 3), b)
    # the stored factors are [1, 4, 3]: the check must use the leading dims the matrices report
    for product in (lambda: two @ three, lambda: two @ torch.randn(3, 4, 4), lambda: torch.randn(3, 4, 4) @ two):
        with pytest.raises(ValueError, match=r"leading dims \((2|3),\) and \((3|2),\) do not broadcast"):
            product()
