"""Test tolerances from a rounding-error model, never from one machine's observed error.

Every floating-point operation rounds with relative error at most the unit roundoff ``u`` (half
the machine epsilon): 2^-24 in float32, 2^-53 in float64, 2^-11 in float16, 2^-8 in bfloat16.

**Worst case** (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1): a
sum or dot product of ``n`` terms, computed in *any* order and blocking, with or without fused
multiply-adds, is within ``gamma(n) * sum |terms|`` of the exact value, ``gamma(n) = n u / (1 - n u)``.
What differs between CPUs (oneDNN/MKL kernels on AMD AVX2 against Intel AVX-512 or AMX) is exactly
that order and blocking: float32 products stay float32 on the CPU (torch's default float32 matmul
precision "highest": no TF32 or bfloat16 down-conversion), so a bound ``gamma(n) * magnitude``
holds on every CPU. ``reduction_tol`` is that bound, for one computation or the difference of two.

**Long chains** (a whole forward pass: thousands of roundings through norms and softmax): the worst
case grows as ``n u`` and is far too loose there, and is no proof anyway once nonlinearities sit in
between. Rounding errors there behave as independent zero-mean variables (Higham and Mary, "A new
approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019): the error
of ``n`` accumulated roundings is within ``lam * sqrt(n) * u * magnitude`` except with probability at
most ``2 n exp(-lam^2 / 2)``. ``chain_tol`` takes ``lam = 8``: under ``1e-13`` per compared value
for any ``n`` here, so no CPU's summation order is a plausible reason to exceed it, while a wrong
formula (errors of order ``magnitude``) is always caught.

``n`` is the reduction length along the computation (``forward_length``), ``magnitude`` the size of
what was summed (the absolute-value sum where the test can compute it, else the quantity's scale).
"""

from __future__ import annotations

import functools
import math

import torch

