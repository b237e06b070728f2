"""FactoredMatrix's TransformerLens API: every behaviour against TransformerLens's FactoredMatrix
on the same tensors and against dense float64 math; and where pcw differs on purpose, that it does."""

import numpy as np
import pytest
import torch
from transformer_lens import FactoredMatrix as TLFactoredMatrix

from pycircuits_widgets.factored import FactoredMatrix
from tolerance import factorization_tol, product_tol


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def both(A, B):
    return FactoredMatrix(A, B), TLFactoredMatrix(A, B)


def same_up_to_sign(ours, theirs):
    """Singular vectors (columns) agree up to a sign each (distinct singular values)."""
    torch.testing.assert_close((ours * theirs).sum(-2).abs(), torch.ones(ours.shape[:-2] + ours.shape[-1:], dtype=ours.dtype))


# ------------------------------------------------------------------ shape and broadcasting
def test_expanded_leading_dims_keep_their_size_and_index():
    a, b = randn(3, 4, seed=1), randn(4, 5, seed=2)
    ours, theirs = both(a.expand(2, 3, 4), b.expand(2, 4, 5))
    dense = (a @ b).expand(2, 3, 5)
    assert ours.shape == theirs.shape == (2, 3, 5)
    assert ours.ndim == theirs.ndim == 3 and ours.has_leading_dims and theirs.has_leading_dims
    torch.testing.assert_close(ours[1].AB, dense[1])
    torch.testing.assert_close(ours[1].AB, theirs[1].AB)
    torch.testing.assert_close(ours.AB, theirs.AB)
    assert ours.A.shape == theirs.A.shape == (2, 3, 4) and ours.B.shape == theirs.B.shape == (2, 4, 5)
    # results over the expanded dim: one per leading index, equal to TransformerLens's
    torch.testing.assert_close(ours.S, theirs.S)
    torch.testing.assert_close(ours.norm(), theirs.norm())
    assert ours.norm().shape == (2,)


def test_factors_read_back_broadcast_like_transformer_lens():
    W_E, W_V = randn(40, 8, seed=3), randn(2, 3, 8, 4, seed=4)  # a shared factor and per-head ones
    ours, theirs = both(W_E, W_V)
    assert ours.shape == theirs.shape == (2, 3, 40, 4)
    for o, t in zip(ours.pair, theirs.pair):
        assert o.shape == t.shape
        torch.testing.assert_close(o, t)
    assert ours.A.stride(0) == 0 and ours.A.data_ptr() == W_E.data_ptr()  # a view, not 6 copies
    assert not FactoredMatrix(W_E, W_E.T).has_leading_dims and not TLFactoredMatrix(W_E, W_E.T).has_leading_dims
    assert (ours.ldim, ours.mdim, ours.rdim) == (theirs.ldim, theirs.mdim, theirs.rdim) == (40, 8, 4)


# ------------------------------------------------------------------ indexing
A4, B4 = randn(2, 3, 6, 4, seed=5), randn(2, 3, 4, 7, seed=6)
M4 = A4 @ B4
# (index, the same selection on the dense product): int rows/columns keep a singleton dim, as in
# TransformerLens, and the pieces apply one after another
INDICES = [
    ((1,), lambda M: M[1]),
    ((1, 2), lambda M: M[1, 2]),
    ((1, 2, 3), lambda M: M[1, 2, 3:4]),
    ((1, 2, 3, 4), lambda M: M[1, 2, 3:4, 4:5]),
    ((..., 3, 4), lambda M: M[..., 3:4, 4:5]),
    ((..., -1, -1), lambda M: M[..., -1:, -1:]),
    ((..., 2), lambda M: M[..., 2:3]),
    ((slice(None), 0, slice(1, 4), [0, 2]), lambda M: M[:, 0][:, 1:4][..., [0, 2]]),
    ((0, slice(None), [5, 1]), lambda M: M[0][:, [5, 1]]),
    (([1, 0],), lambda M: M[[1, 0]]),
    ((torch.tensor([True, False]),), lambda M: M[torch.tensor([True, False])]),
    ((np.int64(1), torch.tensor(2)), lambda M: M[1, 2]),
    ((None, 1), lambda M: M[None, 1]),
    ((0, 1, None), lambda M: M[0, 1, None]),
    ((0, 1, slice(None), None, slice(None)), lambda M: M[0, 1][:, None, :]),
    ((..., None), lambda M: M[..., None]),
    ((0, ..., 2, None, 3), lambda M: M[0, ..., 2:3, None, 3:4]),
    ((), lambda M: M),
]


@pytest.mark.parametrize("idx, dense", INDICES, ids=[repr(i) for i, _ in INDICES])
def test_indexing_matches_dense_and_transformer_lens(idx, dense):
    ours, theirs = both(A4, B4)
    got = ours[idx]
    assert isinstance(got, FactoredMatrix)
    want = dense(M4)
    assert got.shape == want.shape
    torch.testing.assert_close(got.AB, want)
    torch.testing.assert_close(got.AB, theirs[idx].AB)


