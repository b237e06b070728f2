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

from ..progress import progress

BATCH_TOKENS = 2048
"""Tokens per forward when ``head_scores`` runs a batch of sequences."""

SCORE_NAMES = ("previous_token", "duplicate_token", "induction")


def repeated_random_tokens(model, seq_len: int | None = None, n_repeats: int = 2, batch: int = 8,
                           seed: int = 0) -> torch.Tensor:
    """``[batch, seq_len * n_repeats]``: uniform random ids (seeded) over the vocab, repeated.
    ``seq_len`` defaults to ``min(64, n_ctx // n_repeats)``."""
    for name, value in (("n_repeats", n_repeats), ("batch", batch), ("seq_len", 1 if seq_len is None else seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
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


def target_attention(patterns: torch.Tensor, tokens: torch.Tensor
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each score at each destination: ``{name: (attention [batch, L, H, dest], targets [batch, dest, src],
    has_target [batch, dest])}``, ``attention`` the pattern's mass on the position's targets (0 where it
    has none; the per-position terms of ``target_mass``'s mean), in the patterns' dtype; ``targets`` the
    score's mask (``target_masks``) and ``has_target`` whether a position has any. ``patterns [batch, L,
    H, dest, src]``, ``tokens [batch, pos]``. The targets are few (one per position for the previous
    token, the earlier copies for the others): gathered, not a masked pass over every pattern."""
    b, L, H, T, _ = patterns.shape
    out = {}
    for name, mask in target_masks(tokens).items():
        seq, dest, src = mask.nonzero(as_tuple=True)
        at = patterns.new_zeros(b, T, L, H).index_put_((seq, dest), patterns[seq, :, :, dest, src], accumulate=True)
        has_target = torch.zeros(b, T, dtype=torch.bool, device=mask.device)
        has_target[seq, dest] = True
        out[name] = (at.permute(0, 2, 3, 1), mask, has_target)
    return out


def target_mass(patterns: torch.Tensor, tokens: torch.Tensor, attention: dict | None = None
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The parts of each score's mean, summable over batches: ``{name: (mass [L, H], n)}``, ``mass`` the
    attention on targets summed over every (sequence, position) (float64; a position without a target
    adds 0), ``n`` how many positions have a target (int64 scalar). ``patterns [batch, L, H, dest, src]``,
    ``tokens [batch, pos]``; ``attention``: their ``target_attention``, where the caller has it already
    (the sweep reads it for its examples too)."""
    attention = target_attention(patterns, tokens) if attention is None else attention
    # each sequence's sum in the patterns' dtype, the sequences' in float64
    return {name: (at.sum(-1).sum(0, dtype=torch.float64), has_target.sum())
            for name, (at, _, has_target) in attention.items()}


def scores_from_patterns(patterns: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """``patterns [batch, L, H, dest, src]``, ``tokens [batch, pos]`` -> ``{name: [L, H]}``."""
    return {name: (mass / n).to(patterns.dtype) for name, (mass, n) in target_mass(patterns, tokens).items()}


@torch.no_grad()
def head_scores(model, tokens=None, *, seq_len: int | None = None, n_repeats: int | None = None,
                batch: int | None = None, seed: int | None = None) -> dict[str, torch.Tensor]:
    """Previous-token, duplicate-token and induction score of every head (module docstring).

    ``tokens``: text, ``[pos]`` or ``[batch, pos]`` ids; default ``repeated_random_tokens(model,
    seq_len, n_repeats, batch, seed)`` (defaults there: 2 repeats, 8 sequences, seed 0; these four
    arguments are for the random tokens only, refused with ``tokens`` given). Returns ``{"previous_token", "duplicate_token",
    "induction"}``, each ``[n_layers, n_heads]`` in [0, 1] (NaN: no position had a target).
    A batch runs ``BATCH_TOKENS // pos`` sequences at a time, each forward's patterns summed
    (``target_mass``) and dropped, counted on a progress bar past a second. Over a corpus:
    ``pcw.head_scores(model, corpus)`` (a sweep)."""
    random = {"seq_len": seq_len, "n_repeats": n_repeats, "batch": batch, "seed": seed}
    given = {name: value for name, value in random.items() if value is not None}
    if tokens is None:
        tokens = repeated_random_tokens(model, **given)
    elif given:  # they would be ignored: the tokens' own length and batch are scored
        raise TypeError(f"head_scores: {', '.join(given)} are for the random tokens (tokens=None); got "
                        f"{', '.join(f'{k}={v!r}' for k, v in given.items())} with tokens (cut the tokens instead, or "
                        "pass a pcw.Corpus to score its windows of seq_len tokens)")
    if not (isinstance(tokens, torch.Tensor) and tokens.ndim == 2 and len(tokens) > 1):
        _, cache = model.run_with_cache(tokens)
        return scores_from_patterns(cache.patterns, cache.tokens)
    totals, dtype = {}, None
    with progress("head_scores", total=len(tokens), unit="sequence") as bar:
        for rows in tokens.split(max(1, BATCH_TOKENS // tokens.shape[1])):
            _, cache = model.run_with_cache(rows, logits=False)
            dtype = cache.patterns.dtype
            for name, (mass, n) in target_mass(cache.patterns, cache.tokens).items():
                before = totals.get(name, (0, 0))
                totals[name] = (before[0] + mass, before[1] + n)
            bar.update(len(rows))
    return {name: (mass / n).to(dtype) for name, (mass, n) in totals.items()}
