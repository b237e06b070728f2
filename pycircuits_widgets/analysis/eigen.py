"""Eigenvalue (copying) analysis of every head's full OV and full QK circuit.

Positivity of a square circuit ``M``: ``sum(lambda) / sum(|lambda|)`` in ``[-1, 1]``; near +1
the circuit maps a token to itself (OV: copying; QK: attending to the same token).

The full circuits are ``d_vocab x d_vocab`` but rank ``<= d_head``; their nonzero spectrum is
that of a ``d_head x d_head`` matrix (``eig(XY) = eig(YX)`` off zero). The vocab-sized part is
shared by all heads and multiplied once:

* OV: ``eig(W_E W_V W_O W_U) = eig(W_O (W_U W_E) W_V)``, ``W_U W_E [d_model, d_model]``;
* QK: ``eig(W_E W_Q W_K^T W_E^T) = eig(W_K^T (W_E^T W_E) W_Q)``.

``W_E`` is the embedding each head reads (``circuits.embedding``): normalised per token for
layer 0 where that is exact (the paper's choice), raw elsewhere.

Eigenvalues are computed in float64 (the ``d_head x d_head`` matrices are tiny).
"""

from __future__ import annotations

import torch

from ..factored import FactoredMatrix
from .circuits import embedding, embedding_is_normalized, refuse_rotary_qk

KINDS = ("OV", "QK")


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind


def token_gram(model, kind: str, layer: int | None = None) -> torch.Tensor:
    """The shared vocab-sized middle of the full circuit, ``[d_model, d_model]`` (float64).

    OV: ``W_U W_E`` (out side back to src side); QK: ``W_E^T W_E`` (key side to query side).
    ``layer``: ``W_E`` as that layer's heads read it (``circuits.embedding``); None: the raw ``W_E``.
    """
    W_E = model.W_E if layer is None else embedding(model, layer)
    # the vocab-sized contraction runs in the weights' dtype (float32 GEMM; float64 would be
    # ~2x slower and double the memory), the small rest in float64
    return (model.W_U @ W_E if _check_kind(kind) == "OV" else W_E.T @ W_E).double()


def eigenvalues(model, kind: str) -> torch.Tensor:
    """Nonzero spectrum of every head's full circuit: complex128 ``[L, H, d_head]``.

    OV: eigenvalues of ``W_E W_V W_O W_U``; QK: of ``W_E W_Q W_K^T W_E^T`` (paper:
    ``W_U W_OV W_E`` and ``W_E^T W_QK W_E``). The remaining ``d_vocab - d_head`` eigenvalues are 0.
    Refuses QK for rotary models (the QK circuit depends on position there).
    """
    if _check_kind(kind) == "QK":
        refuse_rotary_qk(model, "the QK eigenvalue spectrum")
    G = layer_grams(model, kind)
    if kind == "OV":  # eig(W_O G W_V), d_head x d_head
        circuit = FactoredMatrix(model.W_V.double(), model.W_O.double() @ G)
    else:
        circuit = FactoredMatrix(model.W_Q.double(), model.W_K.double().mT @ G)
    if not bool(torch.isfinite(circuit.B).all() and torch.isfinite(circuit.A).all()):
        # LAPACK would return NaN (printing DGEBAL to stderr) and positivity would read it as 0.0
        raise ValueError(f"the {kind} circuits are not finite: the model's weights hold NaN or inf")
    return circuit.eigenvalues


def layer_grams(model, kind: str) -> torch.Tensor:
    """``token_gram`` of the embedding each layer reads, ``[n_layers, 1, d_model, d_model]``: only
    layer 0 can differ from the raw one (``circuits.embedding``), so one or two products."""
    raw = token_gram(model, kind)
    grams = raw.expand(model.cfg.n_layers, 1, *raw.shape).clone()
    if model.cfg.n_layers and embedding_is_normalized(model, 0):
        grams[0, 0] = token_gram(model, kind, 0)
    return grams


def positivity(eigs: torch.Tensor) -> torch.Tensor:
    """``sum(lambda) / sum(|lambda|)`` over the last dim (real; 0 for an all-zero spectrum)."""
    total = eigs.abs().sum(-1)
    return torch.where(total > 0, eigs.sum(-1).real / total.clamp_min(torch.finfo(total.dtype).tiny), 0.0)


def eigenvalue_positivity(model, kind: str = "OV") -> torch.Tensor:
    """Positivity of every head's full OV or QK circuit: float32 ``[L, H]`` in ``[-1, 1]``.

    ``sum(lambda) / sum(|lambda|)`` of ``W_E W_V W_O W_U`` (OV, copying) or
    ``W_E W_Q W_K^T W_E^T`` (QK, same-token attention). One shared ``[d_model, d_model]``
    product, then one batched ``eig`` of ``[L, H, d_head, d_head]``. Refuses QK for rotary models.
    """
    return positivity(eigenvalues(model, kind)).float()