def test_indexing_refusals_where_transformer_lens_returns_wrong_or_empty_matrices():
    ours, theirs = both(A4, B4)
    assert theirs[0, 0, 6].shape[-2] == 0  # TransformerLens: an empty matrix for row 6 of 6
    with pytest.raises(IndexError, match="row index 6 is out of range"):
        ours[0, 0, 6]
    with pytest.raises(IndexError, match="column index -8 is out of range"):
        ours[..., 0, -8]
    with pytest.raises(IndexError, match="pair up entry by entry"):
        ours[0, 0, [1, 2], [3, 4]]  # torch: 2 entries; TransformerLens: the 2 x 2 block
    with pytest.raises(IndexError, match="pair up entry by entry"):
        ours[[0, 1], 0, [1, 2]]
    with pytest.raises(IndexError, match="2-D tensor"):
        ours[0, 0, torch.tensor([[0, 1]])]
    with pytest.raises(IndexError, match="span a leading and a matrix dim"):
        ours[0, torch.ones(3, 6, dtype=torch.bool)]
    with pytest.raises(IndexError, match="uses 5 dims"):
        ours[0, 0, 0, 0, 0]
    with pytest.raises(IndexError, match="single ellipsis"):
        ours[..., 0, ...]
    with pytest.raises(TypeError, match="not bool"):
        ours[True]
    with pytest.raises(TypeError, match="float"):
        ours[torch.tensor([0.5])]


def test_unsqueeze_matches_dense_and_transformer_lens():
    ours, theirs = both(A4, B4)
    for dim in range(-5, 5):
        torch.testing.assert_close(ours.unsqueeze(dim).AB, M4.unsqueeze(dim))
    for dim in range(3):  # TransformerLens's unsqueeze applies to the factors: leading positions only
        torch.testing.assert_close(ours.unsqueeze(dim).AB, theirs.unsqueeze(dim).AB)
    with pytest.raises(IndexError, match="-5..4"):
        ours.unsqueeze(5)


# ------------------------------------------------------------------ SVD, spectra, norm
@pytest.mark.parametrize("m, k, n", [(8, 8, 8), (9, 4, 7), (3, 6, 5)])
def test_svd_has_transformer_lens_convention(m, k, n):
    A, B = randn(2, m, k, seed=7), randn(2, k, n, seed=8)
    ours, theirs = both(A, B)
    M = A @ B
    U, S, V = ours.svd()
    tU, tS, tV = theirs.svd()
    r = min(m, k, n)
    assert U.shape == tU.shape == (2, m, r) and V.shape == tV.shape == (2, n, r) and S.shape == tS.shape
    torch.testing.assert_close(U @ torch.diag_embed(S) @ V.mT, M)  # TransformerLens's identity
    torch.testing.assert_close(S, torch.linalg.svdvals(M)[..., :r])
    torch.testing.assert_close(S, tS)
    same_up_to_sign(U, tU)
    same_up_to_sign(V, tV)
    assert ours.U is U and ours.S is S and ours.V is V  # cached, as TransformerLens caches it
    with pytest.warns(DeprecationWarning, match="returns V"):
        Vh = ours.Vh
    with pytest.warns(DeprecationWarning):
        tVh = theirs.Vh
    assert Vh is V and Vh.shape == tVh.shape  # TransformerLens's Vh is V too
    torch.testing.assert_close(ours.collapse_l().abs(), theirs.collapse_l().abs())
    torch.testing.assert_close(ours.collapse_r().abs(), theirs.collapse_r().abs())
    even = ours.make_even()
    torch.testing.assert_close(even.AB, M)
    torch.testing.assert_close(even.A.abs(), theirs.make_even().A.abs())
    torch.testing.assert_close(even.A.mT @ even.A, torch.diag_embed(S))  # orthogonal, sqrt(S) each


def test_svd_of_an_8x8_case_is_not_off_by_the_old_vh_convention():
    # the case: ported code wrote U @ diag(S) @ V.T and got an error of 11.8 from Vh
    A, B = randn(8, 8, seed=9), randn(8, 8, seed=10)
    U, S, V = FactoredMatrix(A, B).svd()
    assert torch.dist(U @ torch.diag(S) @ V.T, A @ B) < 1e-10
    assert torch.dist(U @ torch.diag(S) @ V, A @ B) > 1  # (V itself, not V.T, does not rebuild M)


@pytest.mark.parametrize("m, k", [(9, 4), (4, 9), (6, 6)])
def test_eigenvalues_count_matches_transformer_lens(m, k):
    A, B = randn(3, m, k, seed=11), randn(3, k, m, seed=12)
    ours, theirs = both(A, B)
    got, want = ours.eigenvalues, theirs.eigenvalues
    assert got.shape == want.shape == (3, k)
    dense = torch.linalg.eigvals(A @ B)
    r = min(m, k)
    top = dense.gather(-1, dense.abs().argsort(-1, descending=True)[..., :r])
    # as sets: the first r are the dense product's nonzero eigenvalues; all k are TransformerLens's
    # (its extra k - m are rounding noise around 0 where ours are exact zeros)
    for ours_, ref in ((got[..., :r], top), (got, want)):
        dist = (ours_[..., :, None] - ref[..., None, :]).abs()
        assert dist.min(-1).values.max() < 1e-8 and dist.min(-2).values.max() < 1e-8
    assert torch.equal(got[..., r:], torch.zeros_like(got[..., r:]))


