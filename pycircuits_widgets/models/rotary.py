"""Rotary frequencies of a layer: the one place every RoPE rule (Hugging Face ``rope_type``) lives.

``rotary_frequencies(cfg, layer, n_pos)`` returns the inverse frequencies ``theta [rotary_dim / 2]``
and the attention scaling ``s`` of layer ``layer``: the query and key at position ``p`` are rotated
by angles ``p * theta`` (GPT-NeoX ``rotate_half`` layout on the first ``rotary_dim`` dims) and
multiplied by ``s`` (so scores by ``s**2``). Everything that reads rotary geometry (the forward, the
rotation ``R(offset)`` of the analyses) goes through it, so the per-layer differences are in one
place: SmolLM3's no-rotary layers (``theta`` empty), Gemma 3's local and global bases
(``cfg.layer_rope``), llama3 / YaRN / LongRoPE / dynamic-NTK frequency rules (``cfg.rope``).

The formulas are Hugging Face's (``transformers.modeling_rope_utils``, 5.x), computed in float32 in
the same order, so the angles are the source model's to the last bit. ``n_pos`` (the length of the
sequence being run) matters only where the source's rule depends on it: dynamic NTK grows the base
past ``n_ctx``, LongRoPE switches to ``long_factor`` past ``original_max_position_embeddings``.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def layer_rope(cfg: ModelConfig, layer: int) -> dict:
    """The rope parameters of ``layer``: ``cfg.layer_rope[layer]`` else ``cfg.rope`` (with
    ``rope_theta`` defaulting to ``cfg.rotary_base``)."""
    params = cfg.layer_rope[layer] if cfg.layer_rope is not None else (cfg.rope or {})
    return {"rope_type": "default", "rope_theta": cfg.rotary_base, **params}


def is_rotary_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether ``layer`` rotates its queries and keys (False for a model that is not rotary)."""
    if cfg.positional != "rotary":
        return False
    return cfg.rotary_layers is None or bool(cfg.rotary_layers[layer])


def rotary_frequencies(cfg: ModelConfig, layer: int, n_pos: int | None = None,
                       device=None) -> tuple[torch.Tensor, float]:
    """``(theta [rotary_dim / 2] float32, attention_scaling)`` of ``layer`` (module docstring).
    ``cfg.rotary_scale`` (linear scaling) divides ``theta``. A layer that does not rotate returns an
    empty ``theta`` and scaling 1."""
    if not is_rotary_layer(cfg, layer):
        return torch.zeros(0, device=device), 1.0
    p = layer_rope(cfg, layer)
    kind, base, dim = p["rope_type"], float(p["rope_theta"]), cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    scaling = 1.0
    if kind == "dynamic":  # ``max_position_embeddings``: the trained length the rule scales from
        trained = p.get("max_position_embeddings", cfg.n_ctx)
        seq = max(n_pos or trained, trained)
        factor = p["factor"]
        base = base * ((factor * seq / trained) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (base ** exponents)
    if kind == "linear":
        inv = inv / p["factor"]
    elif kind == "llama3":
        inv = _llama3(inv, p)
    elif kind == "yarn":
        inv, scaling = _yarn(cfg, p, base, dim, device)
    elif kind == "longrope":
        original = p["original_max_position_embeddings"]
        factor = p.get("factor") or cfg.n_ctx / original
        scaling = p.get("attention_factor")
        if scaling is None:
            scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        ext = p["long_factor"] if n_pos and n_pos > original else p["short_factor"]
        inv = 1.0 / (torch.tensor(ext, dtype=torch.float32, device=device) * base ** exponents)
    return inv / cfg.rotary_scale if cfg.rotary_scale != 1.0 else inv, float(scaling)


def _llama3(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg: ModelConfig, p: dict, base: float, dim: int, device) -> tuple[torch.Tensor, float]:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or cfg.n_ctx / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scaling = p.get("attention_factor")
    if scaling is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        scaling = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # Hugging Face's guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, scaling
