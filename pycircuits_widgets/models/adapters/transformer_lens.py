"""TransformerLens models -> the ``CircuitModel`` weight view (``from_transformer_lens``).

Accepts both generations, duck-typed on what they share: ``cfg`` (``HookedTransformerConfig``
fields), the stacked weights ``W_E, W_pos, W_Q, ..., W_U`` and biases ``b_*`` in TransformerLens's
row convention (the same as ours), and the norms ``blocks[l].ln1/ln2``, ``ln_final``:

* TransformerLens 4.x ``TransformerBridge`` (e.g. ``TransformerBridge.boot_native(cfg)``): tested;
* TransformerLens 2.x ``HookedTransformer``: same attribute names, **not tested here** (2.x and
  4.x cannot be installed side by side).

Grouped-query K/V (``[L, n_key_value_heads, ...]`` on the bridge) are repeated per query head.
A gated MLP's ``b_in`` sits where each generation puts it: inside the product on the bridge
(``act(x W_gate) * (x W_in + b_in)``), after it in 2.x's ``GatedMLP``
(``act(x W_gate) * (x W_in) + b_in``); see ``ModelConfig.b_in_outside_gate``.
The TL-native model rotates adjacent pairs (GPT-J layout) whatever ``cfg.rotary_adjacent_pairs``
says; such query/key weights are reordered (``weight_view.adjacent_pairs_to_halves``).
"""

from __future__ import annotations

import math

import torch

from ..circuit_model import CircuitModel
from ..config import ModelConfig, named, short_name
from .families import FAMILIES
from .hf import from_hf
from .hf_tokenizer import as_tokenizer
from .verify import compare, probe_tokens
from .weight_view import act_fn, adjacent_pairs_to_halves, build, expand_kv_heads

_NORMALIZATION = {"LN": "layernorm", "LNPRE": "layernorm", "RMS": "rmsnorm", "RMSPRE": "rmsnorm", None: None}
_POSITIONAL = {"standard": "learned", "rotary": "rotary"}


def _native_model(model):
    """The TL-native ``NativeModel`` under a ``TransformerBridge`` (None for anything else)."""
    inner = getattr(model, "original_model", None)
    return inner if type(inner).__name__ == "NativeModel" else None


def _optional(model, name: str) -> torch.Tensor | None:
    """A stacked weight that bias-free models lack (the bridge raises AttributeError for those)."""
    try:
        return getattr(model, name)
    except AttributeError:
        return None


def _is_bridge(model) -> bool:
    """A 4.x ``TransformerBridge`` (wraps ``original_model``), not a 2.x ``HookedTransformer``."""
    return hasattr(model, "original_model")


def _refuse_gate_bias(model) -> None:
    """The weight view has no gate bias: refuse ``act(x W_gate + b_gate)`` (a bridge around a Hugging
    Face model with ``mlp_bias=True``) rather than drop it."""
    for layer, block in enumerate(model.blocks):
        try:
            b_gate = getattr(block.mlp, "b_gate", None)
        except AttributeError:
            b_gate = None
        if b_gate is not None and bool((b_gate != 0).any()):
            raise ValueError(f"from_transformer_lens: blocks[{layer}].mlp.b_gate is nonzero; the weight view has no "
                             "gate bias (gated MLPs compute act(x W_gate) * (x W_in + b_in))")


def _norm_params(norm) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(w, b)`` of a norm: HookedTransformer's ``LayerNorm.w/.b``, or the torch module under a
    bridge's ``NormalizationBridge`` (``weight``/``bias``); None for parameter-free norms."""
    inner = getattr(norm, "_original_component", norm)
    w = getattr(inner, "w", getattr(inner, "weight", None))
    b = getattr(inner, "b", getattr(inner, "bias", None))
    return w, b


def _refuse_unsupported(c) -> None:
    checks = {
        "attn_scores_soft_cap": getattr(c, "attn_scores_soft_cap", -1.0) > 0,
        "output_logits_soft_cap": getattr(c, "output_logits_soft_cap", -1.0) > 0,
        "use_qk_norm": getattr(c, "use_qk_norm", False),
        "post_embedding_ln": getattr(c, "post_embedding_ln", False),
        "scale_attn_by_inverse_layer_idx": getattr(c, "scale_attn_by_inverse_layer_idx", False),
        "use_local_attn": getattr(c, "use_local_attn", False),
        "num_experts": bool(getattr(c, "num_experts", None)),
        "use_NTK_by_parts_rope": getattr(c, "use_NTK_by_parts_rope", False),
        "rope_scaling": bool(getattr(c, "rope_scaling", None)),
        "rmsnorm_uses_offset": getattr(c, "rmsnorm_uses_offset", False),
        "attention_dir != 'causal'": getattr(c, "attention_dir", "causal") != "causal",
    }
    bad = [name for name, on in checks.items() if on]
    if bad:
        raise ValueError(f"from_transformer_lens: unsupported config options {bad} (the weight view's forward "
                         "has no such feature)")


