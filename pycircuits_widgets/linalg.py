"""The package's one door to LAPACK: every eigen, SVD, QR, Cholesky and spectral-norm call, refused
on non-finite input.

LAPACK has no defined behaviour on NaN/inf. On AMD hosts ``torch.linalg.eigvals`` of an inf matrix
returns NaN; on Intel hosts oneMKL prints ``Parameter 3 was incorrect on entry to SGEBAL`` and the
process dies (SIGSEGV or SIGABRT): in a notebook, a dead kernel with all its state. So each function
here first checks its input with one ``torch.isfinite(x).all()`` pass and raises ``NonFiniteError``
naming ``what`` (the caller's description of the matrix) instead of calling LAPACK. Analyses catch it
and name the weight or the overflow behind it (``analysis.finite``). A static test keeps LAPACK calls
out of every other module.

16-bit input is computed in float32 (``linalg_dtype``): LAPACK has no 16-bit kernels. Meta tensors
hold no values: they pass the check and only carry shapes through.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch


class NonFiniteError(ValueError):
    """An analysis result, or a matrix handed to LAPACK, would hold NaN or inf (the message names
    the weight, the overflow or the matrix)."""


def linalg_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype spectra, norms and SVDs are computed in: float32 for 16-bit floats (LAPACK has no
    16-bit kernels, and a bf16 Gram loses a norm's low bits), else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def require_finite_input(x: torch.Tensor, what: str, routine: str) -> torch.Tensor:
    """``x`` in its ``linalg_dtype`` if every entry is finite, else ``NonFiniteError`` saying that
    ``what`` holds NaN/inf and ``routine`` was not run on it."""
    if x.device.type != "meta" and not bool(torch.isfinite(x).all()):
        n_bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteError(
            f"{what} {tuple(x.shape)} is not finite ({n_bad} NaN/inf of {x.numel()} entries): {routine} was "
            "not run on it (LAPACK has no result for NaN/inf, and on Intel oneMKL it aborts the process)"
        )
    return x.to(linalg_dtype(x.dtype))


def eigvals(x: torch.Tensor, what: str) -> torch.Tensor:
    """Eigenvalues ``[..., n]`` (complex) of a batch ``[..., n, n]``, its matrices split over torch's threads.

    LAPACK's ``geev`` runs one small matrix at a time on one core (144 heads' ``64 x 64`` circuits:
    ~70 ms, a quarter of the eigenvalue view's time at GPT-2-small shapes); torch releases the GIL
    inside it, so a thread per chunk uses every core. Order: LAPACK's, per matrix."""
    x = require_finite_input(x, what, "eigvals")
    chunks = min(torch.get_num_threads(), math.prod(x.shape[:-2]))
    if chunks < 2 or x.shape[-1] < 16:  # small problems: thread start-up would dominate
        return torch.linalg.eigvals(x)
    flat = x.reshape(-1, *x.shape[-2:])
    with ThreadPoolExecutor(chunks) as pool:
        parts = list(pool.map(torch.linalg.eigvals, flat.chunk(chunks)))
    return torch.cat(parts).reshape(*x.shape[:-1])


def eigh(x: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [..., n] ascending, vectors [..., n, n])`` of symmetric ``x [..., n, n]`` (``torch.linalg.eigh``)."""
    return torch.linalg.eigh(require_finite_input(x, what, "eigh"))


def cholesky_ex(x: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L [..., n, n], info [...])`` of ``torch.linalg.cholesky_ex``: ``info != 0`` where ``x`` is not
    positive definite (no exception for that; NaN/inf is refused)."""
    return torch.linalg.cholesky_ex(require_finite_input(x, what, "cholesky"))


def qr_r(x: torch.Tensor, what: str) -> torch.Tensor:
    """The triangle ``R [..., min(m, n), n]`` of ``x [..., m, n] = Q R`` (``Q`` is not formed)."""
    return torch.linalg.qr(require_finite_input(x, what, "qr"), mode="r").R


def svd(x: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD ``(U [..., m, r], S [..., r] descending, Vh [..., r, n])``, ``r = min(m, n)``: ``torch.linalg.svd``'s
    convention (``x = U diag(S) Vh``)."""
    return torch.linalg.svd(require_finite_input(x, what, "svd"), full_matrices=False)


def spectral_norm(x: torch.Tensor, what: str) -> torch.Tensor:
    """Largest singular value ``[...]`` of ``x [..., m, n]`` (``matrix_norm(x, 2)``: an SVD)."""
    return torch.linalg.matrix_norm(require_finite_input(x, what, "the spectral norm's svd"), 2)
