"""Hugging Face causal LMs -> the ``CircuitModel`` weight view (``from_hf``).

Every family is one ``families.Family`` entry; this module reads any entry: the config fields
every family shares (with their per-family spellings), the weights by the entry's names and
layouts, then the entry's features. Norms are folded (``weight_view.fold_norms``); multipliers,
norm offsets, embedding scales and BLOOM's embedding norm fold into the weights here; biases stay
in the forward and in ``b_*``. The translation is verified at load (``verify.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ...progress import progress
from ..circuit_model import CircuitModel
from ..config import ModelConfig
from .families import FAMILIES, Family, get
from .hf_tokenizer import as_tokenizer, folder_tokenizer
from .verify import check_module_heads, check_rotary_modules, probe_hf
from .weight_view import act_fn, adjacent_pairs_to_halves, build, expand_kv_heads

FOLDED = ("embed_scale", "residual_scale", "logit_scale")


def _unwrap(module):
    """The Hugging Face module itself: a TransformerLens bridge replaces the modules of the model it
    wraps by components holding the original as ``_original_component``."""
    inner = getattr(module, "_original_component", None)
    return module if inner is None else _unwrap(inner)


def _module(root, path: str):
    """``root.a.b`` for ``path`` ``"a.b"`` (``""``: root itself), through bridge components."""
    root = _unwrap(root)
    for part in filter(None, path.split(".")):
        root = _unwrap(getattr(root, part))
    return root


def _first(root, names):
    """The first of ``names`` (one name, or a tuple of alternatives) that ``root`` has (None if none)."""
    for name in (names,) if isinstance(names, str) else names or ():
        module = _module(root, name) if hasattr(_unwrap(root), name) else None
        if module is not None:
            return module
    return None


def _tensor(module, name: str = "weight") -> torch.Tensor | None:
    """``module.<name>`` (None if absent) wherever accelerate placed it: a parameter offloaded to CPU or
    disk (``device_map`` with offload) is a meta tensor on the module, its values in the module's
    ``_hf_hook.weights_map``, read from there."""
    value = getattr(module, name, None)
    if value is not None and value.device.type == "meta":
        weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if weights is not None and name in weights:
            return weights[name]
    return value


def _linear(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.Linear`` (or GPT-2's ``Conv1D``, stored ``[in, out]``) -> (weight in the row convention
    ``[in, out]``, bias or None)."""
    conv1d = getattr(module, "conv1d", type(module).__name__ == "Conv1D")  # checkpoint trees say so themselves
    W = _tensor(module)
    return (W if conv1d else W.T), _tensor(module, "bias")


