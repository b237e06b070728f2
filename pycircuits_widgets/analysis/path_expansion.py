"""Path expansion of an attention-only model's logits (paper: "Path expansion of logits").

With the attention patterns ``A^h [batch, dest, src]`` and the layer-norm divisions frozen
from a forward pass, every layer is linear in the residual stream, and the logits expand
exactly into a sum over paths through heads in strictly increasing layers:

* order 0, the direct path: ``D_final ⊗ W_E W_U``;
* order 1, one head: ``D_final A^h D_l ⊗ W_E W_OV^h W_U``;
* order 2, a virtual head (V-composition): ``D_final A^{h2} D_{l2} A^{h1} D_{l1} ⊗ W_E W_OV^{h1} W_OV^{h2} W_U``;
* ... up to order ``n_layers``,

where ``D_l = diag(1 / ln_scale)`` of the layer that reads (and a layer norm's centering is
kept as a projection on the reading weight, so the sum is exact even for unfolded writers), and each term is a
``TensorProductTerm`` (positions ⊗ residual) applied to the embeddings ``x0 [batch, pos, d_model]``
(token embeddings, plus positions for models that add them to the residual).
Attention-only models without MLPs only; biases are not part of the weight view.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..models.circuit_model import next_token_loss
from .activations import RunResult
from .circuits import TensorProductTerm


@dataclass(frozen=True)
class PathTerm:
    """One path: ``heads`` (``()`` for the direct path), in layer order, and its ``A ⊗ W`` term."""

    heads: tuple[tuple[int, int], ...]
    term: TensorProductTerm

    @property
    def order(self) -> int:
        return len(self.heads)

    @property
    def name(self) -> str:
        return "direct" if not self.heads else " → ".join(f"L{l}.H{h}" for l, h in self.heads)


@dataclass(frozen=True)
class PathExpansion:
    """All path terms of one batch; ``logits`` is the model's own output for comparison.

    ``x0 [batch, pos, d_model]`` embeddings; ``term_logits(i)`` -> ``[batch, pos, d_vocab]``.
    The terms' logits are computed once (``stacked_logits``, ``n_terms x batch x pos x d_vocab``
    floats: 42 MB for the shipped 2-layer model on a full context).
    """

    tokens: torch.Tensor
    x0: torch.Tensor
    terms: list[PathTerm]
    logits: torch.Tensor

    @functools.cached_property
    def stacked_logits(self) -> torch.Tensor:
        """Every term's logits at once, ``[n_terms, batch, pos, d_vocab]`` (computed once, then reused)."""
        return torch.stack([t.term(self.x0) for t in self.terms])

    def term_logits(self, i: int) -> torch.Tensor:
        return self.stacked_logits[i]

    def logits_up_to_order(self, order: int) -> torch.Tensor:
        """Sum of the terms of order ``<= order`` ``[batch, pos, d_vocab]``."""
        keep = torch.tensor([t.order <= order for t in self.terms], device=self.stacked_logits.device)
        return self.stacked_logits[keep].sum(0)

    def total(self) -> torch.Tensor:
        """Sum of all terms; equals ``logits`` up to rounding."""
        return self.stacked_logits.sum(0)

    def loss_by_order(self) -> torch.Tensor:
        """Mean next-token loss using only terms of order ``<= n``, for ``n = 0..max order`` ``[n + 1]``.

        The paper's marginal effect of the ``n``-th order terms is ``loss[n - 1] - loss[n]``.
        """
        top = max(t.order for t in self.terms)
        return torch.stack([next_token_loss(self.logits_up_to_order(n), self.tokens).mean() for n in range(top + 1)])

    def term_importance(self) -> torch.Tensor:
        """Loss increase when one term is removed from the full sum: ``[n_terms]`` (ablation)."""
        full = self.total()
        base = next_token_loss(full, self.tokens).mean()
        # all ablations in one batch: [n_terms * batch, pos, d_vocab]
        ablated = (full - self.stacked_logits).flatten(0, 1)
        tokens = self.tokens.repeat(len(self.terms), 1)
        return next_token_loss(ablated, tokens).reshape(len(self.terms), -1).mean(1) - base

    def next_token_contributions(self) -> torch.Tensor:
        """Each term's centred logit for the token that actually came next: ``[n_terms, batch, pos - 1]``.

        Entry ``[i, b, p]`` is ``T_i[b, p, t] - mean_v T_i[b, p, v]`` with ``t = tokens[b, p + 1]`` and
        ``T_i = term_logits(i)``: how much term ``i`` raises the next token's logit above the average
        token's (the softmax ignores a shift shared by every token, so the raw logit would mislead).
        """
        logits = self.stacked_logits[:, :, :-1]
        nxt = self.tokens[None, :, 1:, None].expand(len(self.terms), -1, -1, 1)
        return logits.gather(-1, nxt)[..., 0] - logits.mean(-1)

    def term_importance(self) -> torch.Tensor:
        """Loss increase when one term is removed from the full sum: ``[n_terms]`` (ablation)."""
        full = self.total()
        base = next_token_loss(full, self.tokens).mean()
        return torch.stack([
            next_token_loss(full - self.term_logits(i), self.tokens).mean() - base for i in range(len(self.terms))
        ])