def test_norm_trace_ba_corner_transpose_match_transformer_lens():
    A, B = randn(2, 3, 9, 4, seed=13), randn(2, 3, 4, 9, seed=14)
    ours, theirs = both(A, B)
    M = A @ B
    torch.testing.assert_close(ours.norm(), theirs.norm())
    torch.testing.assert_close(ours.norm(), torch.linalg.matrix_norm(M))
    torch.testing.assert_close(ours.BA, theirs.BA)
    torch.testing.assert_close(ours.T.AB, theirs.T.AB)
    for k in (2, 3, 20):
        torch.testing.assert_close(ours.get_corner(k), theirs.get_corner(k))
        torch.testing.assert_close(ours.get_corner(k), M[:k, :k, :k, :k])
    torch.testing.assert_close((2.5 * ours).AB, (2.5 * theirs).AB)
    torch.testing.assert_close((ours * torch.tensor(3.0, dtype=torch.float64)).AB, 3 * M)


# ------------------------------------------------------------------ products
def test_products_match_transformer_lens_and_keep_the_same_inner_dim():
    A, B = randn(2, 9, 4, seed=15), randn(2, 4, 7, seed=16)
    ours, theirs = both(A, B)
    M = A @ B
    right, left = randn(7, 5, seed=17), randn(6, 9, seed=18)
    other = (randn(7, 3, seed=19), randn(3, 8, seed=20))
    cases = [
        (ours @ right, theirs @ right, M @ right),
        (left @ ours, left @ theirs, left @ M),
        (ours @ FactoredMatrix(*other), theirs @ TLFactoredMatrix(*other), M @ (other[0] @ other[1])),
    ]
    for got, tl, dense in cases:
        assert isinstance(got, FactoredMatrix) and got.mdim == tl.mdim
        torch.testing.assert_close(got.AB, dense)
        torch.testing.assert_close(got.AB, tl.AB)
    batched = randn(3, 1, 7, 5, seed=26)  # leading dims broadcast against the factors' [2]
    got, tl = ours @ batched, theirs @ batched
    assert got.shape == tl.shape == (3, 2, 9, 5) and got.mdim == tl.mdim
    torch.testing.assert_close(got.AB, M @ batched)
    torch.testing.assert_close(got.AB, tl.AB)
    v, w = randn(7, seed=21), randn(9, seed=22)
    torch.testing.assert_close(ours @ v, theirs @ v)
    torch.testing.assert_close(ours @ v, M @ v)
    torch.testing.assert_close(w @ ours, w @ theirs)
    torch.testing.assert_close(w @ ours, w @ M)


class TensorLike:
    """A duck type satisfying TransformerLens's TensorLike protocol, exposing ``__array__`` too."""

    def __init__(self, t):
        self.t = t

    ndim = property(lambda self: self.t.ndim)
    shape = property(lambda self: self.t.shape)

    def size(self, dim):
        return self.t.size(dim)

    def unsqueeze(self, dim):
        return TensorLike(self.t.unsqueeze(dim))

    def squeeze(self, dim):
        return TensorLike(self.t.squeeze(dim))

    def broadcast_to(self, shape):
        return TensorLike(self.t.broadcast_to(shape))

    def __matmul__(self, other):
        return TensorLike(self.t @ (other.t if isinstance(other, TensorLike) else other))

    def __array__(self, dtype=None, copy=None):
        return self.t.numpy()


class ProtocolOnly(TensorLike):
    __array__ = None  # the protocol's methods, no way to read the numbers


def test_tensor_like_operands_where_transformer_lens_takes_them():
    A, B, C = randn(9, 4, seed=23), randn(4, 7, seed=24), randn(7, 5, seed=25)
    ours = FactoredMatrix(TensorLike(A), TensorLike(B))
    theirs = TLFactoredMatrix(TensorLike(A), TensorLike(B))
    torch.testing.assert_close(ours.AB, torch.as_tensor(np.asarray(theirs.AB)))
    torch.testing.assert_close((ours @ TensorLike(C)).AB, A @ B @ C)
    torch.testing.assert_close((ours @ TensorLike(C)).AB, torch.as_tensor(np.asarray((theirs @ TensorLike(C)).AB)))
    torch.testing.assert_close(ours.norm(), torch.linalg.matrix_norm(A @ B))  # every method, not only @
    # numpy arrays (TransformerLens cannot: ndarray.size is not a method), on either side of @
    nA, nC = A.numpy(), C.numpy()
    torch.testing.assert_close(FactoredMatrix(nA, B).AB, A @ B)
    torch.testing.assert_close((ours @ nC).AB, A @ B @ C)
    torch.testing.assert_close((nA.T @ FactoredMatrix(A, B)).AB, A.T @ A @ B)
    with pytest.raises(TypeError, match="array-like"):
        FactoredMatrix(ProtocolOnly(A), B)  # TransformerLens keeps it; pcw needs the numbers
    with pytest.raises(TypeError, match="array-like"):
        FactoredMatrix([[1.0]], [[2.0]])
    with pytest.raises(TypeError):
        ours @ "W_U"


