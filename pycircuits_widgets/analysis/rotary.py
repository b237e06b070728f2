"""Rotary positions: every QK circuit read at a stated query - key offset.

Under rotary positions the attention score between a query at position ``t`` and a key at ``s``
is ``(x_t W_Q) R(t - s) (x_s W_K)^T``: one fixed bilinear form per offset ``t - s``, so each QK
circuit (skip-trigrams, QK eigenvalues, Q/K-composition, the induction mechanism) is a family of
token x token matrices ``W_E W_Q R(offset) W_K^T W_E^T``. Analyses read it at one offset (an int)
or over a window of offsets (an iterable), reduced per entry by ``"max"`` (the strongest offset,
reported) or ``"mean"`` (the mean of the per-offset values). Without an offset they use
``DEFAULT_OFFSETS`` and say so (``describe``). Models whose positions are not rotary have one QK
circuit: an offset given for them is an error.

This module is the one place the analysis writes the rotary map.
"""

from __future__ import annotations

import torch

from ..models.rotary import rotary_frequencies

DEFAULT_OFFSETS = range(0, 33)
"""The window a rotary QK circuit is read over when no offset is given: query - key offsets 0..32
(the key on the query's own position up to 32 tokens back), cut at the model's context ``n_ctx``."""
REDUCES = ("max", "mean")


def rotations(cfg, offsets, dtype=torch.float64, device=None, *, layer) -> torch.Tensor:
    """``R(offset) [n_offsets, d_head, d_head]`` of layer ``layer`` for each of ``offsets``: the rotary
    map between a query and a key ``offset`` positions apart, ``q_t . k_s = (x_t W_Q) R(t - s)
    (x_s W_K)^T`` (the rotations of ``t`` and ``s`` commute). ``layer=None``: every layer's,
    ``[n_offsets, n_layers, d_head, d_head]``. The frequencies and attention scaling ``s`` are the
    forward's (``models.rotary.rotary_frequencies``: rope types, per-layer bases, layers that do not
    rotate, linear scaling), so ``R`` carries ``s^2`` (queries and keys are each scaled by ``s``).
    GPT-NeoX ``rotate_half`` layout on the first ``rotary_dim`` dims, identity on the rest; row
    convention (``q @ R``). Built in float64 from the forward's float32 frequencies, then cast."""
    if layer is None:
        return torch.stack([rotations(cfg, offsets, dtype, device, layer=l) for l in range(cfg.n_layers)], 1)
    diagonal, paired, partner = rotation_parts(cfg, offsets, layer=layer)
    R = torch.diag_embed(diagonal)
    R[:, torch.arange(cfg.d_head), partner] += paired  # (+=: a dim that does not rotate is its own partner)
    return R.to(dtype=dtype, device=device)


