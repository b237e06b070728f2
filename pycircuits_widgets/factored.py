"""FactoredMatrix: a low-rank product ``A @ B`` kept unmultiplied.

``FactoredMatrix(A, B)`` stands for ``M = A [..., m, k] @ B [..., k, n]``; leading dims
(e.g. ``[n_layers, n_heads]``) broadcast between ``A`` and ``B`` as in ``torch.matmul``.
Everything here avoids forming the ``[m, n]`` product unless asked (``.dense()``), which
is guarded by a size limit because a GPT-2 vocab x vocab circuit is 10 GB.

Module-level helpers work on chains of several factors ``X1 @ X2 @ ... @ Xr``:
``frobenius_norm_of_product`` (QR or Gram route, never the cyclic-permutation erratum),
``eigenvalues_of_product`` (nonzero spectrum through the smallest cyclic rotation) and
``chain_matmul`` (cheapest multiplication order, aware of broadcast leading dims, so a
factor shared by all heads is multiplied once).

Conventions: row vectors (``x @ W``); device follows the inputs and so does dtype, except
that the spectra, norms and SVDs of 16-bit factors are computed and returned in float32
(``linalg_dtype``). Their LAPACK calls go through ``linalg``, which refuses NaN/inf input with
``NonFiniteError`` (on Intel oneMKL such a call aborts the process). ``FactoredMatrix.svd()``
returns ``(U, S, V)`` with ``M = U diag(S) V^T``, TransformerLens's convention, NOT
``torch.linalg.svd``'s ``(U, S, Vh)``.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from itertools import pairwise
from itertools import product as _index_product

import numpy as np
import torch

from . import linalg, screen
from .linalg import linalg_dtype

DENSE_LIMIT_BYTES = 1 << 30
"""Default byte limit for ``FactoredMatrix.dense()``; override per call with ``max_bytes``."""

TOPK_BLOCK_BYTES = 64 << 20
"""Default size of one dense row block in the chunked top-k routines (``block_bytes``)."""


def _fmt_bytes(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.2f} MiB"


def _upcast(factors) -> list[torch.Tensor]:
    return [f.to(linalg_dtype(f.dtype)) for f in factors]


def _check_chain(factors) -> None:
    """Raise a clear error unless ``factors`` is a chain of multipliable >=2-D tensors."""
    if not factors:
        raise ValueError("expected at least one factor, got none")
    for i, f in enumerate(factors):
        if not isinstance(f, torch.Tensor) or f.ndim < 2:
            got = tuple(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
            raise ValueError(f"factor {i} must be a tensor [..., rows, cols], got {got}")
        if not f.is_floating_point():
            raise TypeError(f"factor {i} must be floating point, got dtype {f.dtype}")
        if f.dtype != factors[0].dtype or f.device != factors[0].device:
            raise TypeError(
                f"all factors must share dtype and device; factor 0 is {factors[0].dtype} on "
                f"{factors[0].device}, factor {i} is {f.dtype} on {f.device}"
            )
    for i, (x, y) in enumerate(pairwise(factors)):
        if x.shape[-1] != y.shape[-2]:
            raise ValueError(
                f"cannot multiply factor {i} of shape {tuple(x.shape)} by factor {i + 1} of "
                f"shape {tuple(y.shape)}: inner dims {x.shape[-1]} and {y.shape[-2]} differ"
            )
    try:
        torch.broadcast_shapes(*(f.shape[:-2] for f in factors))
    except RuntimeError:
        shapes = ", ".join(str(tuple(f.shape)) for f in factors)
        raise ValueError(f"leading dims do not broadcast between factor shapes {shapes}") from None


def chain_matmul(*factors: torch.Tensor) -> torch.Tensor:
    """``X1 @ X2 @ ... @ Xr`` in the cheapest order (matrix-chain dynamic programme).

    Cost of one product counts its broadcast leading dims, so a factor without leading
    dims (``W_E [d_vocab, d_model]``) paired with another shared one (``W_U``) is multiplied
    once for all heads. Shapes: ``Xi [..., d_{i-1}, d_i]`` -> ``[..., d_0, d_r]``.
    """
    _check_chain(factors)
    n = len(factors)
    dims = [factors[0].shape[-2]] + [f.shape[-1] for f in factors]
    # best[(i, j)] = (cost, split, leading shape) of the product of factors i..j
    best = {(i, i): (0, None, factors[i].shape[:-2]) for i in range(n)}
    for length in range(2, n + 1):
        for i in range(n - length + 1):
            j = i + length - 1
            options = []
            for s in range(i, j):
                cl, _, ll = best[(i, s)]
                cr, _, lr = best[(s + 1, j)]
                lead = torch.broadcast_shapes(ll, lr)
                cost = cl + cr + math.prod(lead) * dims[i] * dims[s + 1] * dims[j + 1]
                options.append((cost, s, lead))
            best[(i, j)] = min(options, key=lambda o: o[0])

    def build(i, j):
        if i == j:
            return factors[i]
        split = best[(i, j)][1]
        return build(i, split) @ build(split + 1, j)

    return build(0, n - 1)


GRAM_REL_TOL = 1e-3
"""Largest estimated relative error of ``||AB||_F^2`` accepted from the Gram route (see below)."""


def frobenius_norm_of_product(*factors: torch.Tensor) -> torch.Tensor:
    """``||X1 X2 ... Xr||_F`` without forming the product; batched over leading dims.

    QR route: with ``X1 = Q1 R1`` and ``Xr^T = Qr Rr``,
    ``||X1 M Xr||_F = ||R1 M Rr^T||_F`` because orthonormal columns preserve the norm; its
    error is about ``u ||X1|| ... ||Xr||`` (``u`` the unit roundoff), as for the dense product.
    A low-rank pair ``A [m, k] B [k, n]`` (k <= m, n) first takes the cheaper Gram route
    ``||AB||_F^2 = sum((A^T A) * (B B^T))``, whose rounding error is about
    ``sqrt(m + n + k) u ||A||_F^2 ||B||_F^2`` on the *square*: relative to ``||AB||_F^2`` it
    grows as ``(||A|| ||B|| / ||AB||)^2``, so where ``||AB|| << ||A|| ||B||`` (a product that
    nearly cancels) the Gram result is ill-conditioned. Entries whose estimated relative error
    exceeds ``GRAM_REL_TOL`` are recomputed by the QR route.
    This is NOT ``||X2 ... Xr X1||_F`` (the cyclic permutation is only valid for the
    trace). Shapes: ``Xi [..., d_{i-1}, d_i]`` -> ``[...]``; 16-bit factors: in float32.
    """
    _check_chain(factors)
    factors = _upcast(factors)
    if len(factors) == 2 and factors[0].shape[-1] <= min(factors[0].shape[-2], factors[1].shape[-1]):
        # low-rank pair: ||AB||_F^2 = sum((A^T A) * (B B^T)), two small GEMMs, no QR
        A, B = factors
        gram_a, gram_b = A.mT @ A, B @ B.mT
        squared = (gram_a * gram_b).sum((-2, -1))
        scale = gram_a.diagonal(dim1=-2, dim2=-1).sum(-1) * gram_b.diagonal(dim1=-2, dim2=-1).sum(-1)
        m, k, n = A.shape[-2], A.shape[-1], B.shape[-1]
        error = (m + n + k) ** 0.5 * torch.finfo(A.dtype).eps / 2 * scale
        ill = error > GRAM_REL_TOL * squared
        # (meta tensors hold no values to test: there both routes only carry the shape through)
        if ill.device.type != "meta" and not bool(ill.any()):
            return squared.clamp_min(0).sqrt()  # rounding can push an exact 0 below 0
        return torch.where(ill, _qr_norm([A, B]), squared.clamp_min(0).sqrt())
    return _qr_norm(list(factors))


def _qr_norm(factors: list[torch.Tensor]) -> torch.Tensor:
    """The QR route of ``frobenius_norm_of_product``."""
    first = factors[0]
    if first.shape[-2] > first.shape[-1]:  # tall: replace by its [d1, d1] triangle
        factors[0] = linalg.qr_r(first, "the first factor of a Frobenius norm's chain")
    last = factors[-1]
    if last.shape[-1] > last.shape[-2]:  # wide: replace by its [d, d] triangle
        factors[-1] = linalg.qr_r(last.mT, "the last factor of a Frobenius norm's chain (transposed)").mT
    return torch.linalg.matrix_norm(chain_matmul(*factors))


GRAM_BLOCKS = 6
"""Column blocks of ``gram``: 6 multiplies 7/12 of the full product (measured fastest on 2 cores)."""


def gram(X: torch.Tensor, blocks: int = GRAM_BLOCKS) -> torch.Tensor:
    """``X^T X [..., n, n]`` of ``X [..., m, n]``, multiplying only its upper block triangle.

    The symmetric product (BLAS ``syrk``) that torch does not expose: ``n`` is cut into
    ``blocks`` column blocks, block row ``i`` is ``X_i^T [X_i ... X_last]`` and the lower
    triangle is its mirror, so the result is exactly symmetric. Work: ``(b + 1) / 2b`` of a GEMM.
    """
    n = X.shape[-1]
    edges = [round(i * n / blocks) for i in range(blocks + 1)]
    G = X.new_empty((*X.shape[:-2], n, n))
    for lo, hi in pairwise(edges):
        if hi > lo:
            row = X[..., lo:hi].mT @ X[..., lo:]
            G[..., lo:hi, lo:] = row
            G[..., lo:, lo:hi] = row.mT
            diag = row[..., :, : hi - lo]
            G[..., lo:hi, lo:hi] = (diag + diag.mT) / 2  # rounding left it a hair off symmetric
    return G


def eigenvalues_of_product(*factors: torch.Tensor) -> torch.Tensor:
    """Nonzero spectrum of the square product ``X1 X2 ... Xr`` (complex), batched.

    ``eig(XY)`` and ``eig(YX)`` share their nonzero eigenvalues, so the chain is rotated
    cyclically to start at its smallest dim ``d`` and ``eig`` runs on a ``[..., d, d]``
    matrix. Returns ``[..., d]`` complex, ``d = min(d_0, ..., d_{r-1})``; the remaining
    eigenvalues of the full product are exactly zero. 16-bit factors: in float32 (complex64).
    """
    _check_chain(factors)
    factors = _upcast(factors)
    size = factors[0].shape[-2]
    if factors[-1].shape[-1] != size:
        shapes = ", ".join(str(tuple(f.shape)) for f in factors)
        raise ValueError(f"eigenvalues need a square product, got factor shapes {shapes}")
    dims = [f.shape[-2] for f in factors]
    start = dims.index(min(dims))
    rotated = chain_matmul(*factors[start:], *factors[:start])
    shapes = " @ ".join(str(tuple(f.shape)) for f in factors)
    return linalg.eigvals(rotated, f"the product {shapes} (rotated to its smallest square)")


class FactoredMatrix:
    """``M = A @ B`` with ``A [..., m, k]``, ``B [..., k, n]`` kept factored.

    The public API is TransformerLens's ``FactoredMatrix`` (ported code runs unchanged):
    ``A``, ``B``, ``pair``, ``shape``, ``ldim``/``mdim``/``rdim``, ``ndim``,
    ``has_leading_dims``, ``AB``, ``BA``, ``T``, ``@`` and ``*``, ``svd()``, ``U``/``S``/``V``
    (and ``Vh``, TransformerLens's misnamed alias of ``V``), ``eigenvalues``, ``norm()``,
    ``make_even()``, ``collapse_l()``/``collapse_r()``, ``get_corner()``, ``unsqueeze()`` and
    indexing ``fm[..., i, j]``. Beyond it: ``dense(max_bytes)``, ``trace()``, ``row``/``col``/
    ``entry``/``rows``/``cols``, exact ``topk`` variants.

    Leading dims (e.g. ``[n_layers, n_heads]``) broadcast between ``A`` and ``B`` as in
    ``torch.matmul``; ``A`` and ``B`` read back broadcast to ``[*lead, m, k]`` and
    ``[*lead, k, n]`` (stride-0 views, as TransformerLens stores them). Internally a factor
    shared along a leading dim (a broadcast or ``expand``-ed one) is kept once, so ``svd``,
    ``norm`` and ``eigenvalues`` decompose it once; their results over such dims are
    stride-0 views of that one result (``.contiguous()`` gives a writable copy).

    Operands: torch tensors, or array-likes (numpy, anything exposing ``__array__`` or
    ``__dlpack__``), converted with ``torch.as_tensor``/``torch.from_dlpack`` so every method
    works on them (protocol-only duck types: see the differences below).

    dtype: factors must share dtype and device (a TypeError names both; TransformerLens
    builds the object and fails later in ``torch.matmul``). ``svd``, ``eigenvalues`` and
    ``norm`` of 16-bit factors run and return in float32, as TransformerLens's do (LAPACK
    has no 16-bit kernels; a bf16 Gram would lose the norm).

    Products (``@`` with a FactoredMatrix, a matrix or a vector, on either side) broadcast the
    operands' leading dims as ``torch.matmul`` does, expanded (stride-0) ones included, and every
    result (spectra, SVD, norms, indexing, ``collapse_*``) has the product's leading dims.

    Where this class differs from TransformerLens on purpose:

    - Exceptions: ValueError (not AssertionError or RuntimeError) for mismatched inner or leading
      dims in the constructor and in ``@``, a non-scalar tensor in ``*``, and ``BA``/``eigenvalues``
      of a non-square matrix; IndexError (not ValueError "too long an index") for more indices
      than dims.
    - Indexing refuses with IndexError what cannot stay factored or would be wrong: an int
      row/column out of range (TransformerLens returns an empty matrix), and tensor indices into
      both rows and columns at once (``fm[..., [0, 1], [0]]``: TransformerLens takes the block of
      those rows and columns, torch pairs them entry by entry; index one dim at a time, or read
      entries with ``entry``). See ``__getitem__``.
    - Protocol-only duck types (a ``shape``, ``ndim`` and ``@`` but no ``__array__`` or
      ``__dlpack__``, like TransformerLens's ``TensorLike``) are refused with a TypeError naming
      them, as factors and as ``@`` operands: every method needs the numbers.
    - ``eigenvalues`` where ``m < k``: ``M``'s ``m`` eigenvalues in LAPACK's order for ``AB``,
      then ``k - m`` exact zeros; TransformerLens returns ``eig(BA)`` in LAPACK's order, those
      zeros as rounding noise among the others. Where ``k <= m`` both are ``eig(BA)``, same order.
    - ``AB``/``dense()`` refuse products over ``DENSE_LIMIT_BYTES``; ``norm()`` takes the
      Gram/QR routes with an error bound instead of the SVD; spectra and SVDs refuse NaN/inf
      factors (``linalg.NonFiniteError``) where LAPACK would return NaN or abort the process.
    """

    __array_ufunc__ = None  # numpy_array @ fm: numpy defers to __rmatmul__ instead of wrapping fm

    def __init__(self, A, B):
        A, B = _as_tensor(A, "A"), _as_tensor(B, "B")
        _check_chain([A, B])
        self._lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        self._A, self._B = _unexpand(A), _unexpand(B)

    # ------------------------------------------------------------------ shape
    @property
    def A(self) -> torch.Tensor:
        """Left factor broadcast to ``[*lead, m, k]`` (a view)."""
        return self._A.broadcast_to((*self._lead, *self._A.shape[-2:]))

    @property
    def B(self) -> torch.Tensor:
        """Right factor broadcast to ``[*lead, k, n]`` (a view)."""
        return self._B.broadcast_to((*self._lead, *self._B.shape[-2:]))

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A, B)``, both broadcast to the leading dims."""
        return self.A, self.B

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self._lead, self.ldim, self.rdim))

    @property
    def ldim(self) -> int:
        return self._A.shape[-2]

    @property
    def mdim(self) -> int:
        return self._A.shape[-1]

    @property
    def rdim(self) -> int:
        return self._B.shape[-1]

    @property
    def rank(self) -> int:
        """Inner dim ``k`` of the factorisation (upper bound on the numerical rank)."""
        return self.mdim

    @property
    def ndim(self) -> int:
        return len(self._lead) + 2

    @property
    def has_leading_dims(self) -> bool:
        return bool(self._lead)

    @property
    def dtype(self) -> torch.dtype:
        return self._A.dtype

    @property
    def device(self) -> torch.device:
        return self._A.device

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={tuple(self.shape)}, rank={self.rank}, dtype={self.dtype})"

    def _full(self, result: torch.Tensor, trailing: int) -> torch.Tensor:
        """``result`` of the stored factors (its last ``trailing`` dims per matrix) broadcast to the leading dims."""
        return result.broadcast_to((*self._lead, *result.shape[result.ndim - trailing:]))

    # ------------------------------------------------------------- algebra
    def __matmul__(self, other):
        """``M @ other``: dense ``[..., n, p]`` or FactoredMatrix -> FactoredMatrix; vector ``[n]`` -> ``[..., m]``."""
        if isinstance(other, FactoredMatrix):
            return _from_chain([self._A, self._B, other._A, other._B], self, other)
        other = _operand(other, self)
        if other is None:
            return NotImplemented
        if other.ndim == 1:
            _require(other.shape[0] == self.rdim, self, other)
            return self._full((self._A @ (self._B @ other[:, None])).squeeze(-1), 1)
        return _from_chain([self._A, self._B, other], self, other)

    def __rmatmul__(self, other):
        """``other @ M``: dense ``[..., p, m]`` -> FactoredMatrix; vector ``[m]`` -> dense ``[..., n]``."""
        other = _operand(other, self)
        if other is None:
            return NotImplemented
        if other.ndim == 1:
            _require(other.shape[0] == self.ldim, other, self)
            return self._full(((other[None] @ self._A) @ self._B).squeeze(-2), 1)
        return _from_chain([other, self._A, self._B], other, self)

    def __mul__(self, scalar) -> FactoredMatrix:
        """Scalar multiple ``c M = (c A) B``."""
        if isinstance(scalar, torch.Tensor) and scalar.numel() != 1:
            raise ValueError(
                f"FactoredMatrix * tensor needs a scalar, got shape {tuple(scalar.shape)}; "
                "use @ for matrix products"
            )
        return FactoredMatrix(self._full(self._A * scalar, 2), self.B)

    __rmul__ = __mul__

    @property
    def T(self) -> FactoredMatrix:
        """Transpose of the last two dims: ``(AB)^T = B^T A^T``."""
        return FactoredMatrix(self.B.mT, self.A.mT)

    def unsqueeze(self, dim: int) -> FactoredMatrix:
        """``M.unsqueeze(dim)`` still factored, for any ``dim`` in ``-ndim-1..ndim``; a new axis at the
        matrix dims (``ndim - 1`` or ``ndim``) turns the rows into a leading dim."""
        if not -self.ndim - 1 <= dim <= self.ndim:
            raise IndexError(f"unsqueeze dim must be in {-self.ndim - 1}..{self.ndim} for shape "
                             f"{tuple(self.shape)}, got {dim}")
        dim = dim % (self.ndim + 1)
        if dim <= self.ndim - 2:
            return FactoredMatrix(self.A.unsqueeze(dim), self.B.unsqueeze(dim))
        if dim == self.ndim - 1:  # [..., m, 1, n]: rows become a leading dim of one-row matrices
            return FactoredMatrix(self.A.unsqueeze(-2), self.B.unsqueeze(-3))
        # [..., m, n, 1]: entry [.., i, j, 0] = B[:, j] . A[i], so (B^T, A) with rows i leading
        return FactoredMatrix(self.B.mT.unsqueeze(-3), self.A.unsqueeze(-1))

    def dense(self, max_bytes: int | None = None) -> torch.Tensor:
        """The product ``A @ B [..., m, n]``; refuses above ``max_bytes`` (default ``DENSE_LIMIT_BYTES``)."""
        limit = DENSE_LIMIT_BYTES if max_bytes is None else max_bytes
        need = math.prod(self.shape) * self._A.element_size()
        if need > limit:
            raise MemoryError(
                f"dense product of shape {tuple(self.shape)} ({self.dtype}) would take "
                f"{_fmt_bytes(need)}, over the limit of {_fmt_bytes(limit)}; use topk/row/col/"
                "norm/svd on the factored form, or pass dense(max_bytes=...) or raise "
                "pycircuits_widgets.factored.DENSE_LIMIT_BYTES"
            )
        return self._full(self._A @ self._B, 2)

    @property
    def AB(self) -> torch.Tensor:
        """Dense product ``A @ B [..., m, n]``, guarded by ``DENSE_LIMIT_BYTES``."""
        return self.dense()

    @property
    def BA(self) -> torch.Tensor:
        """Reverse product ``B @ A [..., k, k]``; needs a square ``M`` (m == n)."""
        self._require_square("BA")
        return self._full(self._B @ self._A, 2)

    def get_corner(self, k: int = 3) -> torch.Tensor:
        """Dense top-left corner: the first ``k`` of every dim, leading dims included (as TransformerLens)."""
        corner = self._full(self._A[..., :k, :] @ self._B[..., :, :k], 2)
        return corner[tuple(slice(k) for _ in self._lead)]

    # ------------------------------------------------------------- spectra
    @property
    def eigenvalues(self) -> torch.Tensor:
        """Spectrum of ``M`` as ``eig(BA)``: complex ``[..., k]`` (TransformerLens's count, ``mdim``).

        Needs m == n. The other ``m - k`` eigenvalues of ``M`` are 0. Order: where ``k <= m``,
        LAPACK's order of ``eig(BA)``, the same values in the same order as TransformerLens. Where
        ``m < k``, ``BA`` has ``k - m`` zero eigenvalues besides ``M``'s: ``eig(AB)`` (the smaller
        problem) gives the ``m`` values, in LAPACK's order for ``AB``, and the rest are appended as
        exact zeros (TransformerLens returns rounding noise there, at LAPACK's places in ``BA``'s
        order): compare such spectra as sets. 16-bit factors: computed in float32 (complex64)."""
        self._require_square("eigenvalues")
        eigs = eigenvalues_of_product(self._B, self._A)  # [..., min(m, k)]; a tie (m == k) takes BA
        missing = self.mdim - eigs.shape[-1]
        if missing:
            eigs = torch.cat([eigs, eigs.new_zeros((*eigs.shape[:-1], missing))], -1)
        return self._full(eigs, 1)

    @functools.cached_property
    def _svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        work = linalg_dtype(self.dtype)
        Ua, Sa, Vha = linalg.svd(self._A.to(work), "factor A of a FactoredMatrix")
        Ub, Sb, Vhb = linalg.svd(self._B.to(work), "factor B of a FactoredMatrix")
        C = (Sa[..., :, None] * Vha) @ (Ub * Sb[..., None, :])
        Uc, Sc, Vhc = linalg.svd(C, "the core S_A Vh_A U_B S_B of a FactoredMatrix's SVD")
        return self._full(Ua @ Uc, 2), self._full(Sc, 1), self._full(Vhb.mT @ Vhc.mT, 2)

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Thin SVD ``(U, S, V)`` with ``M = U diag(S) V^T`` (TransformerLens's convention; NOT
        ``torch.linalg.svd``'s ``Vh``): ``U [..., m, r]``, ``S [..., r]`` descending,
        ``V [..., n, r]``, ``r = min(m, k, n)``. Cached per object.

        From the factors' SVDs: ``A = U_A S_A Vh_A``, ``B = U_B S_B Vh_B``,
        ``C = S_A Vh_A U_B S_B = U_C S_C Vh_C``, so ``U = U_A U_C``, ``S = S_C``,
        ``V = (Vh_C Vh_B)^T``. 16-bit factors: computed and returned in float32.
        """
        return self._svd

    @property
    def U(self) -> torch.Tensor:
        """Left singular vectors ``[..., m, r]`` (``svd()[0]``)."""
        return self._svd[0]

    @property
    def S(self) -> torch.Tensor:
        """Singular values ``[..., r]``, descending (``svd()[1]``)."""
        return self._svd[1]

    @property
    def V(self) -> torch.Tensor:
        """Right singular vectors ``[..., n, r]``: ``M = U diag(S) V^T`` (``svd()[2]``)."""
        return self._svd[2]

    @property
    def Vh(self) -> torch.Tensor:
        """TransformerLens's historical alias: returns ``V [..., n, r]``, NOT its transpose.

        Kept so ported code gets the same numbers; warns (DeprecationWarning, as TransformerLens
        does) because the name says the opposite. Use ``V``, or ``V.mT`` for ``Vh``."""
        warnings.warn(
            "FactoredMatrix.Vh returns V (right singular vectors, M = U diag(S) V^T), as "
            "TransformerLens's Vh does, not V^T; use .V, or .V.mT for the transpose",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._svd[2]

    def make_even(self) -> FactoredMatrix:
        """The same ``M`` as ``(U sqrt(S), sqrt(S) V^T)``: orthogonal columns / rows, each half
        carrying the square roots of the singular values. Inner dim ``r``."""
        U, S, V = self._svd
        root = S.sqrt()
        return FactoredMatrix(U * root[..., None, :], root[..., :, None] * V.mT)

    def collapse_l(self) -> torch.Tensor:
        """``diag(S) V^T [..., r, n]``: ``M`` with its left orthonormal factor ``U`` removed."""
        _, S, V = self._svd
        return S[..., :, None] * V.mT

    def collapse_r(self) -> torch.Tensor:
        """``U diag(S) [..., m, r]``: ``M`` with its right orthonormal factor ``V^T`` removed."""
        U, S, _ = self._svd
        return U * S[..., None, :]

    def norm(self) -> torch.Tensor:
        """Frobenius norm ``||AB||_F [...]``, batched: the Gram route, or the QR route where the Gram
        result is ill-conditioned (``||AB|| << ||A|| ||B||``; see ``frobenius_norm_of_product``).
        Equals TransformerLens's ``sqrt(sum(S^2))`` without an SVD. 16-bit factors: in float32."""
        return self._full(frobenius_norm_of_product(self._A, self._B), 0)

    def trace(self) -> torch.Tensor:
        """``tr(AB) = sum_ij A_ij B_ji [...]``; needs m == n."""
        self._require_square("trace")
        return self._full((self._A * self._B.mT).sum((-2, -1)), 0)

    # ------------------------------------------------------------- indexing
    def __getitem__(self, idx) -> FactoredMatrix:
        """``M[idx]`` without forming ``M``, with TransformerLens's semantics: ``idx`` runs over the
        product's dims ``[*lead, m, n]``, so ``fm[layer, head]`` selects heads and
        ``fm[..., i, j]`` rows and columns. Leading dims index as in torch (ints drop the dim);
        an int row or column keeps its singleton dim (``fm[..., i, j]`` is ``[..., 1, 1]``), as in
        TransformerLens. ``None`` adds an axis anywhere, ``...`` expands once.

        Refused with IndexError (TransformerLens returns wrong-shaped or empty results there): an
        int row/column out of range; tensor (advanced) indices into both rows and columns (torch
        would pair them entry by entry: use ``entry``), or into a matrix dim together with
        leading dims; a multi-dim tensor index into rows or columns, or a mask spanning a leading
        and a matrix dim; more indices than dims. TypeError: a bool index (torch, and TransformerLens
        at a leading dim, read it as a new axis; TransformerLens at a row/column as row 0 or 1).
        """
        items = list(map(_index_item, idx if isinstance(idx, tuple) else (idx,)))  # (map: warnings point here)
        if sum(i is Ellipsis for i in items) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        used = sum(_dims_used(i) for i in items)
        if used > self.ndim:
            raise IndexError(
                f"index {idx!r} uses {used} dims but FactoredMatrix of shape {tuple(self.shape)} "
                f"has {self.ndim}; single entries are entry(i, j)"
            )
        fill = [slice(None)] * (self.ndim - used)
        at = next((p for p, i in enumerate(items) if i is Ellipsis), len(items))
        items = items[:at] + fill + items[at + 1:]
        n_lead, seen, split = self.ndim - 2, 0, len(items)
        for pos, item in enumerate(items):  # split after the item that uses the last leading dim
            if seen == n_lead and item is not None:
                split = pos
                break
            seen += _dims_used(item)
            if seen > n_lead:
                raise IndexError(f"index {idx!r}: a mask cannot span a leading and a matrix dim of "
                                 f"FactoredMatrix of shape {tuple(self.shape)}")
        lead, rest = items[:split], items[split:]
        at = [p for p, i in enumerate(rest) if i is not None]
        if len(at) != 2:
            raise IndexError(f"index {idx!r}: a mask over both matrix dims of FactoredMatrix of shape "
                             f"{tuple(self.shape)} picks single entries; read them with entry(i, j)")
        row, col = rest[at[0]], rest[at[1]]
        between, after = at[1] - at[0] - 1, len(rest) - at[1] - 1  # new axes around the column
        if any(_is_advanced(i) for i in lead) + _is_advanced(row) + _is_advanced(col) > 1:
            raise IndexError(
                f"index {idx!r} of FactoredMatrix of shape {tuple(self.shape)}: tensor indices into "
                "more than one of (leading dims, rows, columns) pair up entry by entry in torch, which "
                "a factored matrix cannot hold; index one at a time, or read entries with entry(i, j)"
            )
        row, col = self._matrix_index(row, self.ldim, "row", idx), self._matrix_index(col, self.rdim, "column", idx)
        A, B = self._index_lead(self._A, lead), self._index_lead(self._B, lead)
        out = FactoredMatrix(A[..., row, :], B[..., :, col])
        for _ in range(between):
            out = out.unsqueeze(out.ndim - 1)
        for _ in range(after):
            out = out.unsqueeze(out.ndim)
        return out

    def _index_lead(self, factor: torch.Tensor, lead: list) -> torch.Tensor:
        """``factor`` (stored) broadcast and indexed by ``lead`` over the leading dims. A factor shared by
        all of them is broadcast to the result's shape, never gathered (tensor indices would copy it)."""
        if any(map(_is_advanced, lead)) and all(s == 1 for s in factor.shape[:-2]):
            shape = factor.new_zeros(()).expand(self._lead)[tuple(lead)].shape  # stride 0: no copy
            return factor.reshape(factor.shape[-2:]).broadcast_to((*shape, *factor.shape[-2:]))
        return self._full(factor, 2)[tuple(lead)]

    def _matrix_index(self, item, size: int, what: str, idx):
        """A row or column index as one the factor can take: an int becomes a one-wide slice."""
        if isinstance(item, torch.Tensor) and item.ndim > 1:
            raise IndexError(f"index {idx!r}: a {what} index must be an int, slice or 1-D tensor, got a "
                             f"{item.ndim}-D tensor (FactoredMatrix of shape {tuple(self.shape)})")
        if isinstance(item, int):
            if not -size <= item < size:
                raise IndexError(f"{what} index {item} is out of range for FactoredMatrix of shape "
                                 f"{tuple(self.shape)} ({size} {what}s)")
            item %= size
            return slice(item, item + 1)
        return item

    def rows(self, idx) -> FactoredMatrix:
        """Rows ``idx`` (int list, tensor or slice) of ``M``, still factored: ``[..., len, n]``."""
        return FactoredMatrix(self._full(self._A[..., idx, :], 2), self.B)

    def cols(self, idx) -> FactoredMatrix:
        """Columns ``idx`` of ``M``, still factored: ``[..., m, len]``."""
        return FactoredMatrix(self.A, self._full(self._B[..., :, idx], 2))

    def row(self, i: int) -> torch.Tensor:
        """Row ``i`` of ``M`` as a dense ``[..., n]`` tensor: ``A[i] @ B``."""
        return self._full((self._A[..., i, :].unsqueeze(-2) @ self._B).squeeze(-2), 1)

    def col(self, j: int) -> torch.Tensor:
        """Column ``j`` of ``M`` as a dense ``[..., m]`` tensor: ``A @ B[:, j]``."""
        return self.T.row(j)

    def entry(self, i: int, j: int) -> torch.Tensor:
        """Entry ``M[..., i, j] = A[i] . B[:, j]``, shape ``[...]``."""
        return self._full((self._A[..., i, :] * self._B[..., :, j]).sum(-1), 0)

    # ------------------------------------------------------------- top-k
    def topk(self, k: int, largest: bool = True, block_bytes: int = TOPK_BLOCK_BYTES):
        """Exact top-k over all ``m * n`` entries, in row blocks of at most ``block_bytes``.

        Returns ``(values [..., k], rows [..., k], cols [..., k])``, values sorted
        (descending, or ascending for ``largest=False``). The set of values equals
        ``torch.topk(M.flatten(), k).values``; ties are broken arbitrarily. Each block is one
        GEMM; after the first block only entries beating the running k-th value are kept,
        so the cost is the GEMM plus one comparison pass. Memory: factors + one block.
        """
        if not 0 < k <= self.ldim * self.rdim:
            raise ValueError(f"k must be in 1..{self.ldim * self.rdim} for shape {tuple(self.shape)}, got {k}")
        return self._per_matrix(lambda A, B: _topk_all(A, B, k, largest, block_bytes))

    def topk_per_row(self, k: int, largest: bool = True, block_bytes: int = TOPK_BLOCK_BYTES):
        """Top-k of every row: ``(values [..., m, k], cols [..., m, k])``, like ``torch.topk(M, k, dim=-1)``."""
        if not 0 < k <= self.rdim:
            raise ValueError(f"k must be in 1..{self.rdim} for rows of shape {tuple(self.shape)}, got {k}")
        return self._per_matrix(lambda A, B: _topk_rows(A, B, k, largest, block_bytes))

    def topk_per_col(self, k: int, largest: bool = True, block_bytes: int = TOPK_BLOCK_BYTES):
        """Top-k of every column: ``(values [..., n, k], rows [..., n, k])`` (note: one row per column)."""
        return self.T.topk_per_row(k, largest, block_bytes)

    # ------------------------------------------------------------- helpers
    def _per_matrix(self, fn):
        """Apply ``fn(A [m, k], B [k, n]) -> tuple of tensors`` to every leading index and stack."""
        lead = self.shape[:-2]
        if not lead:  # one matrix: nothing to broadcast or stack (small products are call-overhead bound)
            return fn(self.A, self.B)
        A = self.A.broadcast_to((*lead, *self.A.shape[-2:]))
        B = self.B.broadcast_to((*lead, *self.B.shape[-2:]))
        results = [fn(A[i], B[i]) for i in _index_product(*(range(s) for s in lead))]
        return tuple(torch.stack(parts).reshape(*lead, *parts[0].shape) for parts in zip(*results))

    def _require_square(self, what: str) -> None:
        if self.ldim != self.rdim:
            raise ValueError(f"{what} needs a square matrix (m == n), got shape {tuple(self.shape)}")


def _unexpand(t: torch.Tensor) -> torch.Tensor:
    """Undo broadcast views: a stride-0 leading dim becomes size 1, so linalg runs once on it."""
    for d in range(t.ndim - 2):
        if t.stride(d) == 0 and t.shape[d] > 1:
            t = t.narrow(d, 0, 1)
    return t


_ARRAY_PROTOCOLS = ("__array__", "__array_interface__", "__cuda_array_interface__", "__dlpack__")


def _protocol(x) -> str | None:
    """The first array protocol ``x`` exposes (None-valued attributes opt out, as in numpy)."""
    return next((p for p in _ARRAY_PROTOCOLS if getattr(x, p, None) is not None), None)


def _is_array(x) -> bool:
    return isinstance(x, torch.Tensor) or _protocol(x) is not None


def _as_tensor(x, what: str) -> torch.Tensor:
    """``x`` as a tensor: tensors as they are, array-likes (numpy, cupy, jax, wrappers exposing
    ``__array__`` or ``__dlpack__``) converted without a copy where the protocol allows."""
    if isinstance(x, torch.Tensor):
        return x
    protocol = _protocol(x)
    if protocol is None:
        raise TypeError(f"{what} must be a torch.Tensor or an array-like (__array__ or __dlpack__), "
                        f"got {type(x).__name__}")
    if protocol == "__cuda_array_interface__":
        return torch.as_tensor(x)
    return torch.from_dlpack(x) if protocol == "__dlpack__" else torch.as_tensor(np.asarray(x))


def _operand(other, fm: FactoredMatrix) -> torch.Tensor | None:
    """``other`` as a tensor, or None for non-array operands (Python then raises its TypeError);
    errors on a dtype/device mix (no promotion: the caller converts) and on protocol-only duck types."""
    if not _is_array(other):
        if hasattr(other, "shape") and hasattr(other, "ndim"):
            # left to Python, its own __rmatmul__/__matmul__ would wrap this FactoredMatrix unmultiplied
            raise TypeError(f"cannot multiply a FactoredMatrix by a {type(other).__name__}: it has a shape but "
                            "no array protocol (__array__ or __dlpack__) to read its numbers from (TransformerLens's "
                            "protocol-only TensorLike); pass torch.as_tensor(x) or expose __array__")
        return None
    other = _as_tensor(other, "operand")
    if other.dtype != fm.dtype or other.device != fm.device:
        raise TypeError(
            f"operand is {other.dtype} on {other.device} but FactoredMatrix is {fm.dtype} on {fm.device}; "
            "no promotion is done: convert one of them with .to(...)"
        )
    return other


def _index_item(item):
    """One entry of an index as ``__getitem__`` handles it: lists and arrays as tensors, integer
    scalars (numpy, 0-d tensors) as ints, uint8 masks as bool with torch's deprecation warning; refuses bools."""
    if item is None or item is Ellipsis or isinstance(item, slice):
        return item
    if isinstance(item, (list, tuple)) or (not isinstance(item, torch.Tensor) and _is_array(item)):
        item = torch.as_tensor(item)
    if isinstance(item, torch.Tensor):
        if item.dtype == torch.uint8:
            warnings.warn("indexing with dtype torch.uint8 is now deprecated, please use a dtype torch.bool "
                          "instead (read as that bool mask, as torch does)", UserWarning, stacklevel=3)
            item = item.bool()
        if item.dtype == torch.bool and item.ndim == 0 or item.is_floating_point() or item.is_complex():
            raise TypeError(f"FactoredMatrix index entries must be ints, slices, None, ..., integer "
                            f"tensors or masks, got a {'0-d ' if item.ndim == 0 else ''}{item.dtype} tensor")
        return int(item) if item.ndim == 0 else item
    if isinstance(item, bool):
        raise TypeError(f"FactoredMatrix index entries must be ints, not bool ({item!r}): torch reads a bool "
                        "as a new axis, TransformerLens at a row/column as 0 or 1; pass None or an int")
    try:
        return operator.index(item)
    except TypeError:
        raise TypeError(f"FactoredMatrix index entries must be ints, slices, None, ..., integer tensors "
                        f"or masks, got {type(item).__name__}") from None


def _dims_used(item) -> int:
    """Dims of the indexed matrix that ``item`` consumes (a mask: one per mask dim)."""
    if item is None or item is Ellipsis:
        return 0
    return item.ndim if isinstance(item, torch.Tensor) and item.dtype == torch.bool else 1


def _is_advanced(item) -> bool:
    return isinstance(item, torch.Tensor)


def _require(ok: bool, left, right) -> None:
    if not ok:
        raise ValueError(
            f"cannot multiply shape {tuple(left.shape)} by shape {tuple(right.shape)}: inner dims differ"
        )


def _from_chain(factors, left, right) -> FactoredMatrix:
    """Factored form of ``left @ right``, the chain ``factors`` (a FactoredMatrix's stored factors, whose
    shared leading dims are kept at size 1), split at its smallest inner dim (first on ties). The
    result has the leading dims of ``left`` and ``right`` broadcast, not those of the stored factors."""
    try:
        _check_chain(factors)
    except (TypeError, ValueError) as err:
        raise type(err)(
            f"cannot multiply shape {tuple(left.shape)} by shape {tuple(right.shape)} ({err})"
        ) from None
    try:
        lead = torch.broadcast_shapes(left.shape[:-2], right.shape[:-2])
    except RuntimeError:
        raise ValueError(f"cannot multiply shape {tuple(left.shape)} by shape {tuple(right.shape)}: leading "
                         f"dims {tuple(left.shape[:-2])} and {tuple(right.shape[:-2])} do not broadcast") from None
    inner = [f.shape[-1] for f in factors[:-1]]
    split = inner.index(min(inner)) + 1
    X, Y = chain_matmul(*factors[:split]), chain_matmul(*factors[split:])
    # stride-0 views: the constructor keeps a dim that only broadcasts at size 1 again
    return FactoredMatrix(X.broadcast_to((*lead, *X.shape[-2:])), Y.broadcast_to((*lead, *Y.shape[-2:])))


def _candidates(block: torch.Tensor, k: int, threshold):
    """Flat positions and values of ``block`` that can enter a running top-k."""
    flat = block.reshape(-1)
    if threshold is None:
        values, pos = torch.topk(flat, min(k, flat.numel()), sorted=False)
        return values, pos
    pos = torch.nonzero(flat > threshold).squeeze(1)
    return flat[pos], pos


def _topk_all(A, B, k, largest, block_bytes):
    """Exact top-k of ``A @ B`` over all entries with a running threshold (see ``topk``).

    On CPU in float32, blocks after the first are screened by ``screen.ProductScreen`` (a
    low-precision GEMM with a proven error bound): only entries that may beat the running
    k-th value are recomputed exactly from the float32 factors. Where this CPU's fastest exact
    route is float32 itself, every block is the exact GEMM (the dense product's cost, no more).
    """
    if not largest:  # bottom-k of M is top-k of -M; negating a factor is exact in IEEE
        values, r, c = _topk_all(A, -B, k, True, block_bytes)
        return -values, r, c
    m, n = A.shape[0], B.shape[1]
    step = max(1, block_bytes // (n * A.element_size()))
    # a small exact first block sets the threshold; its torch.topk is the memory peak
    first = max(1, step // 8)
    if m <= first:  # the whole product is that block: the dense route itself, nothing around it
        values, flat_idx = torch.topk((A @ B).reshape(-1), k)
        return values, flat_idx // n, flat_idx % n
    # float32's GEMM costs what the exact block's does: a screen on that route would only add work
    screened = A.dtype == torch.float32 and A.device.type == "cpu" and screen.exact_route() != "float32"
    screening = screen.ProductScreen(A, B) if screened else None
    values = A.new_empty(0)
    flat_idx = torch.empty(0, dtype=torch.long, device=A.device)
    threshold = None
    starts = [0, *range(first, m, step if screening is None else screening.block_rows)]
    for start, stop in zip(starts, [*starts[1:], m]):
        rows = A[start:stop]
        if threshold is None or screening is None:
            cand_v, cand_pos = _candidates(rows @ B, k, threshold)
        else:
            i, j = screening.candidates(torch.arange(start, stop), float(threshold))
            if i.numel() * 32 > rows.shape[0] * n:  # barely pruned: exact GEMMs beat gathers
                # in blocks of `step` rows: a screening block (screen.SCREEN_ROWS) can exceed block_bytes
                subs = range(0, rows.shape[0], step)
                found = [_candidates(rows[s:s + step] @ B, k, threshold) for s in subs]
                cand_v = torch.cat([v for v, _ in found])
                cand_pos = torch.cat([pos + s * n for (_, pos), s in zip(found, subs)])
            else:
                cand_v = (rows[i] * B[:, j].T).sum(-1)
                beats = cand_v > threshold
                cand_v, cand_pos = cand_v[beats], i[beats] * n + j[beats]
        values = torch.cat([values, cand_v])
        flat_idx = torch.cat([flat_idx, cand_pos + start * n])
        if values.numel() >= k:
            # the k-th value so far: later entries must beat it strictly to matter
            values, keep = torch.topk(values, k, sorted=False)
            flat_idx = flat_idx[keep]
            threshold = values.min()
    values, order = torch.sort(values, descending=True)
    flat_idx = flat_idx[order]
    return values, flat_idx // n, flat_idx % n


def _topk_rows(A, B, k, largest, block_bytes):
    """Per-row top-k of ``A @ B`` in row blocks of at most ``block_bytes``."""
    n = B.shape[1]
    step = max(1, block_bytes // (n * A.element_size()))
    parts = [torch.topk(A[s : s + step] @ B, k, dim=-1, largest=largest) for s in range(0, A.shape[0], step)]
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])
