"""Refusing non-finite analysis results, naming the weight that holds NaN/inf or the overflow.

A NaN compares false everywhere and an inf wins every top-k: left alone, either comes back as a
silently wrong table (an empty top-k, a positivity of 0.0, a score of inf). Every analysis that can
produce one checks its result and raises ``NonFiniteError`` instead, saying which weight holds
NaN/inf or, where every weight is finite, that the computation overflowed (with the largest
entries of the weights it read, so the user sees which one to rescale). LAPACK calls refuse NaN/inf
input before they run (``linalg``); ``naming_non_finite`` turns that refusal into the same error.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..linalg import NonFiniteError


def _parts(weight):
    """A weight as tensors to scan: itself, or one layer at a time (a checkpoint view's ``LayerStack``)."""
    return (weight,) if isinstance(weight, torch.Tensor) else iter(weight)


def non_finite_error(what: str, model, weights, dtype: torch.dtype) -> NonFiniteError:
    """The error for ``what`` (computed from ``model``'s ``weights``, names like ``"W_E"``, in
    ``dtype``) holding NaN or inf: the first weight with NaN/inf entries, else an overflow."""
    for name in weights:
        w = getattr(model, name)
        n_bad = sum(int((~torch.isfinite(part)).sum()) for part in _parts(w))
        if n_bad:
            return NonFiniteError(f"{what} are not finite: weight {name} {tuple(w.shape)} holds "
                                  f"{n_bad} NaN/inf entries")
    largest = ", ".join(f"{name} {max(float(p.abs().max()) for p in _parts(getattr(model, name))):.3g}"
                        for name in weights)
    return NonFiniteError(
        f"{what} are not finite: the computation overflows {dtype} (largest finite value "
        f"{torch.finfo(dtype).max:.3g}) although every weight is finite; largest |entry|: {largest}. "
        "Rescale that weight, or convert the model to float64"
    )


def require_finite(values: torch.Tensor, what: str, model, weights, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` unchanged if every entry is finite, else ``non_finite_error`` (``dtype``: the one the
    computation ran in, if not ``values``'s). Meta tensors hold no values and pass."""
    if values.device.type != "meta" and not bool(torch.isfinite(values).all()):
        dtype = dtype or (values.real.dtype if values.is_complex() else values.dtype)
        raise non_finite_error(what, model, weights, dtype)
    return values


@contextmanager
def naming_non_finite(what: str, model, weights, dtype: torch.dtype):
    """Inside the block, a ``NonFiniteError`` (an overflow caught early, or ``linalg`` refusing a NaN/inf
    matrix before LAPACK) becomes ``non_finite_error(what, ...)``: the weight holding NaN/inf or the
    overflow of ``dtype``, named as the analysis knows them."""
    try:
        yield
    except NonFiniteError as err:
        raise non_finite_error(what, model, weights, dtype) from err