LAMBDA = 8.0
"""``chain_tol``'s multiple of the standard deviation (see the module docstring)."""


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """``u``: half of ``torch.finfo(dtype).eps``."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative worst-case error of an ``n``-term reduction."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}) in {dtype}: n u = {nu:.3g} >= 1, no bound")
    return nu / (1 - nu)


def gamma_tilde(n: int, dtype: torch.dtype = torch.float32) -> float:
    """The relative error of an ``n``-term reduction: the smaller of ``gamma(n)`` (worst case) and Higham
    and Mary's probabilistic ``LAMBDA sqrt(n) u`` (exceeded with probability at most
    ``2 n exp(-LAMBDA^2 / 2) ~ 2.5e-14 n`` per computed value: module docstring). The second is the
    smaller from ``n = 64`` on: long reductions (a mean over a vocabulary)."""
    return min(gamma(n, dtype), LAMBDA * math.sqrt(n) * unit_roundoff(dtype))


def reduction_tol(n: int, magnitude: float, dtype: torch.dtype = torch.float32, computations: int = 1) -> float:
    """Worst-case bound on the error of an ``n``-term reduction of absolute sum ``magnitude`` in
    ``dtype``, any summation order: ``computations * gamma(n) * magnitude``. ``computations=2``
    bounds the difference of two such computations (ours and a reference, both in ``dtype``); 1
    the distance of one from an exact (float64) oracle."""
    return computations * gamma(n, dtype) * magnitude


def chain_tol(n: int, magnitude: float, dtype: torch.dtype = torch.float32, computations: int = 2) -> float:
    """Probabilistic bound on the error of a chain of ``n`` roundings of size ``magnitude`` in
    ``dtype``: ``computations * LAMBDA * sqrt(n) * u * magnitude`` (module docstring)."""
    return computations * LAMBDA * math.sqrt(n) * unit_roundoff(dtype) * magnitude


def forward_length(*, n_layers: int, d_model: int, d_head: int, n_heads: int, n_tokens: int, d_mlp: int = 0,
                   to: str = "logits") -> int:
    """The number of terms summed along the longest path of a transformer forward pass, up to the
    last layer's attention scores (``to="scores"``) or the logits: per layer, the norm's statistics
    (``d_model``), the query/key/value projections (``d_model``), ``pattern @ v`` (``n_tokens``), the
    output projection (``n_heads * d_head``) and the MLP (norm, in and out: ``2 d_model + d_mlp``);
    then the last layer's norm, projections and ``q . k`` (``2 d_model + d_head``), or the final
    norm and the unembedding (``2 d_model``)."""
    layer = 2 * d_model + n_tokens + n_heads * d_head + (2 * d_model + d_mlp if d_mlp else 0)
    if to == "scores":
        return (n_layers - 1) * layer + 2 * d_model + d_head
    if to == "logits":
        return n_layers * layer + 2 * d_model
    raise ValueError(f"forward_length: to must be 'scores' or 'logits', got {to!r}")


def model_forward_length(cfg, n_tokens: int, to: str = "logits") -> int:
    """``forward_length`` of a ``ModelConfig`` (a mixture of experts counts its chosen experts' MLPs
    as one wider MLP: ``experts_per_token * d_mlp`` terms summed into the stream)."""
    d_mlp = (cfg.d_mlp or 0) * (getattr(cfg, "experts_per_token", None) or 1)
    return forward_length(n_layers=cfg.n_layers, d_model=cfg.d_model, d_head=cfg.d_head, n_heads=cfg.n_heads,
                          n_tokens=n_tokens, d_mlp=d_mlp, to=to)


def unembed_magnitude(model, cache) -> float:
    """The largest absolute sum the unembedding forms: ``max(|x_norm| @ |W_U| + |b_U|)`` over the
    run's positions and the vocabulary, ``x_norm`` the final residual stream as the unembedding
    reads it (centred for layernorm, divided by ``ln_scale``). Larger than ``max|logit|`` where the
    terms cancel, which is where rounding shows."""
    resid = cache.resid[:, -1].double()
    if model.cfg.normalization == "layernorm":
        resid = resid - resid.mean(-1, keepdim=True)
    x = resid / cache.ln_scale[:, -1, :, None].double()
    sums = x.abs() @ model.W_U.double().abs()
    if model.b_U is not None:
        sums = sums + model.b_U.double().abs()
    return float(sums.max())


def score_spread(patterns: torch.Tensor) -> float:
    """The scores' largest spread within a row, ``log(p_max / p_min)`` over the nonzero entries
    of ``patterns [..., dest, src]``: the size of the attention scores a softmax saw (an entry
    that underflowed to 0 counts at the dtype's smallest normal, a lower bound)."""
    p = patterns.double()
    tiny = torch.finfo(patterns.dtype).tiny
    logs = p.clamp_min(tiny).log()
    visible = p > 0
    hi = logs.masked_fill(~visible, -math.inf).amax(-1)
    lo = torch.where(visible.any(-1), logs.masked_fill(~visible, math.inf).amin(-1), hi)
    return float((hi - lo).max())


def pattern_tol(cfg, n_tokens: int, patterns: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """Bound on the difference of two ``dtype`` computations of attention patterns: score errors
    ``chain_tol(forward_length(to="scores"), score spread)`` from each, and a softmax moves
    ``p_i`` by at most ``2 p_i (1 - p_i) max|ds| <= max|ds| / 2``."""
    return chain_tol(model_forward_length(cfg, n_tokens, to="scores"), score_spread(patterns), dtype) / 2


def logit_tol(model, cache, n_tokens: int, dtype: torch.dtype = torch.float32) -> float:
    """Bound on the difference of two ``dtype`` forward passes' logits:
    ``chain_tol(forward_length(to="logits"), unembed_magnitude)`` (a final soft-cap only shrinks it)."""
    return chain_tol(model_forward_length(model.cfg, n_tokens), unembed_magnitude(model, cache), dtype)


def product_tol(*factors: torch.Tensor, computations: int = 2) -> torch.Tensor:
    """Elementwise worst-case bound on the error of the product ``factors[0] @ factors[1] @ ...``
    computed in the factors' dtype, in any order: ``gamma(n) * (|F0| @ |F1| @ ...)`` with ``n``
    the sum of the inner dimensions (Higham section 3.5, ``|fl(AB) - AB| <= gamma_n |A||B|``, chained),
    times ``computations`` (2: ours and a reference each computed it in that dtype)."""
    n = sum(f.shape[-1] for f in factors[:-1])
    magnitude = factors[0].double().abs()
    for f in factors[1:]:
        magnitude = magnitude @ f.double().abs()
    return computations * gamma(n, factors[0].dtype) * magnitude


def centred_product_tol(*factors: torch.Tensor, dtype: torch.dtype = torch.float32, errors=None,
                        centre: bool = True) -> torch.Tensor:
    """Elementwise bound on ``P = F0 @ F1 @ ...`` computed in ``dtype`` from the factors
    (rounded to ``dtype`` first) and then centred along its last dim, ``P - mean_j P`` (or, the same
    sum in another order, with the last factor's columns centred first), against the exact result.

    Roundings along an entry's longest path: one per factor (its cast), the inner dimensions (Higham
    3.5), and the centring's mean (``n_cols`` terms) and subtraction: ``n`` in all. Entry ``(i, j)``
    then sums terms of size ``M_ij + mean_j M_ij``, ``M = |F0| @ |F1| @ ...``: the bound is
    ``gamma_tilde(n) (M + mean_j M)`` (worst case up to 64 roundings, probabilistic beyond).
    ``errors``: per factor, None or an elementwise bound on that factor's own error (a normalised
    embedding's, ``normalization_tol``), carried through the product with the other factors'
    absolute values (and centred likewise). ``centre=False``: the product alone."""
    n = len(factors) + sum(f.shape[-1] for f in factors[:-1]) + (factors[-1].shape[-1] + 1 if centre else 0)
    sizes = [f.double().abs() for f in factors]
    bound = gamma_tilde(n, dtype) * functools.reduce(torch.matmul, sizes)
    for i, error in enumerate(errors or ()):
        if error is not None:
            carried = [*sizes[:i], torch.as_tensor(error).double(), *sizes[i + 1:]]
            bound = bound + functools.reduce(torch.matmul, carried)
    return bound + bound.mean(-1, keepdim=True) if centre else bound


def normalization_tol(x: torch.Tensor, eps: float, centred: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise worst-case bound on a norm's output ``y = (x - mu) / sqrt(mean((x - mu)^2) + eps)``
    (layer norm; ``centred=False``: RMSNorm, ``mu = 0``) computed in ``dtype``, against the exact ``y``
    of the same rows ``x [..., d]``: ``gamma(d + 10) (|y| + mean|x| / sigma)``.

    The mean is off by at most ``gamma(d + 1) mean|x|`` (``d`` terms and the division), which the
    centred entry carries, divided by ``sigma``; the variance's ``d + 2`` roundings (squares, sum,
    division) and the entries' own make ``sigma^2`` relatively off by ``gamma(d + 6)`` (the mean's
    error enters only at second order: the centred entries sum to zero), ``sigma`` by half that plus
    the square root's rounding, and the division adds one: under ``gamma(d + 10)`` of ``|y|``."""
    x = x.double()
    d = x.shape[-1]
    c = x - x.mean(-1, keepdim=True) if centred else x
    sigma = (c.square().mean(-1, keepdim=True) + eps).sqrt()
    spread = x.abs().mean(-1, keepdim=True) / sigma if centred else 0
    return gamma(d + 10, dtype) * ((c / sigma).abs() + spread)


def rotary_table_tol(position: int) -> float:
    """Largest error of an entry of a float32 rotary table at ``position`` (the forward's, and Hugging
    Face's rotary modules': ``cos`` and ``sin`` of ``position * inv_freq`` with ``inv_freq <= 1``) against
    the exact rotation by the same frequencies: the angle's product rounds by ``position u``, cos/sin
    are within 1 ulp (at most 2u: SLEEF's and glibc's float32 functions) and the attention scaling's
    product rounds once: ``(position + 3) u``, float32's ``u``. A 2 x 2 rotation block whose entries are
    each off by ``e`` moves a vector by at most ``2 e`` its norm, so a score ``q_t . k_s`` of two
    vectors rotated by such tables is within ``2 (e_t + e_s) ||q|| ||k||`` of the exact one."""
    return (position + 3) * unit_roundoff(torch.float32)


POSITIVITY_TOL = unit_roundoff(torch.float32) + 1e-9
"""Eigenvalue positivities ``sum Re(l) / sum |l|`` (in ``[-1, 1]``) of a float64 model, computed in float64
and returned in float32 (the analysis's output dtype), against a float64 oracle's: the float32 copy
rounds by at most ``u``; the two float64 spectra (backward errors ~1e-13 of the circuits' norms,
``factorization_tol``) agree far below the float64 margin 1e-9."""


def centred_mean_tol(x: torch.Tensor, dim: int = -1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bound on the mean along ``dim`` of ``x`` centred along ``dim`` in ``dtype``, ``x - mean(x)``, which
    is exactly zero: the computed mean is off by ``gamma(n + 1) mean|x|`` (``n`` terms and the
    division), each centred entry rounds by ``u`` of its size (``|x_i| + |mean x| ``, at most
    ``2 mean|x|`` on average), and the test's own mean of the centred entries adds ``gamma(n + 1)`` of
    their mean size: ``3 gamma(n + 2) mean|x|`` in all, with ``x`` the weights *before* centring."""
    n = x.shape[dim]
    return 3 * gamma(n + 2, dtype) * x.double().abs().mean(dim)


def path_expansion_tol(model, pe) -> float:
    """Bound on the rounding of a float64 path expansion's sum against the model's float64 logits: a
    term's logits are products through at most ``n_layers`` attention contractions (length ``pos``)
    and ``d_model``-long residual contractions, each entry off by at most about
    ``eps (pos + d_model) n_layers`` of its magnitude; summing ``n_terms`` of them adds ``eps n_terms``
    of the largest partial sum; the forward rounds the same way. So the sum may differ from the logits
    by ``eps64 (n_terms + n_layers (pos + d_model)) sum_i max|term_i|`` (terms can cancel: their
    magnitudes, not the logits', bound the rounding). A final soft-cap ``c tanh(x / c)`` has slope
    <= 1, so the same bound holds after it."""
    c = model.cfg
    n = len(pe.terms) + c.n_layers * (pe.tokens.shape[1] + c.d_model)
    return torch.finfo(torch.float64).eps * n * sum(float(pe.term_logits(i).abs().amax()) for i in range(len(pe.terms)))


COPY = {"rtol": gamma(2), "atol": 0}
"""A view's number against the analysis function's own result (the same function on the same weights):
the number and the view's float32 copy of it, each at most one rounding from the analysis's value
(``np.testing.assert_allclose(..., **COPY)``). A recomputation by another route differs by more and fails."""


LAPACK_THRESHOLD = 35.0
"""The test ratio LAPACK's own test suite accepts from its SVD routines (``TESTING/svd.in``)."""


def factorization_tol(n: int, magnitude: float, dtype: torch.dtype = torch.float32, computations: int = 1) -> float:
    """Bound on the error of a Householder-based factorization (QR, SVD; eigenvalues through the
    Hessenberg QR algorithm) of a matrix with at most ``n`` rows or columns and norm ``magnitude``:
    ``computations * LAPACK_THRESHOLD * n * eps * magnitude``.

    These routines are backward stable with a constant that has no closed form (Higham, chapters 19
    and 20: ``gamma~_{mn}``, "a small integer constant" times ``mn u``): the computed factors are the
    exact ones of a matrix within ``c n eps magnitude`` of the input, and are orthonormal within
    ``c n eps``. LAPACK's test suite accepts an implementation whose residual
    ``||A - U S V^T|| / (n ||A|| eps)`` and orthogonality ``||I - U^T U|| / (n eps)`` stay under
    ``LAPACK_THRESHOLD``; this is that acceptance bound, for the residual (``magnitude`` the input's
    norm) and the orthogonality (``magnitude`` 1). By Weyl's inequality it bounds each singular
    value's error too. ``computations`` adds the bounds of several such steps (a chain of
    factorizations, or ours and a reference's)."""
    return computations * LAPACK_THRESHOLD * n * torch.finfo(dtype).eps * magnitude


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tol) -> None:
    """``|actual - expected| <= tol`` elementwise (``tol`` a number or a tensor), naming the worst entry."""
    excess = (actual.double() - expected.double()).abs() - torch.as_tensor(tol, dtype=torch.float64)
    assert float(excess.max()) <= 0, f"off by {float(excess.max()):.3g} beyond the tolerance at {int(excess.argmax())}"


def score_tol(qk: torch.Tensor, ov: torch.Tensor, dqk, dov) -> torch.Tensor:
    """Elementwise bound on a skip-trigram score ``qk+ ov+`` (``x+ = max(x, 0)``) computed from entries
    within ``dqk`` and ``dov`` of the exact ``qk`` and ``ov`` (broadcast together): clamping moves no
    entry further, so the product is off by ``dqk ov+ + qk+ dov + dqk dov``, plus its own rounding
    (``gamma(1)``, float32's: a score is multiplied in float32)."""
    qk, ov = qk.double().clamp_min(0), ov.double().clamp_min(0)
    dqk, dov = torch.as_tensor(dqk).double(), torch.as_tensor(dov).double()
    return dqk * ov + qk * dov + dqk * dov + gamma(1) * qk * ov
