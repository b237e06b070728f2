"""One forward pass with everything a view needs: tokens, logits, loss, attention patterns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RunResult:
    """Output of ``run``.

    ``tokens [batch, pos]`` (int64); ``str_tokens`` one list of display strings per batch row;
    ``logits [batch, pos, d_vocab]``; ``token_loss [batch, pos - 1]`` cross-entropy of
    predicting ``tokens[:, p + 1]`` from position ``p``; ``loss`` its mean (scalar);
    ``patterns [batch, n_layers, n_heads, dest, src]``; ``cache`` the model's activation cache
    (residual stream, head outputs, layer-norm scales) for further analysis.
    """

    tokens: torch.Tensor
    str_tokens: list[list[str]]
    logits: torch.Tensor
    token_loss: torch.Tensor
    loss: torch.Tensor
    patterns: torch.Tensor
    cache: object = field(repr=False)


def as_tokens(model, text_or_tokens) -> torch.Tensor:
    """``str``, list of ``str``, or token ids (``[pos]`` / ``[batch, pos]``) -> int64 ``[batch, pos]``."""
    if isinstance(text_or_tokens, str) or (
        isinstance(text_or_tokens, (list, tuple)) and text_or_tokens and isinstance(text_or_tokens[0], str)
    ):
        tokens = model.to_tokens(text_or_tokens)
    else:
        tokens = torch.as_tensor(text_or_tokens)
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise TypeError(f"token ids must be integers, got dtype {tokens.dtype}")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[-1] < 1:
        raise ValueError(f"expected text or token ids [pos] / [batch, pos], got shape {tuple(tokens.shape)}")
    cfg = model.cfg
    if tokens.shape[-1] > cfg.n_ctx:
        raise ValueError(f"sequence of {tokens.shape[-1]} tokens exceeds the model's context n_ctx={cfg.n_ctx}")
    if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.d_vocab:
        raise ValueError(f"token ids must lie in 0..{cfg.d_vocab - 1}, got range {int(tokens.min())}..{int(tokens.max())}")
    return tokens.long()


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``[batch, pos - 1]`` of ``logits[:, :-1]`` against ``tokens[:, 1:]``."""
    logits = logits[:, :-1]
    if logits.dtype in (torch.float16, torch.bfloat16):  # log-softmax in half precision is too coarse
        logits = logits.float()
    logp = F.log_softmax(logits, dim=-1)
    return -logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def run(model, text_or_tokens) -> RunResult:
    """Run ``model`` on text or token ids and keep logits, per-token loss and attention patterns.

    ``text_or_tokens``: a string, a list of strings (tokenised by ``model.to_tokens``), or ids
    ``[pos]`` / ``[batch, pos]``. Loss is next-token cross-entropy (``token_loss [batch, pos-1]``,
    ``loss`` its mean; NaN for a single token). Patterns ``[batch, L, H, dest, src]``.
    """
    tokens = as_tokens(model, text_or_tokens)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
    token_loss = next_token_loss(logits, tokens)
    return RunResult(
        tokens=tokens,
        str_tokens=[model.to_str_tokens(row) for row in tokens],
        logits=logits,
        token_loss=token_loss,
        loss=token_loss.mean(),
        patterns=cache.patterns,
        cache=cache,
    )
