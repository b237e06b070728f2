"""FactoredMatrix: a low-rank product ``A @ B`` kept unmultiplied (DESIGN.md section 4).

``FactoredMatrix(A, B)`` stands for ``M = A [..., m, k] @ B [..., k, n]``; leading dims
(e.g. ``[n_layers, n_heads]``) broadcast between ``A`` and ``B`` as in ``torch.matmul``.
Everything here avoids forming the ``[m, n]`` product unless asked (``.dense()``), which
is guarded by a size limit because a GPT-2 vocab x vocab circuit is 10 GB.

Module-level helpers work on chains of several factors ``X1 @ X2 @ ... @ Xr``:
``frobenius_norm_of_product`` (QR or Gram route, never the cyclic-permutation erratum),
``eigenvalues_of_product`` (nonzero spectrum through the smallest cyclic rotation) and
``chain_matmul`` (cheapest multiplication order, aware of broadcast leading dims, so a
factor shared by all heads is multiplied once).

Conventions: row vectors (``x @ W``); dtype and device follow the inputs (float32 and
float64 are tested); SVD returns ``(U, S, Vh)`` as ``torch.linalg.svd`` does.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from itertools import product as _index_product

import torch

from .screen import ProductScreen

DENSE_LIMIT_BYTES = 1 << 30
"""Default byte limit for ``FactoredMatrix.dense()``; override per call with ``max_bytes``."""

TOPK_BLOCK_BYTES = 64 << 20
"""Default size of one dense row block in the chunked top-k routines (``block_bytes``)."""


def _fmt_bytes(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.2f} MiB"


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
    for i, (x, y) in enumerate(zip(factors, factors[1:])):
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

    QR route (DESIGN.md section 4): with ``X1 = Q1 R1`` and ``Xr^T = Qr Rr``,
    ``||X1 M Xr||_F = ||R1 M Rr^T||_F`` because orthonormal columns preserve the norm; its
    error is about ``u ||X1|| ... ||Xr||`` (``u`` the unit roundoff), as for the dense product.
    A low-rank pair ``A [m, k] B [k, n]`` (k <= m, n) first takes the cheaper Gram route
    ``||AB||_F^2 = sum((A^T A) * (B B^T))``, whose rounding error is about
    ``sqrt(m + n + k) u ||A||_F^2 ||B||_F^2`` on the *square*: relative to ``||AB||_F^2`` it
    grows as ``(||A|| ||B|| / ||AB||)^2``, so where ``||AB|| << ||A|| ||B||`` (a product that
    nearly cancels) the Gram result is ill-conditioned. Entries whose estimated relative error
    exceeds ``GRAM_REL_TOL`` are recomputed by the QR route.
    This is NOT ``||X2 ... Xr X1||_F`` (the cyclic permutation is only valid for the
    trace). Shapes: ``Xi [..., d_{i-1}, d_i]`` -> ``[...]``.
    """
    _check_chain(factors)
    if len(factors) == 2 and factors[0].shape[-1] <= min(factors[0].shape[-2], factors[1].shape[-1]):
        # low-rank pair: ||AB||_F^2 = sum((A^T A) * (B B^T)), two small GEMMs, no QR
        A, B = factors
        gram_a, gram_b = A.mT @ A, B @ B.mT
        squared = (gram_a * gram_b).sum((-2, -1))
        scale = gram_a.diagonal(dim1=-2, dim2=-1).sum(-1) * gram_b.diagonal(dim1=-2, dim2=-1).sum(-1)
        m, k, n = A.shape[-2], A.shape[-1], B.shape[-1]
        error = (m + n + k) ** 0.5 * torch.finfo(A.dtype).eps / 2 * scale
        ill = error > GRAM_REL_TOL * squared
        if not bool(ill.any()):
            return squared.clamp_min(0).sqrt()  # rounding can push an exact 0 below 0
        return torch.where(ill, _qr_norm([A, B]), squared.clamp_min(0).sqrt())
    return _qr_norm(list(factors))


def _qr_norm(factors: list[torch.Tensor]) -> torch.Tensor:
    """The QR route of ``frobenius_norm_of_product``."""
    first = factors[0]
    if first.shape[-2] > first.shape[-1]:  # tall: replace by its [d1, d1] triangle
        factors[0] = torch.linalg.qr(first, mode="r").R
    last = factors[-1]
    if last.shape[-1] > last.shape[-2]:  # wide: replace by its [d, d] triangle
        factors[-1] = torch.linalg.qr(last.mT, mode="r").R.mT
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
    for lo, hi in zip(edges, edges[1:]):
        if hi > lo:
            row = X[..., lo:hi].mT @ X[..., lo:]
            G[..., lo:hi, lo:] = row
            G[..., lo:, lo:hi] = row.mT
            diag = row[..., :, : hi - lo]
            G[..., lo:hi, lo:hi] = (diag + diag.mT) / 2  # rounding left it a hair off symmetric
    return G


