"""Layer-norm folding (paper, appendix): move the linear parts of layer norm into the weights.

A layer norm reading the residual stream ``x [pos, d_model]`` computes
``LN(x) = (x - mean(x)) / sigma(x) * w (+ b)``. Centering and the learned scale are linear:

* **centering** folds into every weight that *writes* the residual stream (``W_E``, ``W_O``,
  a learned ``W_pos``, ``b_O``): if every writer writes mean-zero vectors, the residual stream
  is mean-zero and centering is the identity (``center_writing_weights``);
* **readers are centred too** (``center_readers``): layer norm's output is mean-zero, so a
  reader's component along the all-ones direction (``W + 1 v^T`` for any ``v``) never changes
  the function; removing it keeps norms of ``W_Q, W_K, W_V, W_in, W_gate, W_U`` (and composition
  denominators) to what the stream can carry, as TransformerLens's folding does. Not where a
  Shortformer table is added to the inputs of ``W_Q, W_K`` after the norm: the table does read
  the all-ones direction;
* **the learned scale** ``w`` folds into the weight that *reads* the normalised stream:
  ``(x / sigma * w) @ W = (x / sigma) @ (diag(w) W)`` (``fold_scale_into_reader``);
* **a learned bias** ``b`` becomes a bias of the reader: ``b @ W`` (``fold_bias_into_reader``).

What remains is the division by ``sigma(x)``: one scalar per position and per read, which the
weight view reports as ``cache.ln_scale``. Folding leaves the logits unchanged (tested).
These helpers are also what an adapter for another library uses to fill ``CircuitModel``.
"""

from __future__ import annotations

import torch

from .attn_only import sinusoidal_positions
from .config import ModelConfig


def center_writing_weights(W: torch.Tensor) -> torch.Tensor:
    """``W [..., d_model]`` with the mean over ``d_model`` removed from every output vector."""
    return W - W.mean(-1, keepdim=True)


def center_reading_weights(W: torch.Tensor) -> torch.Tensor:
    """``W [..., d_model, n]`` with the mean over ``d_model`` removed from every input column, so
    ``1 @ W = 0``; ``x @ W`` is unchanged for every mean-zero ``x`` (a layer norm's output)."""
    return W - W.mean(-2, keepdim=True)


def center_readers(weights: dict, cfg: ModelConfig) -> dict:
    """``weights`` with every reader of a layer-normed stream centred (``center_reading_weights``):
    ``W_V, W_in, W_gate, W_U`` and ``W_Q, W_K`` unless Shortformer positions are added to their
    inputs after the norm. Other entries (and models without layer norm) are returned unchanged."""
    if cfg.normalization != "layernorm":
        return dict(weights)
    readers = {"W_V", "W_in", "W_gate", "W_router", "W_U"} | (set() if cfg.positional == "shortformer"
                                                              else {"W_Q", "W_K"})
    return {k: center_reading_weights(v) if k in readers and v is not None else v for k, v in weights.items()}


def fold_scale_into_reader(scale: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``diag(scale) @ W``: ``scale [..., d_model]``, ``W [..., d_model, n]`` (leading dims broadcast)."""
    return scale[..., :, None] * W


def fold_bias_into_reader(bias: torch.Tensor, W: torch.Tensor, reader_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reader's bias after folding: ``bias @ W (+ reader_bias)``; ``bias [..., d_model]``,
    ``W [..., d_model, n]`` -> ``[..., n]``."""
    folded = (bias[..., None, :] @ W)[..., 0, :]
    return folded if reader_bias is None else folded + reader_bias


def fold_attn_only(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Raw ``AttnOnlyTransformer`` parameters -> the folded weights ``CircuitModel`` takes: ``W_E [d_vocab,
    d_model]``, ``W_pos [n_ctx, d_model]``, ``W_Q/W_K/W_V [L, H, d_model, d_head]``, ``W_O [L, H, d_head,
    d_model]``, ``W_U [d_model, d_vocab]``.

    ``W_E``, ``W_O`` centered (they write the residual stream); ``ln_final_w`` folded into
    ``W_U``; no scale to fold into ``W_Q, W_K, W_V`` (the attention layer norms have none);
    readers centred by ``center_readers`` (``W_V``, ``W_U``; not ``W_Q, W_K``, which also read
    ``W_pos``: the sinusoidal table times ``cfg.pos_scale``, added after the layer norm, never in
    the residual).
    """
    return center_readers({
        "W_E": center_writing_weights(params["W_E"]),
        "W_pos": (sinusoidal_positions(cfg.n_ctx, cfg.d_model) * cfg.pos_scale).to(params["W_E"]),
        "W_Q": params["W_Q"].clone(),
        "W_K": params["W_K"].clone(),
        "W_V": params["W_V"].clone(),
        "W_O": center_writing_weights(params["W_O"]),
        "W_U": fold_scale_into_reader(params["ln_final_w"], params["W_U"]),
    }, cfg)
