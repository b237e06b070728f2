"""Head scores: previous-token, duplicate-token and induction heads, from attention patterns.

Definition (attention-diagonal): for a head's pattern ``A[dest, src]`` on tokens ``t``,

* ``previous_token``: mean over ``i >= 1`` of ``A[i, i - 1]``;
* ``duplicate_token``: mean over positions ``i`` whose token occurred earlier of
  ``sum_{j < i, t_j = t_i} A[i, j]`` (attention to earlier copies of the same token);
* ``induction``: mean over positions ``i`` whose token occurred earlier of
  ``sum_{1 <= j <= i, t_{j-1} = t_i} A[i, j]`` (attention to the token *after* an earlier copy).

Means run over all (sequence, position) pairs that have a target; a score is NaN when no
position has one (e.g. ``duplicate_token`` on text without repeats). On repeated random
tokens ``[r r ... r]`` the targets are the diagonals ``seq_len`` apart (plus chance repeats).
TransformerLens's head detector ("mul" metric) uses the same target masks but divides by every
position: ``ours * n_positions_with_target / n_positions`` per sequence equals its score.
"""

from __future__ import annotations

import torch

from ..progress import steps

SCORE_NAMES = ("previous_token", "duplicate_token", "induction")


def repeated_random_tokens(model, seq_len: int | None = None, n_repeats: int = 2, batch: int = 8,
                           seed: int = 0) -> torch.Tensor:
    """``[batch, seq_len * n_repeats]``: uniform random ids (seeded) over the vocab, repeated.
    ``seq_len`` defaults to ``min(64, n_ctx // n_repeats)``."""
    if n_repeats < 1:
        raise ValueError(f"n_repeats must be >= 1, got {n_repeats}")
    seq_len = min(64, model.cfg.n_ctx // n_repeats) if seq_len is None else seq_len
    if seq_len < 1 or seq_len * n_repeats > model.cfg.n_ctx:
        raise ValueError(f"seq_len * n_repeats = {seq_len} * {n_repeats} must be in [1, n_ctx={model.cfg.n_ctx}]")
    gen = torch.Generator().manual_seed(seed)
    block = torch.randint(0, model.cfg.d_vocab, (batch, seq_len), generator=gen)
    return block.repeat(1, n_repeats).to(model.device)


def target_masks(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Boolean ``[batch, dest, src]`` masks of the positions each score looks at."""
    pos = tokens.shape[-1]
    idx = torch.arange(pos, device=tokens.device)
    same = tokens[:, :, None] == tokens[:, None, :]  # same[b, i, j]: t_i == t_j
    earlier = idx[None, :] < idx[:, None]  # j < i
    previous = (idx[None, :] == idx[:, None] - 1).expand(tokens.shape[0], pos, pos)
    duplicate = same & earlier
    induction = torch.zeros_like(duplicate)
    induction[:, :, 1:] = duplicate[:, :, :-1]  # j is right after an earlier copy at j - 1
    return {"previous_token": previous, "duplicate_token": duplicate, "induction": induction}


def scores_from_patterns(patterns: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """``patterns [batch, L, H, dest, src]``, ``tokens [batch, pos]`` -> ``{name: [L, H]}``."""
    out = {}
    for name, mask in target_masks(tokens).items():
        mask = mask.to(patterns.dtype)
        mass = torch.einsum("blhij,bij->lhbi", patterns, mask)  # attention on targets, per dest
        has_target = mask.sum(-1) > 0  # [batch, dest]
        out[name] = mass[..., has_target].sum(-1) / has_target.sum()
    return out


@torch.no_grad()
def head_scores(model, tokens=None, *, seq_len: int | None = None, n_repeats: int = 2, batch: int = 8,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """Previous-token, duplicate-token and induction score of every head (module docstring).

    ``tokens``: text, ``[pos]`` or ``[batch, pos]`` ids; default ``repeated_random_tokens(model,
    seq_len, n_repeats, batch, seed)``. Returns ``{"previous_token", "duplicate_token",
    "induction"}``, each ``[n_layers, n_heads]`` in [0, 1] (NaN: no position had a target).
    A batch runs one sequence at a time, counted on a progress bar past a second.
    """
    if tokens is None:
        tokens = repeated_random_tokens(model, seq_len, n_repeats, batch, seed)
    if not (isinstance(tokens, torch.Tensor) and tokens.ndim == 2 and len(tokens) > 1):
        _, cache = model.run_with_cache(tokens)
        return scores_from_patterns(cache.patterns, cache.tokens)
    caches = [model.run_with_cache(row[None])[1] for row in steps(tokens, "head_scores", unit="sequence")]
    return scores_from_patterns(torch.cat([c.patterns for c in caches]), torch.cat([c.tokens for c in caches]))