def path_expansion(model, text_or_tokens) -> PathExpansion:
    """Exact path expansion of ``model``'s logits on ``text_or_tokens`` (module docstring).

    ``text_or_tokens``: text, token ids, or the ``RunResult`` of ``pcw.run(model, ...)``, whose
    forward pass (logits and activation cache) is then reused instead of run again.

    Refuses models with MLPs. The number of terms is ``prod_l (1 + n_heads)`` (all head paths
    through increasing layers): 81 for a 2-layer model with 8 heads.
    """
    cfg = model.cfg
    if not cfg.attn_only:
        raise ValueError(f"path expansion here covers attention-only models; {cfg.name!r} has MLPs")
    biases = [b for b in ("b_V", "b_O", "b_U") if getattr(model, b, None) is not None]
    if biases:
        raise ValueError(f"path expansion here covers bias-free models; {cfg.name!r} has {biases}")
    if isinstance(text_or_tokens, RunResult):
        logits, cache = text_or_tokens.logits, text_or_tokens.cache
    else:
        with torch.no_grad():
            logits, cache = model.run_with_cache(text_or_tokens)
    tokens = cache.tokens
    inv = 1.0 / ln_scales(model, cache)  # [batch, L + 1, pos]
    eye = torch.eye(tokens.shape[-1], dtype=logits.dtype, device=logits.device)
    # a layer norm reads (x - mean(x)) / scale: the centering is the projection C on d_model
    # (the identity when, as after folding, every writer is already mean-zero)
    d = cfg.d_model
    C = torch.eye(d, dtype=logits.dtype, device=logits.device) - 1.0 / d if cfg.normalization == "layernorm" else None
    read = (lambda W: W) if C is None else (lambda W: C @ W)
    # partial paths (heads, A [batch|1, dest, src] from x0 to here, W [d_model, d_model] or None = identity)
    paths = [((), eye[None], None)]
    for layer in range(cfg.n_layers):
        extended = []
        for heads, A, W in paths:
            for h in range(cfg.n_heads):
                # the head reads the stream divided by this layer's norm: A^h D_layer A
                A_h = (cache.patterns[:, layer, h] * inv[:, layer, None, :]) @ A
                ov = read(model.W_V[layer, h]) @ model.W_O[layer, h]
                extended.append((heads + ((layer, h),), A_h, ov if W is None else W @ ov))
        paths += extended
    W_U = read(model.W_U)
    terms = [
        PathTerm(heads=heads, term=TensorProductTerm(inv[:, -1, :, None] * A, W_U if W is None else W @ W_U))
        for heads, A, W in paths
    ]
    return PathExpansion(tokens=tokens, x0=cache.resid[:, 0], terms=terms, logits=logits)


def ln_scales(model, cache) -> torch.Tensor:
    """Layer-norm divisions ``[batch, n_layers + 1, pos]`` (one per attention layer, then final).

    Models without normalization divide by 1.
    """
    scale = getattr(cache, "ln_scale", None)
    if scale is None or model.cfg.normalization is None:
        b, _, pos, _ = cache.resid.shape
        return torch.ones(b, model.cfg.n_layers + 1, pos, dtype=cache.resid.dtype, device=cache.resid.device)
    return scale