def rotation_parts(cfg, offsets, *, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``R(offset)`` of ``rotations`` by its two nonzeros per row, float64: ``(diagonal [n_offsets, d_head],
    paired [n_offsets, d_head], partner [d_head])`` with ``R[i, i] = diagonal[i]``, ``R[i, partner[i]] =
    paired[i]`` and zeros elsewhere. ``partner`` pairs dim ``i`` with ``i + rotary_dim / 2`` (an
    involution; a dim that does not rotate is its own partner, with ``paired`` 0), so ``R @ M`` is
    ``diagonal[:, None] * M + paired[:, None] * M[partner]``: no ``d_head^3`` product."""
    inv, scaling = rotary_frequencies(cfg, layer)
    inv, half = inv.double(), inv.numel()  # half = rotary_dim / 2; 0 where the layer does not rotate
    angle = torch.as_tensor(list(offsets), dtype=torch.float64)[:, None] * inv
    cos, sin = angle.cos(), angle.sin()
    n, rest = len(angle), cfg.d_head - 2 * half
    # (q_i, q_{i+half}) -> (q_i cos - q_{i+half} sin, q_{i+half} cos + q_i sin); R carries s^2
    diagonal = torch.cat([cos, cos, torch.ones(n, rest, dtype=torch.float64)], 1) * scaling**2
    paired = torch.cat([sin, -sin, torch.zeros(n, rest, dtype=torch.float64)], 1) * scaling**2
    i = torch.arange(half)
    partner = torch.cat([i + half, i, torch.arange(2 * half, cfg.d_head)])
    return diagonal, paired, partner


def rotation_matmul(parts, M: torch.Tensor) -> torch.Tensor:
    """``R @ M`` for ``parts = rotation_parts(...)`` (leading dims of ``diagonal``/``paired`` broadcast
    against ``M [..., d_head, k]``): ``d_head k`` operations per matrix, not ``d_head^2 k``."""
    diagonal, paired, partner = parts
    return diagonal[..., :, None] * M + paired[..., :, None] * M[..., partner, :]


def matmul_rotation(M: torch.Tensor, parts) -> torch.Tensor:
    """``M @ R`` for ``parts = rotation_parts(...)`` and ``M [..., k, d_head]`` (``rotation_matmul``):
    column ``j`` of ``R`` holds ``diagonal[j]`` and, in row ``partner[j]``, ``paired[partner[j]]``."""
    diagonal, paired, partner = parts
    return M * diagonal[..., None, :] + M[..., :, partner] * paired[..., partner][..., None, :]


def rotation(cfg, offset: int, dtype=torch.float64, device=None, *, layer: int) -> torch.Tensor:
    """``R(offset) [d_head, d_head]`` of layer ``layer`` (see ``rotations``)."""
    return rotations(cfg, [offset], dtype, device, layer=layer)[0]


def offset_window(model, offset, what: str) -> list[int] | None:
    """The query - key offsets ``what`` is read at: None for a model whose positions are not rotary
    (one QK circuit; ``offset`` must then be None), else a list of ints in ``0..n_ctx - 1``: ``[offset]``
    for an int, the window for an iterable, ``DEFAULT_OFFSETS`` (within ``n_ctx``) for None."""
    if model.cfg.positional != "rotary":
        if offset is not None:
            raise ValueError(f"offset only applies to rotary models; {what} of this model "
                             f"(positions {model.cfg.positional!r}) has no query - key offset")
        return None
    n_ctx = model.cfg.n_ctx
    if offset is None:
        return [o for o in DEFAULT_OFFSETS if o < n_ctx]
    if isinstance(offset, bool):
        raise TypeError(f"offset must be an int or an iterable of ints >= 0, got {offset!r}")
    try:
        offsets = [int(offset)] if not hasattr(offset, "__iter__") else [int(o) for o in offset]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"offset must be an int or an iterable of ints >= 0, got {offset!r}") from exc
    if not offsets or min(offsets) < 0 or max(offsets) >= n_ctx:
        raise ValueError(f"offset must be an int >= 0 or a non-empty window of offsets >= 0 (causal: the key is "
                         f"at or before the query) and below the model's context n_ctx={n_ctx}, got {offset!r}")
    return offsets


def check_reduce(reduce: str) -> str:
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {REDUCES} (over a window of offsets), got {reduce!r}")
    return reduce


def reduce_offsets(values: torch.Tensor, offsets: list[int], reduce: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``values [n_offsets, ...]`` -> ``(reduced [...], offset [...] or None)``: the max over the window
    and the offset where it is reached (NaN entries stay NaN), or the mean (no offset)."""
    if check_reduce(reduce) == "mean":
        return values.mean(0), None
    filled = values.nan_to_num(float("-inf")) if values.is_floating_point() else values
    best = filled.argmax(0)
    reduced = values.gather(0, best[None])[0]
    return reduced, torch.as_tensor(offsets, device=best.device)[best]


def span(offsets: list[int]) -> str:
    """``"0..32"`` for a contiguous window, else the offsets listed."""
    contiguous = offsets == list(range(offsets[0], offsets[0] + len(offsets)))
    return f"{offsets[0]}..{offsets[-1]}" if contiguous and len(offsets) > 1 else ", ".join(map(str, offsets))


def describe(offsets: list[int] | None, reduce: str = "max") -> str:
    """How a rotary QK number was read, for notes: ``"at query - key offset 1"``, ``"at the strongest
    of query - key offsets 0..32"`` (max) or ``"averaged over query - key offsets 0..32"`` (mean);
    "" when the model is not rotary (``offsets`` None)."""
    if offsets is None:
        return ""
    if len(offsets) == 1:
        return f"at query - key offset {offsets[0]}"
    if check_reduce(reduce) == "max":
        return f"at the strongest of query - key offsets {span(offsets)}"
    return f"averaged over query - key offsets {span(offsets)}"
