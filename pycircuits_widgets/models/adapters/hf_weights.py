"""Reading a Hugging Face causal LM into the weight view's table of unfolded weights.

Every family is one ``families.Family`` entry; these readers read any entry: the config fields every
family shares (with their per-family spellings, ``read_config``), the weights by the entry's module
names and layouts (``layer_weights``, ``token_embedding``, ``unembedding``), then the multipliers the
entry's features fold in (``apply_folds``). They read a loaded model (``hf.from_hf``), the module tree
of a checkpoint folder (``checkpoint_model``) and what load-time verification compares against
(``verify``) alike, through modules wrapped by a TransformerLens bridge or placed by accelerate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig, short_name
from .families import Family, get
from .weight_view import act_fn, adjacent_pairs_to_halves, expand_kv_heads

FOLDED = ("embed_scale", "residual_scale", "logit_scale")


def unwrap(module):
    """The Hugging Face module itself: a TransformerLens bridge replaces the modules of the model it
    wraps by components holding the original as ``_original_component``."""
    inner = getattr(module, "_original_component", None)
    return module if inner is None else unwrap(inner)


def submodule(root, path: str):
    """``root.a.b`` for ``path`` ``"a.b"`` (``""``: root itself), through bridge components."""
    root = unwrap(root)
    for part in filter(None, path.split(".")):
        root = unwrap(getattr(root, part))
    return root


def _first(root, names):
    """The first of ``names`` (one name, or a tuple of alternatives) that ``root`` has (None if none)."""
    for name in (names,) if isinstance(names, str) else names or ():
        module = submodule(root, name) if hasattr(unwrap(root), name) else None
        if module is not None:
            return module
    return None


def module_tensor(module, name: str = "weight") -> torch.Tensor | None:
    """``module.<name>`` in its stored shape (``nn.Linear``: ``[out, in]``; a norm: ``[d]``), None if absent,
    wherever accelerate placed it: a parameter offloaded to CPU or disk (``device_map`` with offload) is a
    meta tensor on the module, its values in the module's ``_hf_hook.weights_map``, read from there."""
    value = getattr(module, name, None)
    if value is not None and value.device.type == "meta":
        weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if weights is not None and name in weights:
            return weights[name]
    return value


