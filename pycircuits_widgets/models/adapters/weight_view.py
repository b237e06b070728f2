"""From a source model's unfolded weights to the folded ``CircuitModel`` weight view.

Every adapter (TransformerLens, Hugging Face) first extracts the source model's weights in the
row convention, one ``W_Q/W_K/W_V`` per query head, with the norms still separate:

==================  ==========================  =============================================
key                 shape                       meaning
==================  ==========================  =============================================
``W_E``, ``W_pos``  ``[d_vocab | n_ctx, d]``    embeddings (``W_pos`` only for learned positions)
``W_Q/W_K/W_V``     ``[L, H, d, d_head]``       ``b_Q/b_K/b_V [L, H, d_head]`` optional
``W_O``             ``[L, H, d_head, d]``       ``b_O [L, d]`` optional
``W_in/W_gate``     ``[L, d, d_mlp]``           ``b_in [L, d_mlp]`` optional
``W_out``           ``[L, d_mlp, d]``           ``b_out [L, d]`` optional
``W_U``             ``[d, d_vocab]``            ``b_U [d_vocab]`` optional
``ln1_w/ln1_b``     ``[L, d]``                  norm read by attention (None: no learned part)
``ln2_w/ln2_b``     ``[L, d]``                  norm read by the MLP
``lnf_w/lnf_b``     ``[d]``                     norm read by the unembedding
==================  ==========================  =============================================

``fold_norms`` then applies the paper's folding: ``LN(x) @ W = (x_hat * w + b) @ W =
x_hat @ (diag(w) W) + b @ W``; with layer norm, the writers of the residual stream are centered
so the norm's centering is the identity. RMSNorm does not center: only its scale folds.
"""

from __future__ import annotations

import torch

from ..circuit_model import CircuitModel, check_weight
from ..config import ModelConfig
from ..folding import center_readers, center_writing_weights, fold_bias_into_reader, fold_scale_into_reader

NORM_KEYS = ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "lnf_w", "lnf_b")
BIASES = ("b_Q", "b_K", "b_V", "b_O", "b_in", "b_out", "b_U")
# activation names in Hugging Face and TransformerLens -> ModelConfig.act_fn (the tanh
# approximations of GELU are one formula)
_ACT_FNS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu_fast": "gelu_new",
            "relu": "relu", "silu": "silu", "swish": "silu", "relu2": "relu2"}


def act_fn(name: str) -> str:
    """A source library's activation name -> ``ModelConfig.act_fn``; refuses unknown ones."""
    if name not in _ACT_FNS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACT_FNS)}")
    return _ACT_FNS[name]


