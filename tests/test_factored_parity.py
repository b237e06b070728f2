"""FactoredMatrix's TransformerLens API: every behaviour against TransformerLens's FactoredMatrix
on the same tensors and against dense float64 math; and where pcw differs on purpose, that it does."""

import numpy as np
import pytest
import torch
from transformer_lens import FactoredMatrix as TLFactoredMatrix

from pycircuits_widgets.factored import FactoredMatrix


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
    torch.testing.assert_close(U @ torch.diag_embed(S) @ V.mT, A.double() @ B.double(), rtol=1e-5, atol=1e-5, check_dtype=False)
    assert ours.norm().dtype == torch.float32
    torch.testing.assert_close(ours.norm(), torch.linalg.matrix_norm(A.double() @ B.double()).float())
    eigs = ours.eigenvalues
    assert eigs.dtype == torch.complex64
    # against float64 eig of the same numbers; TransformerLens forms BA in 16 bits before its
    # upcast and is off by ~1e-2 here, so it is no oracle for the values
    exact = torch.linalg.eigvals(B.double() @ A.double())
    dist = (eigs.to(torch.complex128)[..., :, None] - exact[..., None, :]).abs()
    assert dist.min(-1).values.max() < 1e-4 and dist.min(-2).values.max() < 1e-4
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