# ------------------------------------------------------------------ dtypes
def test_mixed_dtypes_are_refused_naming_both_where_transformer_lens_fails_in_matmul():
    a32, b64 = randn(5, 3, dtype=torch.float32), randn(3, 6)
    with pytest.raises(RuntimeError):
        TLFactoredMatrix(a32, b64).AB  # builds, then torch.matmul refuses: no promotion there either
    with pytest.raises(TypeError, match="float32.*float64"):
        FactoredMatrix(a32, b64)
    fm32 = FactoredMatrix(a32, b64.float())
    with pytest.raises(TypeError, match="float64.*float32.*no promotion"):
        fm32 @ randn(6, 2)
    with pytest.raises(TypeError, match=r"cannot multiply shape \(5, 6\) by shape \(6, 4\).*float64"):
        fm32 @ FactoredMatrix(randn(6, 2), randn(2, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_spectra_norms_and_svd_run_in_float32(dtype):
    A, B = randn(3, 12, 4, seed=26).to(dtype), randn(3, 4, 12, seed=27).to(dtype)
    ours, theirs = both(A, B)
    ref = FactoredMatrix(A.float(), B.float())  # the same (rounded) numbers in float32
    U, S, V = ours.svd()
    assert U.dtype == S.dtype == V.dtype == torch.float32
    torch.testing.assert_close(S, ref.S)
    torch.testing.assert_close(S, theirs.S)  # TransformerLens upcasts its SVD too
    # a float32 SVD of the product of the same (16-bit) numbers: LAPACK's residual bound on its norm
    exact = A.double() @ B.double()
    residual = (U.double() @ torch.diag_embed(S.double()) @ V.double().mT - exact).abs().amax((-2, -1))
    assert (residual <= factorization_tol(12, 1.0) * torch.linalg.matrix_norm(exact)).all()
    assert ours.norm().dtype == torch.float32
    torch.testing.assert_close(ours.norm(), torch.linalg.matrix_norm(A.double() @ B.double()).float())
    eigs = ours.eigenvalues
    assert eigs.dtype == torch.complex64
    # against float64 eig of the same numbers; TransformerLens forms BA in 16 bits before its
    # upcast and is off by ~1e-2 here, so it is no oracle for the values
    # Bauer-Fike: a perturbation E of BA moves each eigenvalue by at most cond(X) ||E||_2 (X its
    # eigenvectors). E: forming BA in float32 (product_tol) plus the float32 eigensolver's backward
    # error (factorization_tol). Forming BA in 16 bits, as TransformerLens does, misses by ~1e-2.
    BA = B.double() @ A.double()
    exact, X = torch.linalg.eig(BA)
    E = torch.linalg.matrix_norm(product_tol(B.float(), A.float(), computations=1)) \
        + factorization_tol(4, 1.0) * torch.linalg.matrix_norm(BA, 2)
    bound = torch.linalg.cond(X) * E  # [3]
    dist = (eigs.to(torch.complex128)[..., :, None] - exact[..., None, :]).abs()
    assert (dist.min(-1).values.amax(-1) <= bound).all() and (dist.min(-2).values.amax(-1) <= bound).all()
    assert theirs.eigenvalues.shape == eigs.shape


# ------------------------------------------------------------------ device
def test_results_stay_on_the_factors_device_meta():
    """No CPU tensor is created on the way: every result of factors on the ``meta`` device is on ``meta``."""
    A, B = torch.empty(2, 6, 3, device="meta"), torch.empty(2, 3, 6, device="meta")
    fm = FactoredMatrix(A, B)
    results = [fm.AB, fm.BA, *fm.svd(), fm.eigenvalues, fm.norm(), fm.trace(), fm.row(1), fm.entry(0, 1),
               fm[0, 1:3, [1]].AB, fm[[1, 0]].A, (fm @ fm).AB, fm.make_even().A, fm.get_corner(), fm.unsqueeze(3).B,
               fm @ torch.empty(6, device="meta")]
    assert all(r.device.type == "meta" for r in results)
    assert fm.eigenvalues.shape == (2, 3) and fm.svd()[2].shape == (2, 6, 3)


# ------------------------------------------------------------------ TransformerLens's own test behaviours
# Each behaviour TransformerLens's tests/unit/factored_matrix checks, on our own cases, against its
# FactoredMatrix and float64 dense math (float64 throughout: entries < ~50, products of <= 4 factors
# of width <= 9 round at ~1e-13, inside assert_close's float64 default of 1e-7).
INNER_SHAPES = [  # ((m, k), (k, n)) of the left operand, ((n, k2), (k2, p)) of the right: ones and every order
    (((3, 3), (3, 3)), ((3, 3), (3, 3))),
    (((1, 1), (1, 1)), ((1, 1), (1, 1))),
    (((1, 4), (4, 1)), ((1, 6), (6, 1))),
    (((1, 2), (2, 3)), ((3, 2), (2, 4))),
    (((5, 2), (2, 1)), ((1, 1), (1, 1))),
    (((3, 4), (4, 5)), ((5, 6), (6, 7))),
    (((8, 6), (6, 5)), ((5, 7), (7, 3))),
    (((7, 6), (6, 3)), ((3, 7), (7, 8))),
]
LEAD_FORMS = [((), ()), ((2,), ()), ((), (2,)), ((2, 9), (9,))]  # as einops.repeat builds them: stride-0


@pytest.mark.parametrize("left_lead, right_lead", LEAD_FORMS)
@pytest.mark.parametrize("left, right", INNER_SHAPES)
def test_factored_products_of_repeated_factors_match_transformer_lens(left, right, left_lead, right_lead):
    (a, b), (c, d) = ([randn(*s, seed=10 * i + j).expand(*lead, *s) for j, s in enumerate(pair)]
                      for i, (pair, lead) in enumerate(((left, left_lead), (right, right_lead))))
    ours, theirs = FactoredMatrix(a, b) @ FactoredMatrix(c, d), TLFactoredMatrix(a, b) @ TLFactoredMatrix(c, d)
    dense = (a @ b) @ (c @ d)
    torch.testing.assert_close(ours.AB, dense)
    torch.testing.assert_close(ours.AB, theirs.AB)
    assert ours.shape == theirs.shape == dense.shape
    assert (ours.ldim, ours.mdim, ours.rdim) == (theirs.ldim, theirs.mdim, theirs.rdim)
    assert ours.mdim == min(left[0][1], left[1][1], right[0][1])  # split at the chain's narrowest inner dim
    assert ours.A.shape[:-2] == ours.B.shape[:-2] == theirs.A.shape[:-2] == dense.shape[:-2]


@pytest.mark.parametrize("fm_lead, tensor_lead", [((), ()), ((2,), ()), ((), (2, 12)), ((2,), (2,))])
@pytest.mark.parametrize("k, side", [(3, "right"), (6, "right"), (4, "right"), (3, "left"), (6, "left"), (2, "left")])
def test_tensor_products_of_repeated_operands_match_transformer_lens(k, side, fm_lead, tensor_lead):
    a, b = randn(2, k, seed=1).expand(*fm_lead, 2, k), randn(k, 2, seed=2).expand(*fm_lead, k, 2)
    t = randn(2, 5 if side == "right" else 2, seed=3)
    t = (t if side == "right" else t.T).expand(*tensor_lead, *(t.shape if side == "right" else t.T.shape))
    ours, theirs = FactoredMatrix(a, b), TLFactoredMatrix(a, b)
    got, tl = (ours @ t, theirs @ t) if side == "right" else (t @ ours, t @ theirs)
    dense = (a @ b) @ t if side == "right" else t @ (a @ b)
    torch.testing.assert_close(got.AB, dense)
    torch.testing.assert_close(got.AB, tl.AB)
    assert got.mdim == tl.mdim == min(k, 2) and got.shape == tl.shape == dense.shape
    assert got.A.shape[:-2] == got.B.shape[:-2] == dense.shape[:-2]


@pytest.mark.parametrize("lead", [(), (6,)])
def test_vector_products_on_both_sides(lead):
    a, b = randn(*lead, 2, 3, seed=1), randn(*lead, 3, 4, seed=2)
    fm, v, w = FactoredMatrix(a, b), randn(4, seed=3), randn(2, seed=4)
    torch.testing.assert_close(fm @ v, (a @ b) @ v)
    torch.testing.assert_close(fm @ v, TLFactoredMatrix(a, b) @ v)
    # vector @ fm: TransformerLens's squeeze(-1) leaves [..., 1, n] here (its tests skip this case)
    assert (w @ fm).shape == (*lead, 4)
    torch.testing.assert_close(w @ fm, w @ (a @ b))


@pytest.mark.parametrize("scalar", [torch.tensor([0.7], dtype=torch.float64), 0.3, 4])
@pytest.mark.parametrize("lead", [(), (6,)])
def test_scalar_multiples_on_both_sides(scalar, lead):
    a, b = randn(*lead, 2, 3, seed=1), randn(*lead, 3, 4, seed=2)
    fm = FactoredMatrix(a, b)
    for product in (fm * scalar, scalar * fm):
        torch.testing.assert_close(product.AB, (a @ b) * scalar)
        torch.testing.assert_close(product.AB, (TLFactoredMatrix(a, b) * scalar).AB)


SQUARE_AND_NOT = [(3, 2, 3), (4, 5, 4), (6, 7, 6), (6, 7, 3)]  # (m, k, n)


@pytest.mark.parametrize("m, k, n", SQUARE_AND_NOT)
def test_properties_match_transformer_lens(m, k, n):
    a, b = randn(m, k, seed=m), randn(k, n, seed=n + 10)
    ours, theirs = both(a, b)
    assert ours.ndim == theirs.ndim == len(ours.shape) == 2
    assert torch.equal(ours.pair[0], a) and torch.equal(ours.pair[1], b) and torch.equal(ours.A, a)
    torch.testing.assert_close(ours.AB, a @ b)
    torch.testing.assert_close(ours.T.A, b.T)
    torch.testing.assert_close(ours.T.B, a.T)
    torch.testing.assert_close(ours.norm(), (a @ b).norm())
    torch.testing.assert_close(ours.get_corner(3), theirs.get_corner(3))
    U, S, V = ours.svd()
    torch.testing.assert_close(U @ torch.diag(S) @ V.T, a @ b)
    r = U.shape[-1]
    torch.testing.assert_close(U.T @ U, torch.eye(r, dtype=U.dtype))
    torch.testing.assert_close(V.T @ V, torch.eye(r, dtype=V.dtype))
    torch.testing.assert_close(ours.collapse_l(), S[:, None] * V.T)
    torch.testing.assert_close(ours.collapse_r(), U * S[None, :])
    if m == n:
        torch.testing.assert_close(ours.BA, theirs.BA)
    else:  # TransformerLens: AssertionError
        with pytest.raises(ValueError, match=r"BA needs a square matrix \(m == n\), got shape"):
            ours.BA
        with pytest.raises(ValueError, match=r"eigenvalues needs a square matrix"):
            ours.eigenvalues
        with pytest.raises(AssertionError):
            theirs.BA


def test_svd_with_leading_ones_is_cached_and_does_not_keep_its_matrix_alive():
    import gc
    import weakref

    fm = FactoredMatrix(randn(1, 8, 9, seed=1), randn(1, 9, 8, seed=2))
    U, S, V = fm.svd()
    torch.testing.assert_close(U @ torch.diag_embed(S) @ V.mT, fm.AB)
    torch.testing.assert_close(U.mT @ U, torch.eye(8, dtype=U.dtype).expand(1, 8, 8))
    assert all(x is y for x, y in zip(fm.svd(), (U, S, V)))  # the same tensors, not recomputed
    unsqueezed = FactoredMatrix(fm.A.unsqueeze(0), fm.B.unsqueeze(0))
    assert unsqueezed.shape == (1, 1, 8, 8) and torch.equal(unsqueezed.A, fm.A.unsqueeze(0))
    ref = weakref.ref(fm)
    del fm, unsqueezed
    gc.collect()
    assert ref() is None  # the cache lives on the instance, not in a global keyed by it


def test_eigenvalue_order_is_transformer_lens_order_where_k_is_at_most_m():
    # k <= m: both eig(BA), so the same values at the same places (TransformerLens's own test compares
    # |eigenvalues| entry by entry); m < k: ours lists eig(AB), then exact zeros (docstring)
    for m, k in ((3, 2), (6, 6), (9, 4)):
        ours, theirs = both(randn(2, m, k, seed=m), randn(2, k, m, seed=k + 20))
        torch.testing.assert_close(ours.eigenvalues, theirs.eigenvalues)
        torch.testing.assert_close(ours.eigenvalues, torch.linalg.eigvals(ours.B @ ours.A))
    a, b = randn(4, 5, seed=1), randn(5, 4, seed=2)
    ours, theirs = both(a, b)
    torch.testing.assert_close(ours.eigenvalues[:4], torch.linalg.eigvals(a @ b))
    assert ours.eigenvalues[4] == 0
    dist = (ours.eigenvalues[:, None] - theirs.eigenvalues[None, :]).abs()
    assert dist.min(0).values.max() < 1e-8 and dist.min(1).values.max() < 1e-8  # the same set


def test_16_bit_eigenvalues_are_complex64_near_float32_ones():
    for m, k in ((3, 2), (10, 4)):
        a, b = randn(m, k, seed=m).to(torch.bfloat16), randn(k, m, seed=k).to(torch.bfloat16)
        eigs = FactoredMatrix(a, b).eigenvalues
        assert eigs.dtype == torch.complex64
        # the same rounded bf16 numbers in float32: only float32 rounding separates them (k <= m: same order)
        torch.testing.assert_close(eigs, torch.linalg.eigvals(b.float() @ a.float()))


def test_constructor_broadcasts_either_factor_and_refuses_a_mismatch():
    for A in (torch.ones(5, 3, dtype=torch.float64), torch.ones(4, 5, 3, dtype=torch.float64)):
        B = torch.ones(2, 4, 3, 7, dtype=torch.float64)
        ours, theirs = both(A, B)
        assert ours.shape == theirs.shape == (2, 4, 5, 7) and ours.A.shape == theirs.A.shape == (2, 4, 5, 3)
        assert torch.equal(ours.B, B) and ours.has_leading_dims
    with pytest.raises(RuntimeError, match="[Mm]ismatch"):
        TLFactoredMatrix(torch.ones(9, 5, 3), torch.ones(2, 4, 3, 7))
    with pytest.raises(ValueError, match=r"leading dims do not broadcast between factor shapes \(9, 5, 3\), \(2, 4, 3, 7\)"):
        FactoredMatrix(torch.ones(9, 5, 3), torch.ones(2, 4, 3, 7))


# TransformerLens raises AssertionError/RuntimeError/ValueError here; pcw a ValueError or IndexError naming the shapes
CLEARER_ERRORS = [
    (lambda F: F(randn(2, 3, 4), randn(2, 4, 6)) @ F(randn(4, 6, 7), randn(4, 7, 2)), RuntimeError,
     ValueError, r"cannot multiply shape \(2, 3, 6\) by shape \(4, 6, 2\).*do not broadcast"),
    (lambda F: F(randn(2, 9, 3, 4), randn(2, 9, 4, 6)) @ F(randn(2, 6, 7), randn(2, 7, 2)), RuntimeError,
     ValueError, r"cannot multiply shape \(2, 9, 3, 6\) by shape \(2, 6, 2\).*do not broadcast"),
    (lambda F: F(randn(3, 4), randn(4, 6)) @ F(randn(5, 6), randn(6, 7)), AssertionError,
     ValueError, r"cannot multiply shape \(3, 6\) by shape \(5, 7\)"),
    (lambda F: F(randn(3, 4), randn(4, 6)) @ F(randn(2, 5, 6), randn(2, 6, 7)), AssertionError,
     ValueError, r"cannot multiply shape \(3, 6\) by shape \(2, 5, 7\)"),
    (lambda F: F(randn(2, 3), randn(3, 4)) * randn(2, 2), AssertionError, ValueError, r"needs a scalar, got shape \(2, 2\)"),
    (lambda F: randn(2) * F(randn(6, 2, 3), randn(6, 3, 4)), AssertionError, ValueError, r"needs a scalar, got shape \(2,\)"),
    (lambda F: F(randn(5, 2), randn(2, 7))[..., 0, 0, 0], ValueError, IndexError, r"uses 3 dims.*has 2"),
]


@pytest.mark.parametrize("make, theirs, ours, match", CLEARER_ERRORS, ids=[
    "fm@fm leading 2 vs 4", "fm@fm leading (2, 9) vs 2", "fm@fm inner", "fm@fm inner with batch", "fm * matrix",
    "vector * fm", "index too long"])
def test_clearer_exceptions_where_transformer_lens_asserts(make, theirs, ours, match):
    with pytest.raises(theirs):
        make(TLFactoredMatrix)
    with pytest.raises(ours, match=match):
        make(FactoredMatrix)


class ProtocolOnlyLike:
    """TransformerLens's TensorLike protocol (shape, ndim, size, unsqueeze, squeeze, broadcast_to, @)
    and nothing to read the numbers through."""

    def __init__(self, t):
        self.t = t

    ndim = property(lambda self: self.t.ndim)
    shape = property(lambda self: self.t.shape)

    def size(self, dim=None):
        return self.t.size() if dim is None else self.t.size(dim)

    def unsqueeze(self, dim):
        return ProtocolOnlyLike(self.t.unsqueeze(dim))

    def squeeze(self, dim):
        return ProtocolOnlyLike(self.t.squeeze(dim))

    def broadcast_to(self, shape):
        return ProtocolOnlyLike(self.t.broadcast_to(shape))

    def __matmul__(self, other):
        return NotImplemented if isinstance(other, (FactoredMatrix, TLFactoredMatrix)) else ProtocolOnlyLike(self.t @ other)

    def __rmatmul__(self, other):
        return ProtocolOnlyLike(other @ self.t)


def test_protocol_only_operands_are_refused_by_name_on_either_side_of_matmul():
    a, b = randn(2, 3, seed=1), randn(3, 4, seed=2)
    ours, theirs = both(a, b)
    assert isinstance(theirs @ ProtocolOnlyLike(randn(4, 5, seed=3)), TLFactoredMatrix)  # TransformerLens takes it
    for product in (lambda: ours @ ProtocolOnlyLike(randn(4, 5)), lambda: ProtocolOnlyLike(randn(5, 2)) @ ours,
                    lambda: ours @ ProtocolOnlyLike(randn(4))):
        with pytest.raises(TypeError, match="by a ProtocolOnlyLike: it has a shape but no array protocol"):
            product()
    with pytest.raises(TypeError, match="A must be a torch.Tensor or an array-like.*got ProtocolOnlyLike"):
        FactoredMatrix(ProtocolOnlyLike(a), b)


# ------------------------------------------------------------------ indexing as TransformerLens's tests do it
A_MASKED, B_MASKED = randn(2, 3, 5, 2, seed=30), randn(2, 3, 2, 7, seed=31)
MASK_1D, MASK_2D = torch.tensor([True, False]), torch.tensor([[True, False, True], [False, True, False]])


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
@pytest.mark.parametrize("index, matrix_index", [
    ((...,), (slice(None), slice(None))),
    ((..., 1), (slice(None), slice(1, 2))),
    ((..., -1), (slice(None), slice(-1, None))),
    ((..., 1, slice(None)), (slice(1, 2), slice(None))),
    ((..., -1, slice(None)), (slice(-1, None), slice(None))),
    ((..., slice(1, 4), slice(2, 6)), (slice(1, 4), slice(2, 6))),
    ((None, ..., slice(1, 4), slice(None)), (slice(1, 4), slice(None))),
    ((..., torch.tensor([1, 4])), (slice(None), torch.tensor([1, 4]))),
    ((..., torch.tensor([1, 3]), slice(None)), (torch.tensor([1, 3]), slice(None))),
])
def test_ellipsis_indices_match_the_dense_product(lead, index, matrix_index, monkeypatch):
    fm = FactoredMatrix(randn(*lead, 5, 2, seed=32), randn(*lead, 2, 7, seed=33))
    prefix = ((None,) if index[0] is None else ()) + (slice(None),) * len(lead)
    want = (fm.A @ fm.B)[prefix + matrix_index]
    monkeypatch.setattr(FactoredMatrix, "dense", lambda *_: pytest.fail("indexing formed the product"))
    got = fm[index]
    monkeypatch.undo()
    assert isinstance(got, FactoredMatrix) and got.mdim == 2  # still factored, same inner dim
    torch.testing.assert_close(got.AB, want)
    torch.testing.assert_close(got.AB, TLFactoredMatrix(fm.A, fm.B)[index].AB)


@pytest.mark.parametrize("form", ["tensor", "numpy", "list", "tuple"])
@pytest.mark.parametrize("mask", [MASK_1D, MASK_2D], ids=["1-D", "2-D"])
def test_bool_masks_of_every_form_select_leading_dims(mask, form):
    fm = FactoredMatrix(A_MASKED, B_MASKED)
    selected = (A_MASKED @ B_MASKED)[mask]
    written = {"tensor": mask, "numpy": mask.numpy(), "list": mask.tolist(),
               "tuple": tuple(map(tuple, mask.tolist())) if mask.ndim == 2 else tuple(mask.tolist())}[form]
    cases = [((written, ...), selected), ((written, ..., 1), selected[..., 1:2]),
             ((written, ..., 1, slice(None)), selected[..., 1:2, :]),
             ((written, *[slice(None)] * (3 - mask.ndim), 1), selected[..., 1:2]),
             ((None, written, ..., 1), selected[None, ..., 1:2])]
    for index, want in cases:
        got = fm[index]
        assert got.mdim == fm.mdim
        torch.testing.assert_close(got.AB, want)


@pytest.mark.parametrize("as_numpy", [False, True])
def test_uint8_masks_read_as_bool_with_torchs_warning(as_numpy):
    fm = FactoredMatrix(A_MASKED, B_MASKED)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.uint8)
    with pytest.warns(UserWarning, match="uint8"):
        got = fm[mask.numpy() if as_numpy else mask, ...]
    torch.testing.assert_close(got.AB, (A_MASKED @ B_MASKED)[mask.bool()])


@pytest.mark.parametrize("index", [[1, 0], (1, 0), [[1, 0], [0, 1]], ((1, 0), (0, 1))])
def test_an_integer_sequence_indexes_one_leading_dim(index):
    fm = FactoredMatrix(A_MASKED, B_MASKED)
    want = (A_MASKED @ B_MASKED)[torch.tensor(index), ..., 1:2]
    torch.testing.assert_close(fm[index, ..., 1].AB, want)


def test_a_tensor_leading_index_then_ellipsis_then_a_column():
    a, b = randn(3, 5, 2, seed=34), randn(3, 2, 7, seed=35)
    heads = torch.tensor([2, 0])
    torch.testing.assert_close(FactoredMatrix(a, b)[heads, ..., 1].AB, (a @ b)[heads, :, 1:2])


def test_leading_ints_and_single_entries_as_transformer_lens_reads_them():
    a, b = randn(2, 2, 2, 2, 2, seed=40), randn(2, 2, 2, 2, 2, seed=41)
    ours, theirs = both(a, b)
    M = a @ b
    for idx in [0, (0, 1), (slice(None), 1), (slice(None), slice(None), 1)]:
        torch.testing.assert_close(ours[idx].A, theirs[idx].A)
        torch.testing.assert_close(ours[idx].B, theirs[idx].B)
    for idx in [(0, 0, 0, 1), (0, 0, 0, 0, 1), (0, 0, 0, -1), (0, 0, 0, 0, -1), (0, 0, 0, -1, -1)]:
        torch.testing.assert_close(ours[idx].AB.squeeze(), M[idx])
    torch.testing.assert_close(ours[:, :, :, [0, 1], 0].B.squeeze(-1), b[:, :, :, :, 0])
    torch.testing.assert_close(FactoredMatrix(a[0, 0, 0], b[0, 0, 0])[1, ..., 0].AB, M[0, 0, 0, 1:2, 0:1])
    for idx in [(1, 1, 1, 1, 1, 1), (..., ...)]:
        with pytest.raises(IndexError):
            ours[idx]
