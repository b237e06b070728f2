"""What one forward over a batch of windows adds to a sweep: the ``Accumulator`` of those windows.

Per batch ``tokens [b, T]`` (windows ``w0 .. w0 + b - 1``), from one ``run_with_cache(tokens,
mlp_post=True, logits=False)`` (no unembedding: a sweep reads none of the logits):

* every head ``(l, h)``: ``||head_out|| = ||z[l, h, t] @ W_O[l, h]||`` at every position, computed as
  ``||z @ R^T||`` with ``R`` the ``[d_head, d_head]`` triangle of ``W_O[l, h]^T = Q R`` (``Q`` has
  orthonormal columns, so the norms are equal): ``d_head / d_model`` of the work of forming
  ``head_out``, and a sum of squares with no cancellation (a Gram ``z W_O W_O^T z^T`` would subtract).
  Its top k with, for each, the source position the head attends to most there (the first of equal
  maxima) and that attention;
* every neuron: its top k by post-activation (the input to ``W_out``), its sum and how often it is > 0;
* every head's top k for each role the head scores measure (``roles``: previous-token, duplicate-token,
  induction): the positions where the head puts most attention on that score's targets
  (``analysis.head_scores.target_attention``; positions without a target are no example), with the
  target it attends to most there and that attention: the examples that show a head's role, where its
  largest outputs may sit on an attention sink;
* the head scores' parts (``analysis.head_scores.target_mass``), and ``sum_t z[l, h, t]`` (the mean
  ``head_out`` is that mean times ``W_O``, linear), with the number of positions.

Scores are ranked in float32 for half-precision models (the norms are computed in float32 there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..analysis.head_scores import SCORE_NAMES, target_attention, target_mass
from ..linalg import linalg_dtype, qr_r
from .accumulators import EMPTY, Accumulator, TopK, top_k_first
from .memory import heap_kept

HEAD_EXTRAS = {"source": torch.long, "attention": torch.float32}


class NonFiniteActivation(ValueError):
    """A forward over the corpus produced NaN or inf (the message names the windows)."""


def head_out_factor(model) -> torch.Tensor:
    """``R^T [L, H, d_head, d_head]`` with ``||z @ W_O[l, h]|| = ||z @ R^T[l, h]||`` for every ``z``
    (``R`` from ``W_O^T = Q R``, computed in float64, returned in the working dtype)."""
    W_O = model.W_O.to(torch.float64)
    return qr_r(W_O.mT, "W_O^T of every head (the sweep's head_out norms)").mT.to(linalg_dtype(model.dtype))


class Recorder:
    """Records batches of windows for one model (module docstring). ``scores_only``: the head scores'
    parts alone (no examples, means or neuron statistics)."""

    def __init__(self, model, k: int, scores_only: bool = False, device=None):
        self.model = model if device is None else model.to(device)
        self.device = self.model.device
        self.k, self.scores_only = k, scores_only
        cfg = self.model.cfg
        self.L, self.H = cfg.n_layers, cfg.n_heads
        self.mlps = not cfg.attn_only and not scores_only and bool(cfg.d_mlp)
        self.work = linalg_dtype(self.model.dtype)
        self.R_T = None if scores_only else head_out_factor(self.model).to(self.device)

    @torch.inference_mode()
    def record(self, windows: torch.Tensor, first_window: int, batch_size: int,
               on_batch: Callable[[int], None] | None = None) -> Accumulator:
        """The accumulator of ``windows [n, T]`` (numbered from ``first_window``), run ``batch_size`` at a
        time, each batch merged into the shard's as it ends (sums in batch order: the same bits as merging
        them all at the end, in the memory of two accumulators, not one per batch); on the CPU. Freed memory
        is kept between the batches and handed back at the end (``memory.heap_kept``).
        ``on_batch(b)`` after each batch of ``b`` windows (a progress bar's tick)."""
        acc = None
        with heap_kept():  # memory.py: each batch's tensors reuse the last one's pages, handed back after
            for start in range(0, len(windows), batch_size):
                tokens = windows[start:start + batch_size]
                batch = self.batch(tokens.to(self.device), first_window + start)
                acc = batch if acc is None else acc.merge(batch)
                if on_batch is not None:
                    on_batch(len(tokens))
            return acc.to("cpu")

    def batch(self, tokens: torch.Tensor, first_window: int) -> Accumulator:
        """The accumulator of one batch ``tokens [b, T]`` (windows from ``first_window``), on the device."""
        b, T = tokens.shape
        _, cache = self.model.run_with_cache(tokens, mlp_post=self.mlps, logits=False)
        sums = {"positions": torch.tensor(b * T, device=self.device), "windows": torch.tensor(b, device=self.device)}
        parts = target_attention(cache.patterns, cache.tokens)  # (the scores' sums and the role examples')
        for name, (mass, n) in target_mass(cache.patterns, cache.tokens, parts).items():
            sums[f"mass.{name}"], sums[f"targets.{name}"] = mass, n
        self._check_finite(sums[f"mass.{SCORE_NAMES[0]}"], "attention patterns", first_window, b)
        heads = neurons = None
        roles = {}
        if not self.scores_only:
            heads = self._heads(cache, first_window, sums)
            roles = self._roles(cache, parts, first_window)
        if self.mlps:
            neurons = self._neurons(cache.mlp_post, first_window, sums)
        return Accumulator(heads, neurons, sums, roles)

    def _heads(self, cache, first_window: int, sums: dict) -> TopK:
        z = cache.z  # [b, L, H, T, d_head]
        b, L, H, T, _ = z.shape
        # per batch in the working dtype (reductions over contiguous runs), across batches in float64
        sums["z"] = z.sum(3).sum(0).to(torch.float64)
        self._check_finite(sums["z"], "head outputs (z)", first_window, b)
        zr = z.to(self.work) @ self.R_T  # [b, L, H, T, d_head]; ||zr|| = ||head_out||
        norms = (zr * zr).sum(-1).sqrt()
        scores = norms.permute(1, 2, 0, 3).reshape(L * H, b * T)  # row l * H + h, column window * T + t
        values, index = top_k_first(scores, self.k)
        win, pos = index // T, index % T
        source, attention = _attended_most(cache.patterns, win, torch.arange(L * H, device=z.device)[:, None], pos)
        return TopK(values + 0.0, win + first_window, pos, {"source": source, "attention": attention}).padded(self.k)

    def _roles(self, cache, parts: dict, first_window: int) -> dict[str, TopK]:
        """Each role's ``TopK`` (module docstring) from the batch's ``target_attention``: rows ``l * H + h``, a
        position's score its attention on the role's targets, ``-inf`` (no example) where it has none. The
        roles are ranked as one table of ``roles * L * H`` rows, then split: one pass of each step, not one
        per role (attn-only-2l: each step is a few microseconds of work and as much dispatch)."""
        patterns = cache.patterns  # [b, L, H, T, T]
        b, L, H, T, _ = patterns.shape
        targets = torch.stack([mask for _, mask, _ in parts.values()])  # [roles, b, dest, src]
        scores = torch.stack([mass for mass, _, _ in parts.values()]).to(self.work)  # [roles, b, L, H, dest]
        has_target = torch.stack([has for _, _, has in parts.values()])  # [roles, b, dest]
        scores.masked_fill_(~has_target[:, :, None, None], float("-inf"))
        values, index = top_k_first(scores.permute(0, 2, 3, 1, 4).reshape(len(parts) * L * H, b * T), self.k)
        win, pos = index // T, index % T
        rows = torch.arange(len(parts) * L * H, device=patterns.device)[:, None]
        role, head = rows // (L * H), rows % (L * H)
        empty = values == float("-inf")  # fewer than k positions with a target in this batch
        source, attention = _attended_most(patterns, win, head, pos, targets[role, win, pos])
        table = TopK(values + 0.0, (win + first_window).masked_fill(empty, EMPTY), pos.masked_fill(empty, 0),
                     {"source": source.masked_fill(empty, 0), "attention": attention.masked_fill(empty, 0.0)}
                     ).padded(self.k)
        return {name: table.rows(i * L * H, (i + 1) * L * H) for i, name in enumerate(parts)}

    def _neurons(self, post: torch.Tensor, first_window: int, sums: dict) -> TopK:
        b, L, T, d_mlp = post.shape
        totals, positives, values, index = [], [], [], []
        for layer in range(L):
            # one layer at a time, into rows (neuron n, column window * T + t) that top-k and the sums read:
            # the layer's [b * T, d_mlp] gathered (a copy of b contiguous blocks), then one 2-D transpose.
            # Half the time of one 3-D permuted copy of the layer, itself half that of all layers at once
            # (GPT-2 small, 16 windows of 128, 2 threads)
            scores = post[:, layer].to(self.work).reshape(b * T, d_mlp).T.contiguous()
            totals.append(scores.sum(-1))
            positives.append((scores > 0).sum(-1, dtype=torch.int32))  # (an int32 sum of bools: half the int64's time)
            top = top_k_first(scores, self.k)
            values.append(top[0])
            index.append(top[1])
        sums["neuron_sum"] = torch.stack(totals).to(torch.float64)  # [L, d_mlp]
        self._check_finite(sums["neuron_sum"], "MLP post-activations", first_window, b)
        sums["neuron_positive"] = torch.stack(positives).long()  # summed over the corpus in int64
        values, index = torch.cat(values), torch.cat(index)  # row l * d_mlp + n
        return TopK(values + 0.0, index // T + first_window, index % T).padded(self.k)

    @staticmethod
    def _check_finite(total: torch.Tensor, what: str, first_window: int, b: int) -> None:
        if not bool(torch.isfinite(total).all()):
            raise NonFiniteActivation(f"the forward over windows {first_window}..{first_window + b - 1} gave "
                                      f"non-finite {what} (NaN or inf); the model overflows on this text")


def _attended_most(patterns: torch.Tensor, win: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                   allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """At each example (window ``win``, head row ``rows = l * H + h``, destination ``pos``; ``[R, k]``,
    ``rows`` broadcast): the source the head attends to most there, the first of equal maxima, and that
    attention (float32); ``allowed [R, k, src]``: only among those sources (a role's targets; each example
    has one). Reads the pattern rows of the examples only (``[R, k, T]``) from ``patterns [b, L, H, T, T]``."""
    H = patterns.shape[2]
    picked = patterns[win, rows // H, rows % H, pos]
    if allowed is not None:  # the disallowed below any attention
        picked = picked.masked_fill(~allowed, -1.0)
    source = picked.argmax(-1)
    return source, picked.gather(-1, source[..., None])[..., 0].to(torch.float32)