def eigvals(x: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.eigvals`` of a batch ``[..., n, n]``, its matrices split over torch's threads.

    LAPACK's ``geev`` runs one small matrix at a time on one core (144 heads' ``64 x 64`` circuits:
    ~70 ms, a quarter of the eigenvalue view's time at GPT-2-small shapes); torch releases the GIL
    inside it, so a thread per chunk uses every core."""
    chunks = min(torch.get_num_threads(), math.prod(x.shape[:-2]))
    if chunks < 2 or x.shape[-1] < 16:  # small problems: thread start-up would dominate
        return torch.linalg.eigvals(x)
    flat = x.reshape(-1, *x.shape[-2:])
    with ThreadPoolExecutor(chunks) as pool:
        parts = list(pool.map(torch.linalg.eigvals, flat.chunk(chunks)))
    return torch.cat(parts).reshape(*x.shape[:-1])


def eigenvalues_of_product(*factors: torch.Tensor) -> torch.Tensor:
    """Nonzero spectrum of the square product ``X1 X2 ... Xr`` (complex), batched.

    ``eig(XY)`` and ``eig(YX)`` share their nonzero eigenvalues, so the chain is rotated
    cyclically to start at its smallest dim ``d`` and ``eig`` runs on a ``[..., d, d]``
    matrix. Returns ``[..., d]`` complex, ``d = min(d_0, ..., d_{r-1})``; the remaining
    eigenvalues of the full product are exactly zero.
    """
    _check_chain(factors)
    size = factors[0].shape[-2]
    if factors[-1].shape[-1] != size:
        shapes = ", ".join(str(tuple(f.shape)) for f in factors)
        raise ValueError(f"eigenvalues need a square product, got factor shapes {shapes}")
    dims = [f.shape[-2] for f in factors]
    start = dims.index(min(dims))
    return eigvals(chain_matmul(*factors[start:], *factors[:start]))


class FactoredMatrix:
    """``M = A @ B`` with ``A [..., m, k]``, ``B [..., k, n]`` kept factored.

    The factors are stored as given (leading dims broadcast lazily, so a factor shared by
    all heads is stored and decomposed once). ``shape`` is the broadcast product shape
    ``[..., m, n]``; ``ldim, mdim, rdim = m, k, n``; ``rank`` is the inner dim ``k``
    (an upper bound on the numerical rank; use ``svd()`` for the spectrum).

    Indexing: ``fm[layer]``, ``fm[layer, head]``, ``fm[:, 3]``, ``fm[..., 0]`` select
    leading dims only and return a FactoredMatrix. Matrix entries are read with
    ``row(i)``, ``col(j)``, ``entry(i, j)`` (dense, small) or ``rows(idx)``/``cols(idx)``
    (still factored).
    """

    def __init__(self, A: torch.Tensor, B: torch.Tensor):
        _check_chain([A, B])
        self.A = _unexpand(A)
        self.B = _unexpand(B)

    # ------------------------------------------------------------------ shape
    @property
    def shape(self) -> torch.Size:
        lead = torch.broadcast_shapes(self.A.shape[:-2], self.B.shape[:-2])
        return torch.Size((*lead, self.ldim, self.rdim))

    @property
    def ldim(self) -> int:
        return self.A.shape[-2]

    @property
    def mdim(self) -> int:
        return self.A.shape[-1]

    @property
    def rdim(self) -> int:
        return self.B.shape[-1]

    @property
    def rank(self) -> int:
        """Inner dim ``k`` of the factorisation (upper bound on the numerical rank)."""
        return self.mdim

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.A.dtype

    @property
    def device(self) -> torch.device:
        return self.A.device

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={tuple(self.shape)}, rank={self.rank}, dtype={self.dtype})"

    # ------------------------------------------------------------- algebra
    def __matmul__(self, other):
        """``M @ other``: dense ``[..., n, p]`` or FactoredMatrix -> FactoredMatrix; vector -> dense."""
        if isinstance(other, FactoredMatrix):
            return _from_chain([self.A, self.B, other.A, other.B], self, other)
        if not _check_operand(other, self):
            return NotImplemented
        if other.ndim == 1:
            _require(other.shape[0] == self.rdim, self, other)
            return (self.A @ (self.B @ other[:, None])).squeeze(-1)
        return _from_chain([self.A, self.B, other], self, other)

    def __rmatmul__(self, other):
        """``other @ M``: dense ``[..., p, m]`` -> FactoredMatrix; vector -> dense ``[..., n]``."""
        if not _check_operand(other, self):
            return NotImplemented
        if other.ndim == 1:
            _require(other.shape[0] == self.ldim, other, self)
            return ((other[None] @ self.A) @ self.B).squeeze(-2)
        return _from_chain([other, self.A, self.B], other, self)

    def __mul__(self, scalar) -> FactoredMatrix:
        """Scalar multiple ``c M = (c A) B``."""
        if isinstance(scalar, torch.Tensor) and scalar.numel() != 1:
            raise ValueError(
                f"FactoredMatrix * tensor needs a scalar, got shape {tuple(scalar.shape)}; "
                "use @ for matrix products"
            )
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    @property
    def T(self) -> FactoredMatrix:
        """Transpose of the last two dims: ``(AB)^T = B^T A^T``."""
        return FactoredMatrix(self.B.mT, self.A.mT)

    def dense(self, max_bytes: int | None = None) -> torch.Tensor:
        """The product ``A @ B [..., m, n]``; refuses above ``max_bytes`` (default ``DENSE_LIMIT_BYTES``)."""
        limit = DENSE_LIMIT_BYTES if max_bytes is None else max_bytes
        need = math.prod(self.shape) * self.A.element_size()
        if need > limit:
            raise MemoryError(
                f"dense product of shape {tuple(self.shape)} ({self.dtype}) would take "
                f"{_fmt_bytes(need)}, over the limit of {_fmt_bytes(limit)}; use topk/row/col/"
                "norm/svd on the factored form, or pass dense(max_bytes=...) or raise "
                "pycircuits_widgets.factored.DENSE_LIMIT_BYTES"
            )
        return self.A @ self.B

    @property
    def AB(self) -> torch.Tensor:
        """Dense product ``A @ B [..., m, n]``, guarded by ``DENSE_LIMIT_BYTES``."""
        return self.dense()

    @property
    def BA(self) -> torch.Tensor:
        """Reverse product ``B @ A [..., k, k]``; needs a square ``M`` (m == n)."""
        self._require_square("BA")
        return self.B @ self.A

    # ------------------------------------------------------------- spectra
    @property
    def eigenvalues(self) -> torch.Tensor:
        """Nonzero spectrum of ``M``, complex ``[..., min(m, k)]``: ``eig(BA)`` (or ``eig(AB)`` if m < k)."""
        self._require_square("eigenvalues")
        return eigenvalues_of_product(self.A, self.B)

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Thin SVD ``M = U diag(S) Vh`` from the factors' SVDs (DESIGN.md section 4).

        ``A = U_A S_A Vh_A``, ``B = U_B S_B Vh_B``, ``C = S_A Vh_A U_B S_B = U_C S_C Vh_C``,
        so ``U = U_A U_C``, ``S = S_C``, ``Vh = Vh_C Vh_B``. Returns ``U [..., m, r]``,
        ``S [..., r]`` (descending), ``Vh [..., r, n]``, ``r = min(m, k, n)``.
        """
        Ua, Sa, Vha = torch.linalg.svd(self.A, full_matrices=False)
        Ub, Sb, Vhb = torch.linalg.svd(self.B, full_matrices=False)
        C = (Sa[..., :, None] * Vha) @ (Ub * Sb[..., None, :])
        Uc, Sc, Vhc = torch.linalg.svd(C, full_matrices=False)
        return Ua @ Uc, Sc, Vhc @ Vhb

    def collapse_l(self) -> torch.Tensor:
        """``diag(S) Vh [..., r, n]``: ``M`` with its left orthonormal factor ``U`` removed."""
        _, S, Vh = self.svd()
        return S[..., :, None] * Vh

    def collapse_r(self) -> torch.Tensor:
        """``U diag(S) [..., m, r]``: ``M`` with its right orthonormal factor ``Vh`` removed."""
        U, S, _ = self.svd()
        return U * S[..., None, :]

    def norm(self) -> torch.Tensor:
        """Frobenius norm ``||AB||_F [...]``, batched: the Gram route, or the QR route where the Gram
        result is ill-conditioned (``||AB|| << ||A|| ||B||``; see ``frobenius_norm_of_product``)."""
        return frobenius_norm_of_product(self.A, self.B)

    def trace(self) -> torch.Tensor:
        """``tr(AB) = sum_ij A_ij B_ji [...]``; needs m == n."""
        self._require_square("trace")
        return (self.A * self.B.mT).sum((-2, -1))

    # ------------------------------------------------------------- indexing
    def __getitem__(self, idx) -> FactoredMatrix:
        """Select leading dims (ints, slices, tensors, ``...``, ``None``); matrix dims are kept."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        used = sum(
            i.ndim if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
            for i in idx
            if i is not None and i is not Ellipsis
        )
        n_lead = self.ndim - 2
        if used > n_lead:
            raise IndexError(
                f"index {idx!r} uses {used} dims but FactoredMatrix of shape {tuple(self.shape)} "
                f"has {n_lead} leading dims; read matrix entries with row(i), col(j), "
                "entry(i, j), rows(idx) or cols(idx)"
            )
        full = idx + (slice(None), slice(None))
        lead = self.shape[:-2]
        A = self.A.broadcast_to((*lead, *self.A.shape[-2:]))
        B = self.B.broadcast_to((*lead, *self.B.shape[-2:]))
        return FactoredMatrix(A[full], B[full])

    def rows(self, idx) -> FactoredMatrix:
        """Rows ``idx`` (int list, tensor or slice) of ``M``, still factored: ``[..., len, n]``."""
        return FactoredMatrix(self.A[..., idx, :], self.B)

    def cols(self, idx) -> FactoredMatrix:
        """Columns ``idx`` of ``M``, still factored: ``[..., m, len]``."""
        return FactoredMatrix(self.A, self.B[..., :, idx])

    def row(self, i: int) -> torch.Tensor:
        """Row ``i`` of ``M`` as a dense ``[..., n]`` tensor: ``A[i] @ B``."""
        return (self.A[..., i, :].unsqueeze(-2) @ self.B).squeeze(-2)

    def col(self, j: int) -> torch.Tensor:
        """Column ``j`` of ``M`` as a dense ``[..., m]`` tensor: ``A @ B[:, j]``."""
        return self.T.row(j)

    def entry(self, i: int, j: int) -> torch.Tensor:
        """Entry ``M[..., i, j] = A[i] . B[:, j]``, shape ``[...]``."""
        return (self.A[..., i, :] * self.B[..., :, j]).sum(-1)

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


def _check_operand(other, fm: FactoredMatrix) -> bool:
    """False for non-tensors (Python then raises its TypeError); errors on dtype/device mix."""
    if not isinstance(other, torch.Tensor):
        return False
    if other.dtype != fm.dtype or other.device != fm.device:
        raise TypeError(
            f"operand is {other.dtype} on {other.device} but FactoredMatrix is {fm.dtype} on {fm.device}"
        )
    return True


def _require(ok: bool, left, right) -> None:
    if not ok:
        raise ValueError(
            f"cannot multiply shape {tuple(left.shape)} by shape {tuple(right.shape)}: inner dims differ"
        )


def _from_chain(factors, left, right) -> FactoredMatrix:
    """Factored form of a chain product, split at its smallest inner dim (first on ties)."""
    try:
        _check_chain(factors)
    except ValueError as err:
        raise ValueError(
            f"cannot multiply shape {tuple(left.shape)} by shape {tuple(right.shape)} ({err})"
        ) from None
    inner = [f.shape[-1] for f in factors[:-1]]
    split = inner.index(min(inner)) + 1
    return FactoredMatrix(chain_matmul(*factors[:split]), chain_matmul(*factors[split:]))


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
    k-th value are recomputed exactly from the float32 factors.
    """
    if not largest:  # bottom-k of M is top-k of -M; negating a factor is exact in IEEE
        values, r, c = _topk_all(A, -B, k, True, block_bytes)
        return -values, r, c
    m, n = A.shape[0], B.shape[1]
    step = max(1, block_bytes // (n * A.element_size()))
    screen = ProductScreen(A, B) if A.dtype == torch.float32 and A.device.type == "cpu" else None
    values = A.new_empty(0)
    flat_idx = torch.empty(0, dtype=torch.long, device=A.device)
    threshold = None
    # a small exact first block sets the threshold; its torch.topk is the memory peak
    first = max(1, step // 8)
    starts = [0, *range(first, m, step if screen is None else screen.block_rows)]
    for start, stop in zip(starts, [*starts[1:], m]):
        rows = A[start:stop]
        if threshold is None or screen is None:
            cand_v, cand_pos = _candidates(rows @ B, k, threshold)
        else:
            i, j = screen.candidates(torch.arange(start, stop), float(threshold))
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
