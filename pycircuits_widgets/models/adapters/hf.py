"""Hugging Face causal LMs -> the ``CircuitModel`` weight view (``from_hf``).

Supported ``config.model_type``: ``gpt2`` (Conv1D weights, learned positions, layer norm),
``gpt_neox`` (partial rotary, parallel attention + MLP, fused QKV interleaved per head), ``llama``
(RMSNorm, rotary, SwiGLU MLP, grouped-query attention, optionally tied embeddings).
Norms are folded (``weight_view.fold_norms``); biases stay in the forward and in ``b_*``.
"""

from __future__ import annotations

import torch

from ..circuit_model import CircuitModel
from ..config import ModelConfig
from .hf_tokenizer import as_tokenizer
from .weight_view import act_fn, build, expand_kv_heads

def _linear_in_out(linear) -> torch.Tensor:
    """``nn.Linear`` weight ``[out, in]`` -> row convention ``[in, out]``."""
    return linear.weight.T


def _bias(module) -> torch.Tensor | None:
    return getattr(module, "bias", None)


def _heads_in(W: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[d_model, n_heads * d_head]`` (row convention) -> ``[n_heads, d_model, d_head]``."""
    return W.reshape(W.shape[0], n_heads, -1).transpose(0, 1)


def _heads_out(W: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[n_heads * d_head, d_model]`` (row convention) -> ``[n_heads, d_head, d_model]``."""
    return W.reshape(n_heads, -1, W.shape[-1])


def _stack(rows: list) -> torch.Tensor | None:
    return None if rows[0] is None else torch.stack(rows)


ROPE_TYPES = ("default", "linear")


def _rope(config, d_head: int) -> tuple[int, float, float]:
    """``(rotary_dim, base, rotary_scale)`` of a rotary model, under every ``transformers`` release the
    extras allow: 5.x keeps them in ``config.rope_parameters``; 4.x in ``config.rope_scaling``
    (``"type"`` or ``"rope_type"``, ``"factor"``) beside ``rope_theta`` (LLaMA) or ``rotary_emb_base``
    and ``rotary_pct`` (GPT-NeoX). Linear scaling divides positions by ``factor``; other scaled
    variants (dynamic NTK, YaRN, llama3, ...) change the frequencies by rules the weight view's
    forward does not have, so they are refused."""
    params: dict = {}
    for source in (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None)):
        if isinstance(source, dict):
            params.update(source)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported rotary embeddings: "
                         f"{', '.join(repr(t) for t in ROPE_TYPES)}")
    scale = float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0
    partial = params.get("partial_rotary_factor",
                         getattr(config, "partial_rotary_factor", None) or getattr(config, "rotary_pct", 1.0))
    base = params.get("rope_theta", getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", 10000.0))
    return int(d_head * partial), float(base), scale


def _norm(module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return getattr(module, "weight", None), getattr(module, "bias", None)


def _gpt2(model) -> tuple[ModelConfig, dict]:
    c, body = model.config, model.transformer
    if c.scale_attn_by_inverse_layer_idx or c.add_cross_attention:
        raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx or cross-attention is not supported "
                         "(one attention scale for every layer, decoder-only expected)")
    H, d = c.n_head, c.n_embd
    cfg = ModelConfig(
        n_layers=c.n_layer, n_heads=H, d_model=d, d_head=d // H, d_vocab=c.vocab_size, n_ctx=c.n_positions,
        positional="learned", normalization="layernorm", attn_only=False, d_mlp=c.n_inner or 4 * d,
        act_fn=act_fn(c.activation_function), eps=c.layer_norm_epsilon,
        attn_scale=(d // H) ** 0.5 if c.scale_attn_weights else 1.0, name=c.name_or_path or "gpt2",
    )
    raw: dict[str, list] = {k: [] for k in ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O", "b_O", "W_in",
                                            "b_in", "W_out", "b_out", "ln1_w", "ln1_b", "ln2_w", "ln2_b")}
    for block in body.h:  # Conv1D weights are already [in, out]
        for key, W, b in zip("QKV", block.attn.c_attn.weight.split(d, dim=1), block.attn.c_attn.bias.split(d)):
            raw[f"W_{key}"].append(_heads_in(W, H))
            raw[f"b_{key}"].append(b.reshape(H, -1))
        raw["W_O"].append(_heads_out(block.attn.c_proj.weight, H))
        raw["b_O"].append(block.attn.c_proj.bias)
        raw["W_in"].append(block.mlp.c_fc.weight)
        raw["b_in"].append(block.mlp.c_fc.bias)
        raw["W_out"].append(block.mlp.c_proj.weight)
        raw["b_out"].append(block.mlp.c_proj.bias)
        for name, ln in (("ln1", block.ln_1), ("ln2", block.ln_2)):
            w, b = _norm(ln)
            raw[f"{name}_w"].append(w)
            raw[f"{name}_b"].append(b)
    weights = {k: _stack(v) for k, v in raw.items()}
    weights.update(W_E=body.wte.weight, W_pos=body.wpe.weight, lnf_w=body.ln_f.weight, lnf_b=body.ln_f.bias)
    return cfg, weights


def _gpt_neox(model) -> tuple[ModelConfig, dict]:
    c, body = model.config, model.gpt_neox
    H, d = c.num_attention_heads, c.hidden_size
    d_head = d // H
    rotary_dim, base, scale = _rope(c, d_head)
    cfg = ModelConfig(
        n_layers=c.num_hidden_layers, n_heads=H, d_model=d, d_head=d_head, d_vocab=c.vocab_size,
        n_ctx=c.max_position_embeddings, positional="rotary", normalization="layernorm", attn_only=False,
        d_mlp=c.intermediate_size, act_fn=act_fn(c.hidden_act), eps=c.layer_norm_eps, rotary_dim=rotary_dim,
        rotary_base=base, rotary_scale=scale, parallel_attn_mlp=bool(c.use_parallel_residual), name=c.name_or_path or "gpt_neox",
    )
    raw: dict[str, list] = {k: [] for k in ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O", "b_O", "W_in",
                                            "b_in", "W_out", "b_out", "ln1_w", "ln1_b", "ln2_w", "ln2_b")}
    for layer in body.layers:
        qkv = layer.attention.query_key_value  # output features ordered [head, (q, k, v), d_head]
        W = qkv.weight.reshape(H, 3, d_head, d).permute(1, 0, 3, 2)  # [3, H, d_model, d_head]
        b = _bias(qkv)
        for i, key in enumerate("QKV"):
            raw[f"W_{key}"].append(W[i])
            raw[f"b_{key}"].append(None if b is None else b.reshape(H, 3, d_head)[:, i])
        raw["W_O"].append(_heads_out(_linear_in_out(layer.attention.dense), H))
        raw["b_O"].append(_bias(layer.attention.dense))
        raw["W_in"].append(_linear_in_out(layer.mlp.dense_h_to_4h))
        raw["b_in"].append(_bias(layer.mlp.dense_h_to_4h))
        raw["W_out"].append(_linear_in_out(layer.mlp.dense_4h_to_h))
        raw["b_out"].append(_bias(layer.mlp.dense_4h_to_h))
        for name, ln in (("ln1", layer.input_layernorm), ("ln2", layer.post_attention_layernorm)):
            w, b_ln = _norm(ln)
            raw[f"{name}_w"].append(w)
            raw[f"{name}_b"].append(b_ln)
    weights = {k: _stack(v) for k, v in raw.items()}
    weights.update(W_E=body.embed_in.weight, lnf_w=body.final_layer_norm.weight, lnf_b=body.final_layer_norm.bias)
    return cfg, weights


