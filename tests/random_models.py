"""Small random-weight ``CircuitModel``s for the analysis tests (real weight views, tiny shapes)."""

from __future__ import annotations

import torch

from pycircuits_widgets.models import AttnOnlyTransformer, CircuitModel, ModelConfig, attn_only_config, from_attn_only


class IdTokenizer:
    """Token ``i`` displays as ``"t{i}"``; enough for token strings in tests."""

    def encode(self, text: str) -> list[int]:
        return [int(t[1:]) for t in text.split()]

    def display_token(self, token_id: int) -> str:
        return f"t{token_id}"


def paper_model(n_layers=2, n_heads=3, d_model=24, d_head=6, d_vocab=40, n_ctx=16, seed=0,
                dtype=torch.float64) -> CircuitModel:
    """The paper's architecture (Shortformer, layer norm, attention only), random, folded."""
    cfg = attn_only_config(n_layers, n_heads=n_heads, d_model=d_model, d_head=d_head, d_vocab=d_vocab, n_ctx=n_ctx)
    raw = AttnOnlyTransformer(cfg, seed=seed)
    with torch.no_grad():  # a non-trivial final scale, so folding it is exercised
        raw.ln_final_w.mul_(1 + 0.5 * torch.rand(d_model, generator=torch.Generator().manual_seed(seed)))
    return from_attn_only(raw, IdTokenizer()).to(dtype)


def custom_model(seed=0, dtype=torch.float64, biases=False, **cfg_kwargs) -> CircuitModel:
    """Any ``ModelConfig`` (default: 2 layers, Shortformer, layer norm) with i.i.d. Gaussian
    weights, nothing centred or folded; post-norm scales around 1 when ``cfg.post_norms``, and
    attention biases ``b_V``, ``b_O`` when ``biases``."""
    cfg = ModelConfig(**{"n_layers": 2, "n_heads": 3, "d_model": 24, "d_head": 6, "d_vocab": 40, "n_ctx": 16, **cfg_kwargs})
    g = torch.Generator().manual_seed(seed)
    L, H, d, dh, V = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, cfg.d_vocab

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype) / shape[-2] ** 0.5

    w = {"W_E": r(V, d) * (V / d) ** 0.5, "W_U": r(d, V), "W_Q": r(L, H, d, dh), "W_K": r(L, H, d, dh),
             "W_V": r(L, H, d, dh), "W_O": r(L, H, dh, d)}
    if cfg.positional in ("shortformer", "learned"):
        w["W_pos"] = r(cfg.n_ctx, d) * cfg.n_ctx ** 0.5
    if not cfg.attn_only:
        w["W_in"], w["W_out"] = r(L, d, cfg.d_mlp), r(L, cfg.d_mlp, d)
    if cfg.post_norms:
        w["w_post_attn"] = 1 + 0.3 * r(L, 1, d)[:, 0]
        if not cfg.attn_only:
            w["w_post_mlp"] = 1 + 0.3 * r(L, 1, d)[:, 0]
    if biases:
        w["b_V"], w["b_O"] = r(L, H, 1, dh)[:, :, 0], 3 * r(L, 1, d)[:, 0]
    return CircuitModel(cfg, tokenizer=IdTokenizer(), **w)