def _config(model, native) -> ModelConfig:
    c = model.cfg
    _refuse_unsupported(c)
    norm_type = None if c.normalization_type is None else c.normalization_type.upper()
    pos_type = (getattr(c, "positional_embedding_type", None) or "standard").lower()
    if norm_type not in _NORMALIZATION:
        raise ValueError(f"unsupported normalization_type {c.normalization_type!r}; "
                         "expected LN, LNPre, RMS, RMSPre or None")
    if pos_type not in _POSITIONAL:
        raise ValueError(f"unsupported positional_embedding_type {pos_type!r}; expected one of {sorted(_POSITIONAL)}")
    normalization = _NORMALIZATION[norm_type]
    if getattr(c, "final_rms", False) and normalization != "rmsnorm":
        raise ValueError("final_rms with layer-norm blocks is not supported (one normalization for every read)")
    d_vocab_out = getattr(c, "d_vocab_out", -1)
    if d_vocab_out not in (-1, c.d_vocab):
        raise ValueError(f"d_vocab_out={d_vocab_out} differs from d_vocab={c.d_vocab}; "
                         "the weight view needs one vocabulary")
    if native is not None:  # what the module computes (it ignores use_attn_scale=False)
        attn_scale = float(native.layers[0].attn.scale)
    else:
        attn_scale = getattr(model.blocks[0].attn, "attn_scale", None)
        if attn_scale is None:
            attn_scale = (c.attn_scale if c.attn_scale > 0 else math.sqrt(c.d_head)) if c.use_attn_scale else 1.0
    n_kv = getattr(c, "n_key_value_heads", None)
    gated = bool(getattr(c, "gated_mlp", False))
    return ModelConfig(
        n_layers=c.n_layers, n_heads=c.n_heads, d_model=c.d_model, d_head=c.d_head, d_vocab=c.d_vocab,
        n_ctx=c.n_ctx, n_kv_heads=n_kv if n_kv and n_kv < c.n_heads else None, positional=_POSITIONAL[pos_type],
        normalization=normalization, attn_only=bool(c.attn_only), d_mlp=None if c.attn_only else c.d_mlp,
        act_fn=None if c.attn_only else act_fn((c.act_fn or ("silu" if gated else "gelu")).lower()),
        gated_mlp=gated and not c.attn_only, eps=c.eps, attn_scale=float(attn_scale),
        rotary_dim=(c.rotary_dim or c.d_head) if pos_type == "rotary" else None,
        rotary_base=float(getattr(c, "rotary_base", 10000.0)),
        # the TL-native block is sequential whatever cfg.parallel_attn_mlp says
        parallel_attn_mlp=bool(getattr(c, "parallel_attn_mlp", False)) and native is None,
        # TransformerLens 2.x GatedMLP adds b_in after the product; the 4.x bridge runs the source's
        # linear layers, which add it inside (act(x W_gate) * (x W_in + b_in))
        b_in_outside_gate=gated and not c.attn_only and not _is_bridge(model),
        name=short_name(getattr(c, "model_name", None) or "") or "transformer_lens",
    )


