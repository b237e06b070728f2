"""Positional attention by relative offset: the positional QK term against measured attention.

A previous-token head does pointer arithmetic on positions: its attention score from position
``i`` to ``i - k`` depends mostly on the offset ``k``. Two curves per head, offset ``k = 0..K``:

* ``positional_scores_by_offset``: what the weights say. Models with a positional table
  (Shortformer, learned): the positional term of the QK circuit
  ``P = W_pos W_Q W_K^T W_pos^T / attn_scale`` ``[dest pos, src pos]`` (``positional_qk_circuit``),
  averaged along its ``k``-th sub-diagonal, ``s(k) = mean_i P[i, i - k]`` over ``i in k..n-1``.
  Rotary models have no table: the rotary rule ``s(k) = q̄ R(k) k̄^T / attn_scale``, with ``q̄``
  and ``k̄`` the mean (unrotated) query and key of the head over the text and ``R(k)`` the rotary
  rotation by ``k`` positions. By linearity it is the score the average query gives the
  average key ``k`` positions back.
* ``attention_by_offset``: what the head does. ``a(k) = mean_i A[i, i - k]`` over ``i in k..n-1``
  of its attention pattern on a text.
"""

from __future__ import annotations

import functools

import torch

from .circuits import model_name, positional_qk_circuit
from .pieces import drained
from .rotary import rotations


def _diagonal_means(M: torch.Tensor, max_offset: int) -> torch.Tensor:
    """``[..., n, n] -> [..., max_offset + 1]``: mean of the ``k``-th sub-diagonal ``M[i, i - k]``."""
    return torch.stack([torch.diagonal(M, offset=-k, dim1=-2, dim2=-1).mean(-1) for k in range(max_offset + 1)], -1)


def _check_offsets(n_pos: int, max_offset: int) -> None:
    if not 1 <= n_pos:
        raise ValueError(f"n_pos must be >= 1, got {n_pos}")
    if not 0 <= max_offset < n_pos:
        raise ValueError(f"max_offset must be in 0..{n_pos - 1} (n_pos={n_pos}), got {max_offset}")


def positional_scores_by_offset(model, n_pos: int, max_offset: int, cache=None) -> torch.Tensor:
    """Positional attention score by offset for every head: float32 ``[L, H, max_offset + 1]``.

    Positional table: ``mean_i (W_pos W_Q W_K^T W_pos^T)[i, i - k] / attn_scale`` over the first
    ``n_pos`` positions. Rotary: ``q̄ R(k) k̄^T / attn_scale`` with ``q̄, k̄`` from ``cache`` (the
    activation cache of a run, required for rotary models). Module docstring for both rules.
    Refuses models with no positional information.
    """
    return drained(positional_scores_by_offset_steps(model, n_pos, max_offset, cache))


def positional_scores_by_offset_steps(model, n_pos: int, max_offset: int, cache=None):
    """``positional_scores_by_offset`` in pieces (``analysis.pieces``): one layer each (the same
    work for each), yielding ``(done, n_layers)`` after it; returns the ``[L, H, max_offset + 1]``
    scores. The arguments are checked before the first piece."""
    cfg = model.cfg
    _check_offsets(n_pos, max_offset)
    if cfg.positional == "rotary":
        if cache is None:
            raise ValueError("rotary models need the activation cache of a text (the rule uses its mean query and key)")
        layer_scores = functools.partial(_rotary_layer, model, cache, max_offset)
    else:
        if cfg.positional == "none" or getattr(model, "W_pos", None) is None:
            raise ValueError(f"model {model_name(model)!r} has no positional information (positional={cfg.positional!r})")
        if n_pos > cfg.n_ctx:
            raise ValueError(f"n_pos={n_pos} exceeds the model's context n_ctx={cfg.n_ctx}")
        layer_scores = functools.partial(_table_layer, model, n_pos, max_offset)
    return _by_layer(model, max_offset, layer_scores)


def _by_layer(model, max_offset: int, layer_scores):
    """The pieces of ``positional_scores_by_offset_steps``: ``layer_scores(layer) -> [H, max_offset + 1]``."""
    cfg = model.cfg
    out = torch.empty(cfg.n_layers, cfg.n_heads, max_offset + 1, device=model.W_Q.device)
    yield 0, cfg.n_layers
    for layer in range(cfg.n_layers):
        with torch.no_grad():
            out[layer] = layer_scores(layer)
        yield layer + 1, cfg.n_layers
    return out


def _table_layer(model, n_pos: int, max_offset: int, layer: int) -> torch.Tensor:
    """One layer's scores from the positional table (``[H, n, n]`` at a time: bounded memory at n_ctx 1024)."""
    circuit = positional_qk_circuit(model, layer)  # [H] x [n_ctx, n_ctx], factored
    P = circuit.A[:, :n_pos] @ circuit.B[:, :, :n_pos]
    return _diagonal_means(P.float(), max_offset) / model.cfg.attn_scale


def _rotary_layer(model, cache, max_offset: int, layer: int) -> torch.Tensor:
    """One layer's scores by the rotary rule (module docstring)."""
    cfg = model.cfg
    x = cache.resid[:, layer] / cache.ln_scale[:, layer, :, None]
    if cfg.normalization == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    q = torch.einsum("bpd,hde->he", x, model.W_Q[layer]) / x.shape[0] / x.shape[1]
    k = torch.einsum("bpd,hde->he", x, model.W_K[layer]) / x.shape[0] / x.shape[1]
    if model.b_Q is not None:
        q = q + model.b_Q[layer]
    if model.b_K is not None:
        k = k + model.b_K[layer]
    # the mean query k positions after the mean key: R(k) between them, by this layer's rule
    R = rotations(cfg, range(max_offset + 1), q.dtype, q.device, layer=layer)
    return torch.einsum("he,nef,hf->hn", q, R, k).float() / cfg.attn_scale


def attention_by_offset(patterns: torch.Tensor, max_offset: int) -> torch.Tensor:
    """Measured mean attention by offset: ``patterns [L, H, n, n]`` (one text) -> ``[L, H, max_offset + 1]``.

    ``a(k) = mean_i A[i, i - k]`` over destinations ``i >= k``.
    """
    if patterns.ndim != 4 or patterns.shape[-1] != patterns.shape[-2]:
        raise ValueError(f"patterns must be [L, H, n, n], got {tuple(patterns.shape)}")
    _check_offsets(patterns.shape[-1], max_offset)
    return _diagonal_means(patterns.float(), max_offset)