def linear_weights(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.Linear`` (or GPT-2's ``Conv1D``, stored ``[in, out]``) -> (weight in the row convention
    ``[in, out]``, bias or None)."""
    conv1d = getattr(module, "conv1d", type(module).__name__ == "Conv1D")  # checkpoint trees say so themselves
    W = module_tensor(module)
    return (W if conv1d else W.T), module_tensor(module, "bias")


def _heads(W: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """``[d_model, n * d_head]`` -> ``[n, d_model, d_head]``; a bias ``[n * d_head]`` -> ``[n, d_head]``."""
    if W is None:
        return None
    return W.reshape(n, -1) if W.ndim == 1 else W.reshape(W.shape[0], n, -1).transpose(0, 1)


def norm_weights(module, offset: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(w [d], b [d] or None)`` of a norm module (StableLM's per-head norms: ``w [H, d_head]``), ``(None,
    None)`` for no module; ``offset``: the family stores ``w - 1`` (Gemma), so ``w + 1`` is returned."""
    if module is None:
        return None, None
    if hasattr(module, "norms"):  # StableLM's per-head layer norms
        return torch.stack([module_tensor(n) for n in module.norms]), None
    w, b = module_tensor(module), module_tensor(module, "bias")
    return (w + 1 if offset and w is not None else w), b


def rope_fields(config, d_head: int) -> tuple[dict, int]:
    """(``ModelConfig`` rotary fields, rotary_dim) from ``config.rope_parameters`` (5.x) or
    ``rope_scaling`` + ``rope_theta`` / ``rotary_emb_base`` / ``rotary_pct`` (4.x spellings)."""
    params: dict = {}
    for source in (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None)):
        if isinstance(source, dict) and not any(isinstance(v, dict) for v in source.values()):
            params.update(source)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    partial = params.get("partial_rotary_factor",
                         get(config, "partial_rotary_factor", "rotary_pct", default=1.0))
    base = params.get("rope_theta") or get(config, "rope_theta", "rotary_emb_base", default=10000.0)
    fields = {"rotary_base": float(base)}
    if rope_type == "linear":
        fields["rotary_scale"] = float(params["factor"])
    elif rope_type != "default":
        fields["rope"] = {k: v for k, v in params.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
        fields["rope"]["rope_type"] = rope_type
    return fields, int(d_head * partial)


def mlp_width(model, family: Family) -> int:
    """``d_mlp``: the input width of layer 0's last MLP projection (a mixture of experts: every
    expert's ``down_proj [E, d_model, d_e]`` side by side, ``E d_e``)."""
    mlp = submodule(submodule(submodule(model, family.body), family.layers)[0], family.mlp)
    if family.mlp_layout == "moe":
        n, _, d_e = module_tensor(submodule(mlp, family.mlp_names[1]), "down_proj").shape
        return n * d_e
    return linear_weights(submodule(mlp, family.mlp_names[-1]))[0].shape[0]


def read_config(c, family: Family, d_mlp: int) -> tuple[ModelConfig, dict]:
    """(``ModelConfig``, fold factors) of a Hugging Face config ``c`` under ``family``; ``d_mlp``
    from the weights (``mlp_width``), which some families' configs do not state."""
    features = dict(family.features(c))
    folds = {k: features.pop(k) for k in FOLDED if k in features}
    H = get(c, "num_attention_heads", "n_head", "num_heads", "n_heads")
    d = get(c, "hidden_size", "n_embd", "d_model")
    d_head = get(c, "head_dim", default=d // H)
    n_kv = features.pop("n_kv_heads", None) or get(c, "num_key_value_heads", "num_kv_heads", default=H)
    alibi = features.get("alibi_slopes") is not None
    positional = "learned" if family.pos_embed else "none" if alibi else "rotary"
    rotary, rotary_dim = rope_fields(c, d_head) if positional == "rotary" else ({}, None)
    nested = getattr(c, "rope_parameters", None)
    if positional == "rotary" and isinstance(nested, dict) and all(isinstance(v, dict) for v in nested.values()):
        # rope parameters per layer type (Gemma 3, OLMo 3): local and global layers rotate differently
        features["layer_rope"] = [{k: v for k, v in nested[t].items() if k != "partial_rotary_factor"}
                                  for t in c.layer_types]
    fields = dict(
        n_layers=get(c, "num_hidden_layers", "n_layer", "num_layers", "n_layers"), n_heads=H, d_model=d,
        d_head=d_head, d_vocab=c.vocab_size,
        n_ctx=get(c, "max_position_embeddings", "n_positions", "max_seq_len", default=2048),
        n_kv_heads=n_kv if n_kv < H else None, positional=positional, normalization=family.norm,
        attn_only=False, d_mlp=d_mlp,
        act_fn=get(c, "hidden_act", "activation_function", "hidden_activation", default="gelu"),
        gated_mlp=family.mlp_layout != "plain",
        eps=float(get(c, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps",
                      default=1e-5)),
        rotary_dim=rotary_dim, name=short_name(c.name_or_path) or c.model_type, **rotary,
    )
    fields.update(features)
    if rotary.get("rope", {}).get("rope_type") == "dynamic":
        # dynamic NTK grows the base past the trained length: run up to factor x that length
        fields["rope"]["max_position_embeddings"] = fields["n_ctx"]
        fields["n_ctx"] = int(fields["n_ctx"] * fields["rope"]["factor"])
    if fields.get("rotary_dim") is None and positional == "rotary":
        fields["rotary_dim"] = d_head
    fields["act_fn"] = act_fn(fields["act_fn"])
    return ModelConfig(**fields), folds


def qkv_weights(attn, family: Family, cfg: ModelConfig) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``[(W, b)]`` for Q, K, V: ``W [d_model, n * d_head]`` in the row convention."""
    H, n_kv, dh, d = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, cfg.d_head, cfg.d_model
    layout = family.qkv_layout
    if layout == "separate":
        return [linear_weights(submodule(attn, name)) for name in family.qkv]
    W, b = linear_weights(submodule(attn, family.qkv[0]))
    W = W.T  # [out, in]: the fused output features are split below
    sizes = [H * dh, n_kv * dh, n_kv * dh]
    if layout in ("concat", "conv1d"):
        return [(w.T, None if b is None else bb) for w, bb in zip(W.split(sizes), b.split(sizes) if b is not None
                                                                  else [None] * 3)]
    if layout == "falcon":  # [kv group, (its g queries, k, v), d_head]: multi-query is one group of n_heads
        g = H // n_kv
        Wg, bg = W.reshape(n_kv, g + 2, dh, d), None if b is None else b.reshape(n_kv, g + 2, dh)
        parts = (slice(0, g), slice(g, g + 1), slice(g + 1, g + 2))
        return [(Wg[:, p].reshape(-1, d).T, None if bg is None else bg[:, p].reshape(-1)) for p in parts]
    if layout == "per_head":  # output features [head, (q, k, v), d_head]
        Wh, bh = W.reshape(H, 3, dh, d), None if b is None else b.reshape(H, 3, dh)
        return [(Wh[:, i].reshape(H * dh, d).T, None if bh is None else bh[:, i].reshape(-1)) for i in range(3)]
    if layout == "codegen":  # 4 shards, each [q | v | k] of d_model / 4 features
        Ws = W.reshape(4, 3, d // 4, d)
        return [(Ws[:, i].reshape(d, d).T, None) for i in (0, 2, 1)]
    raise ValueError(f"unknown qkv layout {layout!r}")


def qk_norm_weights(attn, family: Family, cfg: ModelConfig) -> dict:
    """``w_qnorm/b_qnorm/w_knorm/b_knorm [H, d_head]`` (K expanded per query head)."""
    out = {}
    for which, name, n in (("q", family.q_norm, cfg.n_heads), ("k", family.k_norm, cfg.n_kv_heads or cfg.n_heads)):
        w, b = norm_weights(submodule(attn, name), family.norm_offset)
        for key, t in ((f"w_{which}norm", w), (f"b_{which}norm", b)):
            if t is not None:
                t = t.reshape(-1, cfg.d_head)  # [d_head] shared, [n, d_head] per head, or [n * d_head] flat
                t = t.expand(n, -1) if t.shape[0] == 1 else t
                t = expand_kv_heads(t[None], cfg.n_heads)[0]
            out[key] = t
    return out


def mlp_weights(mlp, family: Family) -> dict:
    """``W_in, b_in, W_gate, b_gate, W_out, b_out`` (and ``W_router``) of one layer's MLP, row convention.
    A mixture of experts (``"moe"``: router, experts with fused ``gate_up_proj [E, 2 d_e, d]`` and
    ``down_proj [E, d, d_e]``) lays its experts side by side: neuron ``e * d_e + j`` is expert ``e``'s ``j``."""
    mods = [submodule(mlp, name) for name in family.mlp_names]
    if family.mlp_layout == "moe":
        router, experts = mods
        _, two_d, d = experts.gate_up_proj.shape
        gate, up = experts.gate_up_proj.split(two_d // 2, dim=1)
        side_by_side = lambda W: W.permute(2, 0, 1).reshape(d, -1)  # [E, d_e, d] -> [d, E d_e]
        return {"W_gate": side_by_side(gate), "W_in": side_by_side(up), "b_gate": None, "b_in": None,
                "W_out": experts.down_proj.transpose(1, 2).reshape(-1, d), "b_out": None,
                "W_router": router.weight.T}
    if family.mlp_layout == "gate_up":
        W, b = linear_weights(mods[0])
        gate, up = W.chunk(2, dim=1)
        rows = {"W_gate": gate, "W_in": up, "b_gate": None if b is None else b.chunk(2)[0],
                "b_in": None if b is None else b.chunk(2)[1]}
    elif family.mlp_layout == "gated":
        (Wg, bg), (Wi, bi) = linear_weights(mods[0]), linear_weights(mods[1])
        rows = {"W_gate": Wg, "b_gate": bg, "W_in": Wi, "b_in": bi}
    else:
        Wi, bi = linear_weights(mods[0])
        rows = {"W_in": Wi, "b_in": bi, "W_gate": None, "b_gate": None}
    Wo, bo = linear_weights(mods[-1])
    return {**rows, "W_out": Wo, "b_out": bo, "W_router": None}


ATTENTION_KEYS = ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O", "b_O", "ln1_w", "ln1_b")
LAYER_KEYS = ATTENTION_KEYS + ("W_in", "b_in", "W_gate", "b_gate", "W_out", "b_out", "W_router", "ln2_w", "ln2_b",
                               "w_post_attn", "w_post_mlp", "w_qnorm", "b_qnorm", "w_knorm", "b_knorm")


def layer_weights(layer, family: Family, cfg: ModelConfig, attention_only: bool = False) -> dict:
    """One layer's unfolded weights (``weight_view`` table without the leading ``L``): ``ATTENTION_KEYS``
    (``attention_only``: what the weight-only analyses read, never the MLP) or ``LAYER_KEYS``."""
    H, n_kv = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
    row: dict = {}
    attn = submodule(layer, family.attn)
    for key, (W, b), n in zip("QKV", qkv_weights(attn, family, cfg), (H, n_kv, n_kv)):
        row[f"W_{key}"] = expand_kv_heads(_heads(W, n)[None], H)[0]
        row[f"b_{key}"] = None if b is None else expand_kv_heads(_heads(b, n)[None], H)[0]
    W_O, row["b_O"] = linear_weights(submodule(attn, family.o_proj))
    row["W_O"] = W_O.reshape(H, cfg.d_head, -1)
    ln1 = norm_weights(_first(layer, family.ln1), family.norm_offset)
    row["ln1_w"], row["ln1_b"] = ln1
    if attention_only:
        return row
    row.update(mlp_weights(submodule(layer, family.mlp), family))
    ln2_module = _first(layer, family.ln2)
    row["ln2_w"], row["ln2_b"] = ln1 if ln2_module is None else norm_weights(ln2_module, family.norm_offset)  # parallel: one norm
    for key, name in (("w_post_attn", family.post_attn_norm), ("w_post_mlp", family.post_mlp_norm)):
        row[key] = norm_weights(submodule(layer, name), family.norm_offset)[0] if name else None
    norms = qk_norm_weights(attn, family, cfg) if cfg.qk_norm else {}
    for key in ("w_qnorm", "b_qnorm", "w_knorm", "b_knorm"):
        row[key] = norms.get(key)
    return row


def token_embedding(model, family: Family, cfg: ModelConfig) -> dict:
    """The unfolded ``W_E`` (BLOOM: its embedding norm applied) and ``W_pos`` (learned positions only)."""
    body = submodule(model, family.body)
    W_E = module_tensor(submodule(body, family.embed))
    if family.embed_norm:  # BLOOM: a layer norm of each token's embedding, a function of the token alone
        norm = submodule(body, family.embed_norm)
        W_E = F.layer_norm(W_E, (cfg.d_model,), module_tensor(norm), module_tensor(norm, "bias"), cfg.eps)
    raw = {"W_E": W_E}
    if family.pos_embed:
        raw["W_pos"] = module_tensor(submodule(body, family.pos_embed))[family.pos_offset:family.pos_offset + cfg.n_ctx]
    return raw


def unembedding(model, family: Family) -> dict:
    """The unfolded ``W_U``, ``b_U`` and the final norm ``lnf_w/lnf_b`` it reads through."""
    raw = dict(zip(("lnf_w", "lnf_b"), norm_weights(submodule(submodule(model, family.body), family.final_norm),
                                            family.norm_offset)))
    output = unwrap(model.get_output_embeddings())
    raw["W_U"], raw["b_U"] = module_tensor(output).T, module_tensor(output, "bias")  # the embedding itself when tied
    return raw


def apply_folds(raw: dict, family: Family, cfg: ModelConfig, folds: dict) -> dict:
    """``raw`` (any subset of the ``weight_view`` keys, any leading dims) with the GPT-J rotary layout
    turned into GPT-NeoX's and the multipliers (``folds``) folded in; absent keys stay absent."""
    raw = dict(raw)
    if family.interleaved_rotary:
        for key in ("W_Q", "W_K", "b_Q", "b_K", "w_qnorm", "b_qnorm", "w_knorm", "b_knorm"):
            if key in raw:
                raw[key] = adjacent_pairs_to_halves(raw[key], cfg.rotary_dim)
    scaled = {"embed_scale": ("W_E",), "residual_scale": ("W_O", "b_O", "W_out", "b_out"),
              "logit_scale": ("W_U", "b_U")}
    for key, names in scaled.items():
        for name in names if key in folds else ():
            if raw.get(name) is not None:
                raw[name] = raw[name] * folds[key]
    return raw


def read_weights(model, family: Family, cfg: ModelConfig, folds: dict) -> dict:
    """The unfolded weights (``weight_view`` table) of every layer, multipliers folded."""
    rows = [layer_weights(layer, family, cfg) for layer in submodule(submodule(model, family.body), family.layers)]
    raw = {k: None if not rows or rows[0][k] is None else torch.stack([r[k] for r in rows]) for k in LAYER_KEYS}
    raw.update(token_embedding(model, family, cfg), **unembedding(model, family))
    return apply_folds(raw, family, cfg, folds)
