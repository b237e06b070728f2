"""Virtual attention heads (V-composition): the strongest earlier -> later OV products.

Paper (two-layer path expansion): a pair of heads ``h1`` (earlier layer) then ``h2`` acts like
one *virtual head* with attention ``A^{h2} A^{h1}`` and OV circuit ``W_OV^{h2} W_OV^{h1}``
(row convention: ``W_OV^{h1} W_OV^{h2} = W_V^{h1} W_O^{h1} W_V^{h2} W_O^{h2}``, ``[d_model, d_model]``).
For every pair this module gives

* ``norm``: ``||W_OV^{h1} W_OV^{h2}||_F`` (not normalised: how much the virtual head can write;
  ``composition_scores(model, "V")`` is the same norm over ``||W_OV^{h1}|| ||W_OV^{h2}||``);
* ``positivity``: eigenvalue positivity ``sum(lambda) / sum(|lambda|)`` of its full OV circuit
  ``W_E W_OV^{h1} W_OV^{h2} W_U`` ``[src token, out token]`` (near +1: the pair copies);
* the tokens it copies most: largest diagonal entries of the row-centred full circuit,
  ``OV[t, t] - mean_o OV[t, o]`` (the logit it raises on ``t`` itself relative to the average token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..factored import eigenvalues_of_product, frobenius_norm_of_product, linalg_dtype
from .circuits import Head, check_earlier, full_virtual_ov_circuit
from .eigen import positivity, token_gram
from .finite import naming_non_finite, require_finite
from .pieces import drained


@dataclass(frozen=True)
class VirtualHead:
    """One virtual head ``h1 -> h2``: ``norm``, ``positivity`` and its most-copied ``copies``
    (``[(token id, centred diagonal value)]``, best first)."""

    h1: Head
    h2: Head
    norm: float
    positivity: float
    copies: list[tuple[int, float]]


def virtual_head_norms(model) -> torch.Tensor:
    """``||W_OV^{h1} W_OV^{h2}||_F`` for every pair: float32 ``[L, H, L, H]`` indexed ``[l1, h1, l2, h2]``,
    NaN where ``l1 >= l2``. Each norm without forming a ``d_model x d_model`` matrix (QR route)."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    out = torch.full((L, H, L, H), float("nan"), device=model.W_V.device)
    with torch.no_grad():
        for l1 in range(L - 1):
            for l2 in range(l1 + 1, L):
                A1, B1 = model.W_V[l1][:, None], model.W_O[l1][:, None]  # [H, 1, ...]
                C2, D2 = model.W_V[l2][None], model.W_O[l2][None]        # [1, H, ...]
                with naming_non_finite("the virtual head norms", model, ("W_V", "W_O"), linalg_dtype(A1.dtype)):
                    norms = frobenius_norm_of_product(A1, B1, C2, D2)
                out[l1, :, l2] = require_finite(norms, "the virtual head norms", model, ("W_V", "W_O")).float()
    return out


def virtual_head_positivity(model, h1: Head, h2: Head, gram: torch.Tensor | None = None) -> float:
    """Eigenvalue positivity of ``W_E W_OV^{h1} W_OV^{h2} W_U`` (nonzero spectrum from a ``d_head`` square).

    ``gram``: ``token_gram(model, "OV")`` (``W_U W_E [d_model, d_model]``), to share it between pairs.
    """
    (l1, i1), (l2, i2) = check_earlier(model, h1, h2)
    factors = [x.double() for x in (model.W_V[l1, i1], model.W_O[l1, i1], model.W_V[l2, i2], model.W_O[l2, i2])]
    with torch.no_grad(), naming_non_finite(f"the eigenvalues of the virtual head {h1} -> {h2}'s token circuit", model,
                                            ("W_E", "W_V", "W_O", "W_U"), linalg_dtype(model.W_E.dtype)):
        gram = token_gram(model, "OV") if gram is None else gram
        return float(positivity(eigenvalues_of_product(*factors, gram)))


def virtual_head_copies(model, h1: Head, h2: Head, n: int = 10) -> list[tuple[int, float]]:
    """Top ``n`` of the row-centred diagonal ``OV[t, t] - mean_o OV[t, o]`` of the full virtual OV circuit."""
    circuit = full_virtual_ov_circuit(model, h1, h2)
    if not 1 <= n <= circuit.shape[-1]:
        raise ValueError(f"n must be in 1..{circuit.shape[-1]}, got {n}")
    with torch.no_grad():
        left, right = circuit.A.float(), circuit.B.float()  # [V, d_head], [d_head, V]
        diagonal = (left * right.mT).sum(1) - left @ right.mean(1)
        values, ids = torch.topk(diagonal, n)
    return list(zip(ids.tolist(), values.tolist()))


def top_virtual_heads(model, k: int = 10, n_copies: int = 10) -> list[VirtualHead]:
    """The ``k`` virtual heads with the largest ``norm``, strongest first (module docstring)."""
    return drained(top_virtual_heads_steps(model, k, n_copies))


def top_virtual_heads_steps(model, k: int = 10, n_copies: int = 10, into: list | None = None):
    """``top_virtual_heads`` in pieces (``analysis.pieces``): yields ``(done, total)`` after each
    virtual head (its positivity and copied tokens: the same work for each), strongest first, after
    every pair's norm (not a piece of the count); returns the list. ``into`` (a list, optional) is
    that list, filled as the pieces end, for a caller that shows the strongest while the rest come."""
    norms = virtual_head_norms(model)
    defined = torch.nan_to_num(norms, nan=-1.0).flatten()
    n_pairs = int((defined >= 0).sum())
    if n_pairs == 0:
        raise ValueError(f"virtual heads need at least 2 layers, got n_layers={model.cfg.n_layers}")
    if not 1 <= k:
        raise ValueError(f"k must be >= 1, got {k}")
    _, order = torch.topk(defined, min(k, n_pairs))
    L, H = model.cfg.n_layers, model.cfg.n_heads
    with torch.no_grad():
        gram = token_gram(model, "OV")  # the vocab-sized product, once for all pairs
    heads = [] if into is None else into
    yield 0, len(order)
    for flat in order.tolist():
        l1, i1, l2, i2 = flat // (H * L * H), flat // (L * H) % H, flat // H % L, flat % H
        h1, h2 = (l1, i1), (l2, i2)
        heads.append(VirtualHead(h1=h1, h2=h2, norm=float(norms[l1, i1, l2, i2]),
                                 positivity=virtual_head_positivity(model, h1, h2, gram),
                                 copies=virtual_head_copies(model, h1, h2, n_copies)))
        yield len(heads), len(order)
    return heads