def _llama(model) -> tuple[ModelConfig, dict]:
    c, body = model.config, model.model
    if getattr(c, "mlp_bias", False):
        raise ValueError("LLaMA with mlp_bias=True is not supported (the weight view has no gate bias)")
    H, d = c.num_attention_heads, c.hidden_size
    d_head = getattr(c, "head_dim", None) or d // H
    n_kv = c.num_key_value_heads or H
    rotary_dim, base, scale = _rope(c, d_head)
    cfg = ModelConfig(
        n_layers=c.num_hidden_layers, n_heads=H, d_model=d, d_head=d_head, d_vocab=c.vocab_size,
        n_ctx=c.max_position_embeddings, n_kv_heads=n_kv if n_kv < H else None, positional="rotary",
        normalization="rmsnorm", attn_only=False, d_mlp=c.intermediate_size, act_fn=act_fn(c.hidden_act),
        gated_mlp=True, eps=c.rms_norm_eps, rotary_dim=rotary_dim, rotary_base=base, rotary_scale=scale, name=c.name_or_path or "llama",
    )
    raw: dict[str, list] = {k: [] for k in ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O", "b_O", "W_in",
                                            "W_gate", "W_out", "ln1_w", "ln2_w")}
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for key, proj, heads in (("Q", attn.q_proj, H), ("K", attn.k_proj, n_kv), ("V", attn.v_proj, n_kv)):
            b = _bias(proj)
            raw[f"W_{key}"].append(expand_kv_heads(_heads_in(_linear_in_out(proj), heads)[None], H)[0])
            raw[f"b_{key}"].append(None if b is None else expand_kv_heads(b.reshape(1, heads, d_head), H)[0])
        raw["W_O"].append(_heads_out(_linear_in_out(attn.o_proj), H))
        raw["b_O"].append(_bias(attn.o_proj))
        raw["W_in"].append(_linear_in_out(mlp.up_proj))
        raw["W_gate"].append(_linear_in_out(mlp.gate_proj))
        raw["W_out"].append(_linear_in_out(mlp.down_proj))
        raw["ln1_w"].append(layer.input_layernorm.weight)
        raw["ln2_w"].append(layer.post_attention_layernorm.weight)
    weights = {k: _stack(v) for k, v in raw.items()}
    weights.update(W_E=body.embed_tokens.weight, lnf_w=body.norm.weight)
    return cfg, weights


_ARCHITECTURES = {"gpt2": _gpt2, "gpt_neox": _gpt_neox, "llama": _llama}


def from_hf(model, tokenizer=None) -> CircuitModel:
    """A Hugging Face causal LM (``GPT2LMHeadModel``, ``GPTNeoXForCausalLM``, ``LlamaForCausalLM``)
    -> ``CircuitModel`` with norms folded, K/V expanded per query head (``cfg.n_kv_heads`` records
    grouped-query attention) and the source's biases in ``b_*``. ``tokenizer``: a ``transformers``
    tokenizer (or None: token ids only). A hub name string loads the model and tokenizer first
    (downloads; never used in tests)."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        return from_hf(AutoModelForCausalLM.from_pretrained(model), tokenizer or AutoTokenizer.from_pretrained(model))
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"from_hf: unsupported model {type(model).__name__} (config.model_type={model_type!r}); "
                         f"supported model types: {sorted(_ARCHITECTURES)}")
    with torch.no_grad():
        cfg, raw = _ARCHITECTURES[model_type](model)
        output = model.get_output_embeddings()
        raw["W_U"] = output.weight.T  # the input embedding itself when tie_word_embeddings
        raw["b_U"] = _bias(output)
        return build(cfg, raw, as_tokenizer(tokenizer), f"hf:{model_type}")
