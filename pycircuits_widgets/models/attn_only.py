"""The paper's attention-only transformer (Elhage et al., 2021), as trained.

Decoder-only, 0/1/2 (any) layers of attention, no MLPs, no biases. A layer norm sits where a
layer reads the residual stream: before each attention layer (centering + division by the
norm, no learned scale) and before the unembedding (with a learned scale ``ln_final_w``).
A fixed sinusoidal table ``W_pos`` is added to the *inputs of W_Q and W_K only*
(Shortformer-style), after the layer norm, so the residual stream carries token identity alone:

    q = (LN(x) + W_pos) @ W_Q,   k = (LN(x) + W_pos) @ W_K,   v = LN(x) @ W_V.

Why no learned scale before attention: with no biases, a learned scale ``w`` there is exactly
``diag(w)`` absorbed into ``W_Q, W_K, W_V`` and adds nothing to the function class, except that
it would make the effective positional table differ per layer (``W_pos / w``). Leaving it out
keeps one shared ``W_pos``, literally the sinusoid table, in the folded weight view.

This module holds the raw (unfolded) parameters for training; ``folding.fold_attn_only`` turns
them into the weight view (``CircuitModel``) the analysis reads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


def sinusoidal_positions(n_ctx: int, d_model: int) -> torch.Tensor:
    """``[n_ctx, d_model]``: ``P[p, 2i] = sin(w_i p)``, ``P[p, 2i+1] = cos(w_i p)`` with
    ``w_i = pi * n_ctx^(-2i / d_model)``, geometric from pi (period 2) to about pi / n_ctx.

    Why not the Transformer's ``w_i = 10000^(-2i/d)``: its fastest frequency is 1 rad/position
    and most of its dimensions are nearly constant over a short context, so heads could only
    form smooth local windows (measured: self 0.38, previous 0.25, two back 0.15); reaching pi
    lets a head separate the previous token from the current one.
    """
    pos = torch.arange(n_ctx, dtype=torch.float64)[:, None]
    freqs = math.pi * torch.exp(-math.log(n_ctx) * torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    table = torch.zeros(n_ctx, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freqs)
    table[:, 1::2] = torch.cos(pos * freqs)[:, : d_model // 2]
    return table.float()


def attn_only_config(n_layers: int, *, n_heads: int = 8, d_model: int = 128, d_head: int = 16,
                     d_vocab: int = 1024, n_ctx: int = 128, pos_scale: float = 1.5,
                     name: str | None = None) -> ModelConfig:
    """Config of the paper's architecture (Shortformer positions, layer norm, attention only).

    ``pos_scale`` multiplies the sinusoid table (per-component RMS ``pos_scale / sqrt(2)`` next
    to the layer-normed stream's 1); 1.5 gave sharp previous-token heads, then induction heads,
    within a CPU training budget."""
    return ModelConfig(
        n_layers=n_layers, n_heads=n_heads, d_model=d_model, d_head=d_head, d_vocab=d_vocab,
        n_ctx=n_ctx, positional="shortformer", normalization="layernorm", attn_only=True,
        pos_scale=pos_scale, name=name or f"attn-only-{n_layers}l",
    )


class AttnOnlyTransformer(nn.Module):
    """Raw parameters: ``W_E [d_vocab, d_model]``, ``W_Q/W_K/W_V [L, H, d_model, d_head]``,
    ``W_O [L, H, d_head, d_model]``, ``ln_final_w [d_model]``, ``W_U [d_model, d_vocab]``;
    buffer ``W_pos [n_ctx, d_model]`` (sinusoidal times ``cfg.pos_scale``, not trained)."""

    def __init__(self, cfg: ModelConfig, seed: int | None = None):
        super().__init__()
        if cfg.positional != "shortformer" or cfg.normalization != "layernorm" or not cfg.attn_only:
            raise ValueError("AttnOnlyTransformer is the paper's model: shortformer positions, "
                             f"layernorm, attention only; got {cfg}")
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        L, H, d, dh, V = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, cfg.d_vocab

        def init(*shape, std):
            return nn.Parameter(torch.randn(*shape, generator=gen) * std)

        # small next to what heads write, so layer 1 can read layer-0 outputs (K-composition)
        self.W_E = init(V, d, std=d ** -0.5)
        self.W_Q = init(L, H, d, dh, std=d ** -0.5)
        self.W_K = init(L, H, d, dh, std=d ** -0.5)
        self.W_V = init(L, H, d, dh, std=d ** -0.5)
        self.W_O = init(L, H, dh, d, std=(H * dh) ** -0.5 / max(1, 2 * L) ** 0.5)
        self.ln_final_w = nn.Parameter(torch.ones(d))
        self.W_U = init(d, V, std=d ** -0.5)
        self.register_buffer("W_pos", sinusoidal_positions(cfg.n_ctx, d) * cfg.pos_scale, persistent=False)

    def _layer_norm(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(-1, keepdim=True)
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [batch, pos]`` (int64) -> ``logits [batch, pos, d_vocab]``."""
        pos = tokens.shape[-1]
        x = self.W_E[tokens]
        pos_table = self.W_pos[:pos]
        batch, H, dh = tokens.shape[0], self.cfg.n_heads, self.cfg.d_head

        def heads(w):  # [H, d_model, d_head] -> [d_model, H * d_head]: one matmul for all heads
            return w.permute(1, 0, 2).reshape(w.shape[1], H * dh)

        def split(t):  # [batch, pos, H * d_head] -> [batch, H, pos, d_head]
            return t.view(batch, pos, H, dh).transpose(1, 2)

        for layer in range(self.cfg.n_layers):
            xn = self._layer_norm(x)
            qk = (xn + pos_table) @ torch.cat([heads(self.W_Q[layer]), heads(self.W_K[layer])], dim=1)
            q, k = split(qk[..., : H * dh]), split(qk[..., H * dh:])
            v = split(xn @ heads(self.W_V[layer]))
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / self.cfg.attn_scale)
            x = x + z.transpose(1, 2).reshape(batch, pos, H * dh) @ self.W_O[layer].reshape(H * dh, -1)
        return (self._layer_norm(x) * self.ln_final_w) @ self.W_U