def _raw_weights(model, cfg: ModelConfig, adjacent_pairs: bool) -> dict:
    H = cfg.n_heads
    raw = {name: _optional(model, name) for name in ("W_E", "W_Q", "W_K", "W_V", "W_O", "W_U",
                                                     "b_Q", "b_K", "b_V", "b_O", "b_U")}
    for name in ("W_K", "W_V", "b_K", "b_V"):
        raw[name] = expand_kv_heads(raw[name], H)
    if adjacent_pairs:
        for name in ("W_Q", "W_K", "b_Q", "b_K"):
            raw[name] = adjacent_pairs_to_halves(raw[name], cfg.rotary_dim)
    if cfg.positional == "learned":
        raw["W_pos"] = model.W_pos
    if not cfg.attn_only:
        raw.update({name: _optional(model, name) for name in ("W_in", "W_out", "b_in", "b_out")})
        if cfg.gated_mlp:
            raw["W_gate"] = model.W_gate
            _refuse_gate_bias(model)
    if cfg.normalization is not None:
        norms = {"ln1": [_norm_params(block.ln1) for block in model.blocks]}
        if not cfg.attn_only:
            norms["ln2"] = [_norm_params(block.ln2) for block in model.blocks]
        for name, params in norms.items():
            for i, suffix in enumerate("wb"):
                parts = [p[i] for p in params]
                raw[f"{name}_{suffix}"] = None if not parts or parts[0] is None else torch.stack(parts)
        raw["lnf_w"], raw["lnf_b"] = _norm_params(model.ln_final)
    return raw


def _hf_model(model):
    """The Hugging Face model a ``TransformerBridge`` wraps, when ``from_hf`` has its family (else None)."""
    inner = getattr(model, "original_model", None)
    return inner if getattr(getattr(inner, "config", None), "model_type", None) in FAMILIES else None


def probe_transformer_lens(model, circuit, family: str) -> dict:
    """``verify.compare`` against the TransformerLens model's own forward and ``hook_pattern``s."""
    tokens = probe_tokens(circuit.cfg, circuit.device)
    training = getattr(model, "training", False)
    try:
        model.eval()
        with torch.no_grad():
            logits, cache = model.run_with_cache(tokens)
    finally:
        model.train(training)
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(circuit.cfg.n_layers)]
    patterns = torch.stack([cache[n] for n in names], 1) if all(n in cache for n in names) else None
    return compare(circuit, logits.to(circuit.device), None if patterns is None else patterns.to(circuit.device),
                   family, "from_transformer_lens")


def from_transformer_lens(model, tokenizer=None, *, verify: bool = True, name: str | None = None) -> CircuitModel:
    """A TransformerLens model (4.x ``TransformerBridge``; 2.x ``HookedTransformer``, untested)
    -> ``CircuitModel`` with norms folded, K/V expanded per query head (``cfg.n_kv_heads`` records
    grouped-query attention) and biases in ``b_*``. ``tokenizer`` defaults to ``model.tokenizer``.

    A bridge around a Hugging Face model of a family ``from_hf`` knows is translated from that model
    (``from_hf``: its declarative family description, not the bridge's stacked weights, which lose
    partial rotary, sliding windows, QK-norm, multipliers and no-rotary layers). **Verified at
    load** like ``from_hf``: a 16-token probe against the TransformerLens model's own forward and
    attention patterns refuses a disagreement (``verify=False`` skips it). ``name``: how captions, stores
    and pages name the model (default: the last part of the model's own name)."""
    for attr in ("cfg", "blocks", "W_Q", "W_E"):
        if not hasattr(model, attr):
            raise TypeError(f"from_transformer_lens expects a TransformerBridge or HookedTransformer "
                            f"(with .{attr}), got {type(model).__name__}")
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    hf = _hf_model(model) if _is_bridge(model) else None
    if hf is not None:
        circuit = from_hf(hf, tok, verify=False)
        circuit.metadata["source"] = f"transformer_lens:{type(model).__name__}({circuit.metadata['source']})"
        family = hf.config.model_type
    else:
        native = _native_model(model)
        with torch.no_grad():
            cfg = _config(model, native)
            adjacent_pairs = native is not None or getattr(model.cfg, "rotary_adjacent_pairs", False)
            adjacent = cfg.positional == "rotary" and adjacent_pairs
            try:
                raw = _raw_weights(model, cfg, adjacent)
            except AttributeError as err:  # a bridge whose components lack the stacked weights or norms
                inner = getattr(getattr(getattr(model, "original_model", None), "config", None), "model_type", None)
                raise ValueError(f"from_transformer_lens: cannot read the weights of this {type(model).__name__} "
                                 f"({err}); its model (model_type {inner!r}) is not a family from_hf knows: "
                                 f"{sorted(FAMILIES)}") from err
            circuit = build(cfg, raw, as_tokenizer(tok), f"transformer_lens:{type(model).__name__}")
        family = f"TransformerLens {type(model).__name__} ({cfg.name})"
    if verify:
        circuit.metadata["verified"] = probe_transformer_lens(model, circuit, family)
    return named(circuit, name)