def _heads(W: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """``[d_model, n * d_head]`` -> ``[n, d_model, d_head]``; a bias ``[n * d_head]`` -> ``[n, d_head]``."""
    if W is None:
        return None
    return W.reshape(n, -1) if W.ndim == 1 else W.reshape(W.shape[0], n, -1).transpose(0, 1)


def _norm(module, offset: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if module is None:
        return None, None
    if hasattr(module, "norms"):  # StableLM's per-head layer norms
        return torch.stack([_tensor(n) for n in module.norms]), None
    w, b = _tensor(module), _tensor(module, "bias")
    return (w + 1 if offset and w is not None else w), b


def _rope(config, d_head: int) -> tuple[dict, int]:
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
    mlp = _module(_module(_module(model, family.body), family.layers)[0], family.mlp)
    if family.mlp_layout == "moe":
        n, _, d_e = _tensor(_module(mlp, family.mlp_names[1]), "down_proj").shape
        return n * d_e
    return _linear(_module(mlp, family.mlp_names[-1]))[0].shape[0]


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
    rotary, rotary_dim = _rope(c, d_head) if positional == "rotary" else ({}, None)
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
        rotary_dim=rotary_dim, name=c.name_or_path or c.model_type, **rotary,
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


def _qkv(attn, family: Family, cfg: ModelConfig) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``[(W, b)]`` for Q, K, V: ``W [d_model, n * d_head]`` in the row convention."""
    H, n_kv, dh, d = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, cfg.d_head, cfg.d_model
    layout = family.qkv_layout
    if layout == "separate":
        return [_linear(_module(attn, name)) for name in family.qkv]
    W, b = _linear(_module(attn, family.qkv[0]))
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


def _qk_norm_weights(attn, family: Family, cfg: ModelConfig) -> dict:
    """``w_qnorm/b_qnorm/w_knorm/b_knorm [H, d_head]`` (K expanded per query head)."""
    out = {}
    for which, name, n in (("q", family.q_norm, cfg.n_heads), ("k", family.k_norm, cfg.n_kv_heads or cfg.n_heads)):
        w, b = _norm(_module(attn, name), family.norm_offset)
        for key, t in ((f"w_{which}norm", w), (f"b_{which}norm", b)):
            if t is not None:
                t = t.reshape(-1, cfg.d_head)  # [d_head] shared, [n, d_head] per head, or [n * d_head] flat
                t = t.expand(n, -1) if t.shape[0] == 1 else t
                t = expand_kv_heads(t[None], cfg.n_heads)[0]
            out[key] = t
    return out


def _mlp_weights(mlp, family: Family) -> dict:
    """``W_in, b_in, W_gate, b_gate, W_out, b_out`` (and ``W_router``) of one layer's MLP, row convention.
    A mixture of experts (``"moe"``: router, experts with fused ``gate_up_proj [E, 2 d_e, d]`` and
    ``down_proj [E, d, d_e]``) lays its experts side by side: neuron ``e * d_e + j`` is expert ``e``'s ``j``."""
    mods = [_module(mlp, name) for name in family.mlp_names]
    if family.mlp_layout == "moe":
        router, experts = mods
        n, two_d, d = experts.gate_up_proj.shape
        gate, up = experts.gate_up_proj.split(two_d // 2, dim=1)
        side_by_side = lambda W: W.permute(2, 0, 1).reshape(d, -1)  # noqa: E731  [E, d_e, d] -> [d, E d_e]
        return {"W_gate": side_by_side(gate), "W_in": side_by_side(up), "b_gate": None, "b_in": None,
                "W_out": experts.down_proj.transpose(1, 2).reshape(-1, d), "b_out": None,
                "W_router": router.weight.T}
    if family.mlp_layout == "gate_up":
        W, b = _linear(mods[0])
        gate, up = W.chunk(2, dim=1)
        rows = {"W_gate": gate, "W_in": up, "b_gate": None if b is None else b.chunk(2)[0],
                "b_in": None if b is None else b.chunk(2)[1]}
    elif family.mlp_layout == "gated":
        (Wg, bg), (Wi, bi) = _linear(mods[0]), _linear(mods[1])
        rows = {"W_gate": Wg, "b_gate": bg, "W_in": Wi, "b_in": bi}
    else:
        Wi, bi = _linear(mods[0])
        rows = {"W_in": Wi, "b_in": bi, "W_gate": None, "b_gate": None}
    Wo, bo = _linear(mods[-1])
    return {**rows, "W_out": Wo, "b_out": bo, "W_router": None}


ATTENTION_KEYS = ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V", "W_O", "b_O", "ln1_w", "ln1_b")
LAYER_KEYS = ATTENTION_KEYS + ("W_in", "b_in", "W_gate", "b_gate", "W_out", "b_out", "W_router", "ln2_w", "ln2_b",
                               "w_post_attn", "w_post_mlp", "w_qnorm", "b_qnorm", "w_knorm", "b_knorm")


def layer_weights(layer, family: Family, cfg: ModelConfig, attention_only: bool = False) -> dict:
    """One layer's unfolded weights (``weight_view`` table without the leading ``L``): ``ATTENTION_KEYS``
    (``attention_only``: what the weight-only analyses read, never the MLP) or ``LAYER_KEYS``."""
    H, n_kv = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
    row: dict = {}
    attn = _module(layer, family.attn)
    for key, (W, b), n in zip("QKV", _qkv(attn, family, cfg), (H, n_kv, n_kv)):
        row[f"W_{key}"] = expand_kv_heads(_heads(W, n)[None], H)[0]
        row[f"b_{key}"] = None if b is None else expand_kv_heads(_heads(b, n)[None], H)[0]
    W_O, row["b_O"] = _linear(_module(attn, family.o_proj))
    row["W_O"] = W_O.reshape(H, cfg.d_head, -1)
    ln1 = _norm(_first(layer, family.ln1), family.norm_offset)
    row["ln1_w"], row["ln1_b"] = ln1
    if attention_only:
        return row
    row.update(_mlp_weights(_module(layer, family.mlp), family))
    ln2_module = _first(layer, family.ln2)
    row["ln2_w"], row["ln2_b"] = ln1 if ln2_module is None else _norm(ln2_module, family.norm_offset)  # parallel: one norm
    for key, name in (("w_post_attn", family.post_attn_norm), ("w_post_mlp", family.post_mlp_norm)):
        row[key] = _norm(_module(layer, name), family.norm_offset)[0] if name else None
    norms = _qk_norm_weights(attn, family, cfg) if cfg.qk_norm else {}
    for key in ("w_qnorm", "b_qnorm", "w_knorm", "b_knorm"):
        row[key] = norms.get(key)
    return row


def token_embedding(model, family: Family, cfg: ModelConfig) -> dict:
    """The unfolded ``W_E`` (BLOOM: its embedding norm applied) and ``W_pos`` (learned positions only)."""
    body = _module(model, family.body)
    W_E = _tensor(_module(body, family.embed))
    if family.embed_norm:  # BLOOM: a layer norm of each token's embedding, a function of the token alone
        norm = _module(body, family.embed_norm)
        W_E = F.layer_norm(W_E, (cfg.d_model,), _tensor(norm), _tensor(norm, "bias"), cfg.eps)
    raw = {"W_E": W_E}
    if family.pos_embed:
        raw["W_pos"] = _tensor(_module(body, family.pos_embed))[family.pos_offset:family.pos_offset + cfg.n_ctx]
    return raw


def unembedding(model, family: Family) -> dict:
    """The unfolded ``W_U``, ``b_U`` and the final norm ``lnf_w/lnf_b`` it reads through."""
    raw = dict(zip(("lnf_w", "lnf_b"), _norm(_module(_module(model, family.body), family.final_norm),
                                            family.norm_offset)))
    output = _unwrap(model.get_output_embeddings())
    raw["W_U"], raw["b_U"] = _tensor(output).T, _tensor(output, "bias")  # the embedding itself when tied
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
    rows = [layer_weights(layer, family, cfg) for layer in _module(_module(model, family.body), family.layers)]
    raw = {k: None if not rows or rows[0][k] is None else torch.stack([r[k] for r in rows]) for k in LAYER_KEYS}
    raw.update(token_embedding(model, family, cfg), **unembedding(model, family))
    return apply_folds(raw, family, cfg, folds)


def _main_device(device_map: dict) -> torch.device:
    """The first accelerator in an accelerate ``device_map`` (its values: indices, device names, "cpu",
    "disk"), else the CPU: where a device-mapped model's weight view is gathered."""
    for place in device_map.values():
        if place not in ("cpu", "disk"):
            return torch.device(f"cuda:{place}" if isinstance(place, int) else place)
    return torch.device("cpu")


def from_hf(model, tokenizer=None, *, verify: bool = True, dtype: torch.dtype | None = None) -> CircuitModel:
    """A Hugging Face causal LM of any family in ``families.FAMILIES`` -> ``CircuitModel`` with norms
    folded, K/V expanded per query head (``cfg.n_kv_heads`` records grouped-query attention) and the
    source's biases in ``b_*``. ``tokenizer``: a ``transformers`` tokenizer (or None: token ids only).

    **Verified at load** (``verify=True``, the default): config fields that contradict the modules'
    head counts or weight shapes are refused first; then a 16-token probe runs through the
    translated model and through ``model``'s own forward, and a disagreement in the logits (or, with
    eager attention, the attention patterns) refuses the model, naming the family, the error and the
    likely feature. ``verify=False`` skips the probe (for a model too large to run twice); the
    config/shape check always runs. ``model.metadata["verified"]`` records the probe's errors.

    ``model`` may be a hub name or a local folder (``save_pretrained``): it is loaded with
    ``AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager")`` and its
    tokenizer with ``AutoTokenizer`` (a hub name downloads; never in tests). A folder is first checked
    as ``from_safetensors`` checks it (``checkpoint_model.check_folder``: nothing outside the folder, the
    headers against the config) before transformers opens it; its tokenizer is loaded when it has one
    (one that cannot be loaded warns and is left out). Memory: the source model
    and the weight view are both held while translating (about twice the checkpoint in ``dtype``);
    for weight-only analyses of a large checkpoint, ``from_safetensors`` reads it layer by layer.

    A model placed by accelerate (``from_pretrained(..., device_map=...)``, CPU or disk offload included)
    is read from wherever its weights are (offloaded ones from their hooks' weight maps) and its weight
    view gathered on the map's first accelerator, else the CPU; the probe runs the source's own
    dispatched forward. ``pcw.run`` then runs the weight view (in memory), not the source's dispatch.
    Past a second, a progress bar names the step running (reading, translating, verifying)."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        folder = Path(model)
        with progress(f"from_hf {model}", unit="step") as bar:
            if folder.is_dir():
                # the folder's checks before transformers opens a file of it (checkpoint_model reads this
                # module's translation, hence imported here)
                from .checkpoint_model import check_folder
                bar.note("checking the shards' headers against the config")
                check_folder(folder, loader="from_hf")
            bar.note("loading with transformers")
            source = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager")
            bar.note("loading the tokenizer")
            if tokenizer is None:
                tokenizer = folder_tokenizer(folder) if folder.is_dir() else AutoTokenizer.from_pretrained(model)
        return from_hf(source.eval(), tokenizer, verify=verify)
    if dtype is not None:
        raise TypeError("from_hf: dtype applies when loading by name or folder; cast a loaded model itself "
                        f"(model.to({dtype}))")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"from_hf: unsupported model {type(model).__name__} (config.model_type={model_type!r}); "
                         f"supported model types: {sorted(FAMILIES)}")
    family = FAMILIES[model_type]
    missing = family.refuse(model.config)
    if missing:
        raise ValueError(f"from_hf: {model_type} with {missing} is not supported: the weight view's forward has "
                         "no such feature")
    with torch.no_grad(), progress(f"from_hf {model_type}", total=3 if verify else 2, unit="step") as bar:
        bar.note("reading the weights")
        cfg, folds = read_config(model.config, family, mlp_width(model, family))
        check_module_heads(model, family, cfg)
        check_rotary_modules(model, cfg)
        raw = read_weights(model, family, cfg, folds)
        if getattr(model, "hf_device_map", None):  # placed by accelerate: gather the weights on one device
            raw = {k: None if v is None else v.to(_main_device(model.hf_device_map)) for k, v in raw.items()}
        bar.update()
        bar.note("building the weight view")
        circuit = build(cfg, raw, as_tokenizer(tokenizer), f"hf:{model_type}")
        bar.update()
        circuit.metadata["folded"] = {k: float(v) for k, v in folds.items()}
        if verify:
            bar.note("verifying against the model's own forward")
            circuit.metadata["verified"] = probe_hf(model, circuit, model_type)
            bar.update()
    return circuit