def expand_kv_heads(W: torch.Tensor | None, n_heads: int) -> torch.Tensor | None:
    """Grouped-query attention: ``W [L, n_kv_heads, ...]`` -> ``[L, n_heads, ...]``.

    Query head ``h`` reads key/value head ``h // (n_heads // n_kv_heads)`` (Hugging Face
    ``repeat_kv`` and TransformerLens use this grouping), hence ``repeat_interleave``."""
    if W is None or W.shape[1] == n_heads:
        return W
    n_kv = W.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"cannot share {n_kv} key/value heads among {n_heads} query heads "
                         "(n_heads must be a multiple of n_kv_heads)")
    return W.repeat_interleave(n_heads // n_kv, dim=1)


def adjacent_pairs_to_halves(W: torch.Tensor | None, rotary_dim: int) -> torch.Tensor | None:
    """``W [..., d_head]`` -> ``[..., d_head]``: the ``d_head`` axis (last) of a query/key weight or bias
    reordered so that rotary embedding
    in the GPT-J layout (dims ``2i, 2i+1`` rotate together) becomes the GPT-NeoX ``rotate_half``
    layout (dims ``i, i + rotary_dim/2``) ``CircuitModel`` uses.

    Queries and keys get the same permutation, so ``q . k``, the patterns and ``QK = W_Q W_K^T``
    are unchanged; only the order of the ``d_head`` coordinates differs from the source."""
    if W is None:
        return None
    rotated = torch.arange(rotary_dim, device=W.device)
    order = torch.cat([rotated[0::2], rotated[1::2], torch.arange(rotary_dim, W.shape[-1], device=W.device)])
    return W[..., order]


def fold_norms(raw: dict[str, torch.Tensor | None], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Unfolded weights (the module docstring's table: ``W_Q [L, H, d, d_head]``, ``ln1_w [L, d]``, ...) ->
    the folded weights ``CircuitModel`` takes, in the same shapes (the norms' entries gone).

    Readers: ``ln1`` -> ``W_Q, W_K, W_V`` (+ biases), ``ln2`` -> ``W_in, W_gate, W_router`` (+ ``b_in``),
    ``lnf`` -> ``W_U`` (+ ``b_U``). Writers centered (layer norm only): ``W_E``, ``W_pos``,
    ``W_O``, ``b_O``, ``W_out``, ``b_out``; readers centred too (``folding.center_readers``). A norm
    bias in front of a gated MLP becomes ``b_gate`` as well as ``b_in``. Other keys (QK-norm and
    post-norm weights) pass through unchanged."""
    out = {k: v for k, v in raw.items() if k not in NORM_KEYS and v is not None}
    if cfg.normalization is None:
        return out

    def fold(w_key, b_key, readers, biases, leading):
        w, b = raw.get(w_key), raw.get(b_key)
        for reader, bias in zip(readers, biases):
            W = raw.get(reader)
            if W is None:
                continue
            if b is not None:
                if bias is None:
                    raise ValueError(f"cannot fold the norm bias {b_key} into {reader}: the weight view has "
                                     f"no bias for it (expected {b_key} to be None for this architecture)")
                out[bias] = fold_bias_into_reader(b.reshape(*leading(b), -1), W, raw.get(bias))
            if w is not None:
                out[reader] = fold_scale_into_reader(w.reshape(*leading(w), -1), W)

    def per_head(t):  # [L, d] -> [L, 1, d]: one norm shared by every head of a layer
        return (t.shape[0], 1)

    fold("ln1_w", "ln1_b", ("W_Q", "W_K", "W_V"), ("b_Q", "b_K", "b_V"), per_head)
    # a norm bias before a gated MLP folds into both of its products' biases, unless b_in is added
    # after the product (TransformerLens 2.x GatedMLP), where it has no exact place
    mlp_biases = (None, None) if cfg.b_in_outside_gate else ("b_in", "b_gate")
    fold("ln2_w", "ln2_b", ("W_in", "W_gate", "W_router"), mlp_biases + (None,), lambda t: (t.shape[0],))
    fold("lnf_w", "lnf_b", ("W_U",), ("b_U",), lambda t: ())
    if cfg.normalization == "layernorm":
        for writer in ("W_E", "W_pos", "W_O", "b_O", "W_out", "b_out"):
            if writer in out and not (writer == "W_pos" and cfg.positional != "learned"):
                out[writer] = center_writing_weights(out[writer])
    return center_readers(out, cfg)


def build(cfg: ModelConfig, raw: dict[str, torch.Tensor | None], tokenizer, source: str) -> CircuitModel:
    """Fold ``raw`` (unfolded weights in the module docstring's shapes) and wrap it as a ``CircuitModel``
    (``W_E [d_vocab, d]``, ``W_Q [L, H, d, d_head]``, ...); ``metadata`` says where it came from and
    what the circuit matrices leave out. Every source tensor must be finite floating point
    (checked here, before folding, so the error names the source's tensor, e.g. ``ln1_w``)."""
    for name, value in raw.items():
        if value is not None:
            check_weight(name, value, where=f"{source}")
    present = {name: value for name, value in raw.items() if value is not None}
    kinds = {(value.dtype, value.device) for value in present.values()}
    if len(kinds) > 1:
        listed = ", ".join(f"{n} {str(v.dtype).removeprefix('torch.')} on {v.device}" for n, v in present.items())
        raise ValueError(f"{source}: the source's weights mix dtypes or devices ({listed}); expected one floating "
                         "dtype on one device (e.g. model.to(torch.float32) or model.to('cuda') first)")
    dtype = next(iter(present.values())).dtype
    if dtype in (torch.float16, torch.bfloat16):  # fold in float32: one rounding of each folded weight
        raw = {k: None if v is None else v.float() for k, v in raw.items()}
    weights = {k: v.detach().to(dtype, copy=True) for k, v in fold_norms(raw, cfg).items()}
    model = CircuitModel(cfg, tokenizer=tokenizer, **weights)
    biased = any(weights.get(b) is not None for b in BIASES)
    model.metadata = {"source": source, "notes": circuit_notes(cfg, biased)}
    return model


def circuit_notes(cfg: ModelConfig, biased: bool) -> list[str]:
    """What the circuit matrices of a model with ``cfg`` (and biases, if ``biased``) leave out, one
    sentence each (``model.metadata["notes"]``)."""
    notes = []
    if biased:
        notes.append("biases (b_*) are applied in the forward; OV and QK are the weight matrices only")
    if cfg.n_kv_heads is not None:
        notes.append(f"grouped-query attention: {cfg.n_kv_heads} key/value heads shared by {cfg.n_heads} "
                     "query heads; W_K/W_V repeat the shared heads")
    if cfg.positional == "rotary":
        notes.append("rotary positions: QK is the position-free part; scores depend on relative position")
    if cfg.qk_norm:
        notes.append("QK-norm: queries and keys are normalised before the scores; QK is the circuit before "
                     "the query/key norm")
    if cfg.post_norms:
        notes.append("post-norms: each layer's attention and MLP output is normalised before it joins the "
                     "residual stream; OV is the map before that norm")
    if cfg.attn_softcap or cfg.final_softcap:
        notes.append("soft-capping: scores and/or logits pass through cap * tanh(x / cap)")
    if cfg.alibi_slopes is not None:
        notes.append("ALiBi: a per-head linear bias in the relative position is added to the scores")
    if cfg.n_experts:
        notes.append(f"mixture of experts: {cfg.n_experts} experts side by side in W_in/W_gate/W_out "
                     f"({cfg.d_mlp // cfg.n_experts} neurons each), {cfg.experts_per_token} chosen per token by W_router")
    if cfg.clip_qkv is not None:
        notes.append(f"queries, keys and values are clamped to +-{cfg.clip_qkv:g}")
    return notes
