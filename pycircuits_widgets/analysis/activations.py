"""One forward pass with everything a view needs: tokens, logits, loss, attention patterns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.forward import next_token_loss


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


def run(model, text_or_tokens) -> RunResult:
    """Run ``model`` on text or token ids and keep logits, per-token loss and attention patterns.

    ``text_or_tokens``: a string, a list of strings (tokenised by ``model.to_tokens``), or ids
    ``[pos]`` / ``[batch, pos]`` (list, integer tensor or numpy array; a model without a
    tokenizer takes ids and labels them ``"<id N>"``). Loss is next-token cross-entropy (``token_loss [batch, pos-1]``,
    ``loss`` its mean; NaN for a single token). Patterns ``[batch, L, H, dest, src]``.
    """
    with torch.no_grad():
        logits, cache = model.run_with_cache(text_or_tokens)  # validates text_or_tokens
    tokens = cache.tokens
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
