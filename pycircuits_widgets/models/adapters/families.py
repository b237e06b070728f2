"""One declarative description per Hugging Face decoder family (``FAMILIES``).

A ``Family`` says where the weights are (module names under the causal LM), how the query, key
and value projections are laid out, which norms a layer has, and which config fields switch
``CircuitModel`` features (``features(config) -> dict``: ``ModelConfig`` fields plus the factors
``hf.py`` folds into the weights). ``refuse(config)`` names a feature the weight view does not
have. Adding a family is one entry here and one config in ``tests/family_configs.py`` (which
``tests/test_families.py`` checks against the family's own forward).

The reference for every entry is the family's forward in
``transformers/models/<family>/modeling_<family>.py`` (transformers 5.x).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# how the query/key/value projections are stored (``hf._qkv`` reads each):
#   "separate": three nn.Linear (``qkv`` names them); "concat": one nn.Linear with output blocks
#   [q | k | v] (n_heads, n_kv, n_kv heads); "per_head": output features [head, (q, k, v), d_head]
#   (GPT-NeoX, BLOOM); "conv1d": GPT-2's Conv1D [in, 3 * d]; "codegen": CodeGen's 4 model-parallel
#   shards of [q | v | k]; "falcon": [head groups, (queries..., k, v), d_head].
QKV_LAYOUTS = ("separate", "concat", "per_head", "conv1d", "codegen", "falcon")
MLP_LAYOUTS = {"gated": 3, "gate_up": 2, "plain": 2, "moe": 2}  # layout -> number of module names


@dataclass(frozen=True)
class Family:
    body: str                                   # the decoder under the causal LM
    layers: str = "layers"
    embed: str = "embed_tokens"
    final_norm: str | None = "norm"
    pos_embed: str | None = None                # learned positions (added to the stream)
    pos_offset: int = 0                         # OPT stores positions from row 2
    embed_norm: str | None = None               # BLOOM: a layer norm of the token embedding
    attn: str = "self_attn"
    qkv_layout: str = "separate"
    qkv: tuple = ("q_proj", "k_proj", "v_proj")  # names; one name for a fused layout
    o_proj: str = "o_proj"
    q_norm: str | None = None                   # QK-norm modules under ``attn``
    k_norm: str | None = None
    mlp: str = "mlp"
    mlp_layout: str = "gated"                   # MLP_LAYOUTS: "gated" (gate, up, down), "gate_up" (fused
    mlp_names: tuple = ("gate_proj", "up_proj", "down_proj")  # [gate | up], down), "plain" (in, out),
                                                # "moe" (router, experts)
    ln1: str | tuple | None = "input_layernorm"  # a tuple: alternatives, the first the layer has
    ln2: str | tuple | None = "post_attention_layernorm"  # absent: a parallel block reusing ln1
    post_attn_norm: str | None = None
    post_mlp_norm: str | None = None
    norm: str = "rmsnorm"
    norm_offset: bool = False                   # Gemma, Nemotron: the norm multiplies by (1 + w)
    interleaved_rotary: bool = False            # GPT-J layout (dims 2i, 2i+1 rotate together)
    features: Callable = field(default=lambda c: {})
    refuse: Callable = field(default=lambda c: None)

    def __post_init__(self):
        if self.qkv_layout not in QKV_LAYOUTS:
            raise ValueError(f"Family.qkv_layout must be one of {QKV_LAYOUTS}, got {self.qkv_layout!r}")
        if self.mlp_layout not in MLP_LAYOUTS:
            raise ValueError(f"Family.mlp_layout must be one of {MLP_LAYOUTS}, got {self.mlp_layout!r}")
        expected = {"separate": 3}.get(self.qkv_layout, 1)
        if len(self.qkv) != expected or len(self.mlp_names) != MLP_LAYOUTS[self.mlp_layout]:
            raise ValueError(f"Family: qkv {self.qkv} / mlp_names {self.mlp_names} do not fit the layouts "
                             f"{self.qkv_layout!r} / {self.mlp_layout!r}")


def get(config, *names, default=None):
    """The first of ``names`` that ``config`` has and is not None."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def sliding(config) -> dict:
    """Per-layer windows from ``config.layer_types`` (transformers 5.x) or one window for every layer."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return {}
    types = getattr(config, "layer_types", None)
    if types is None:
        return {"window": [int(window)] * config.num_hidden_layers}
    return {"window": [int(window) if t == "sliding_attention" else None for t in types]}


def _refuse_if(**conditions) -> str | None:
    bad = [name for name, on in conditions.items() if on]
    return ", ".join(bad) if bad else None


def alibi_slopes(n_heads: int, max_bias: float = 8.0, interleave_extra: bool = False) -> list[float]:
    """ALiBi slopes: BLOOM's rule (``interleave_extra`` False: geometric slopes of the closest power
    of two, then every other slope of the next one) or MPT's (slopes of the next power of two,
    odd ones first, truncated)."""
    if interleave_extra:  # MPT build_mpt_alibi_tensor
        n = 2 ** math.ceil(math.log2(n_heads))
        slopes = [1.0 / 2 ** ((i + 1) * max_bias / n) for i in range(n)]
        return (slopes[1::2] + slopes[::2])[:n_heads] if n != n_heads else slopes
    closest = 2 ** math.floor(math.log2(n_heads))  # BLOOM _get_alibi_slopes (float32 there)
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != n_heads:  # odd powers of the next power of two's base
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** i for i in range(1, 1 + 2 * min(closest, n_heads - closest), 2)]
    return slopes


FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        body="transformer", layers="h", embed="wte", final_norm="ln_f", pos_embed="wpe", attn="attn",
        qkv_layout="conv1d", qkv=("c_attn",), o_proj="c_proj", mlp_layout="plain", mlp_names=("c_fc", "c_proj"),
        ln1="ln_1", ln2="ln_2", norm="layernorm",
        features=lambda c: {"attn_scale": None if c.scale_attn_weights else 1.0},
        refuse=lambda c: _refuse_if(scale_attn_by_inverse_layer_idx=c.scale_attn_by_inverse_layer_idx,
                                    add_cross_attention=c.add_cross_attention),
    ),
    "gpt_neo": Family(
        body="transformer", layers="h", embed="wte", final_norm="ln_f", pos_embed="wpe", attn="attn.attention",
        o_proj="out_proj", mlp_layout="plain", mlp_names=("c_fc", "c_proj"), ln1="ln_1", ln2="ln_2",
        norm="layernorm",
        # GPT-Neo does not scale its attention scores; local layers see window_size keys
        features=lambda c: {"attn_scale": 1.0,
                            "window": [c.window_size if t == "local" else None for t in c.attention_layers]},
    ),
    "gpt_bigcode": Family(
        body="transformer", layers="h", embed="wte", final_norm="ln_f", pos_embed="wpe", attn="attn",
        qkv_layout="concat", qkv=("c_attn",), o_proj="c_proj", mlp_layout="plain", mlp_names=("c_fc", "c_proj"),
        ln1="ln_1", ln2="ln_2", norm="layernorm",
        features=lambda c: {"attn_scale": None if c.scale_attn_weights else 1.0,
                            "n_kv_heads": 1 if c.multi_query else None},
        refuse=lambda c: _refuse_if(**{"multi_query=False (per-head fused c_attn)": not c.multi_query,
                                       "add_cross_attention": c.add_cross_attention}),
    ),
    "gptj": Family(
        body="transformer", layers="h", embed="wte", final_norm="ln_f", attn="attn", o_proj="out_proj",
        mlp_layout="plain", mlp_names=("fc_in", "fc_out"), ln1="ln_1", ln2=None, norm="layernorm",
        interleaved_rotary=True,
        features=lambda c: {"rotary_dim": c.rotary_dim, "parallel_attn_mlp": True},
    ),
    "codegen": Family(
        body="transformer", layers="h", embed="wte", final_norm="ln_f", attn="attn", qkv_layout="codegen",
        qkv=("qkv_proj",), o_proj="out_proj", mlp_layout="plain", mlp_names=("fc_in", "fc_out"), ln1="ln_1",
        ln2=None, norm="layernorm", interleaved_rotary=True,
        features=lambda c: {"rotary_dim": c.rotary_dim, "parallel_attn_mlp": True},
    ),
    "gpt_neox": Family(
        body="gpt_neox", embed="embed_in", final_norm="final_layer_norm", attn="attention", qkv_layout="per_head",
        qkv=("query_key_value",), o_proj="dense", mlp_layout="plain", mlp_names=("dense_h_to_4h", "dense_4h_to_h"),
        norm="layernorm", features=lambda c: {"parallel_attn_mlp": bool(c.use_parallel_residual)},
    ),
    "opt": Family(
        body="model.decoder", final_norm="final_layer_norm", pos_embed="embed_positions", pos_offset=2,
        o_proj="out_proj", mlp="", mlp_layout="plain", mlp_names=("fc1", "fc2"), ln1="self_attn_layer_norm",
        ln2="final_layer_norm", norm="layernorm",
        refuse=lambda c: _refuse_if(**{
            "do_layer_norm_before=False (post-norm OPT)": not c.do_layer_norm_before,
            "word_embed_proj_dim != hidden_size (project_in/out)": c.word_embed_proj_dim != c.hidden_size}),
    ),
    "bloom": Family(
        body="transformer", layers="h", embed="word_embeddings", final_norm="ln_f",
        embed_norm="word_embeddings_layernorm", attn="self_attention", qkv_layout="per_head",
        qkv=("query_key_value",), o_proj="dense", mlp_layout="plain", mlp_names=("dense_h_to_4h", "dense_4h_to_h"),
        norm="layernorm",
        features=lambda c: {"alibi_slopes": alibi_slopes(c.n_head), "act_fn": "gelu_new", "n_ctx": 2048},
        refuse=lambda c: _refuse_if(apply_residual_connection_post_layernorm=c.apply_residual_connection_post_layernorm,
                                    **{"pretraining_tp > 1 with slow_but_exact": c.pretraining_tp > 1 and c.slow_but_exact}),
    ),
    "mpt": Family(
        body="transformer", layers="blocks", embed="wte", final_norm="norm_f", attn="attn", qkv_layout="concat",
        qkv=("Wqkv",), o_proj="out_proj", mlp="ffn", mlp_layout="plain", mlp_names=("up_proj", "down_proj"),
        ln1="norm_1", ln2="norm_2", norm="layernorm",
        features=lambda c: {
            "alibi_slopes": alibi_slopes(c.n_heads, c.attn_config.alibi_bias_max, interleave_extra=True),
            "attn_scale": 1 / c.attn_config.softmax_scale if c.attn_config.softmax_scale else None,
            "clip_qkv": c.attn_config.clip_qkv or None,
            "act_fn": "gelu", "n_ctx": c.max_seq_len},
        refuse=lambda c: _refuse_if(**{
            # transformers' MPT ignores qk_ln: its forward is not the checkpoint's
            "attn_config.qk_ln (which transformers' MPT does not apply)": bool(c.attn_config.qk_ln),
            "attn_config.alibi=False": not c.attn_config.alibi}),
    ),
    "falcon": Family(
        body="transformer", layers="h", embed="word_embeddings", final_norm="ln_f", attn="self_attention",
        qkv_layout="falcon", qkv=("query_key_value",), o_proj="dense", mlp_layout="plain",
        mlp_names=("dense_h_to_4h", "dense_4h_to_h"), ln1=("ln_attn", "input_layernorm"),
        ln2=("ln_mlp", "post_attention_layernorm"), norm="layernorm",
        # the new decoder architecture (Falcon 40B/180B) groups its fused QKV per key/value head and is
        # always parallel, with one or two norms
        features=lambda c: {"parallel_attn_mlp": bool(c.new_decoder_architecture or c.parallel_attn),
                            "act_fn": get(c, "activation", default="gelu"),
                            "n_kv_heads": 1 if c.multi_query and not c.new_decoder_architecture else None},
        refuse=lambda c: _refuse_if(**{"alibi (Falcon rounds its ALiBi to bfloat16)": c.alibi}),
    ),
    "llama": Family(body="model"),
    "mistral": Family(body="model", features=sliding),
    "qwen2": Family(body="model", features=sliding),
    "starcoder2": Family(
        body="model", mlp_layout="plain", mlp_names=("c_fc", "c_proj"), norm="layernorm", features=sliding),
    "mixtral": Family(body="model", mlp_layout="moe", mlp_names=("gate", "experts"),
                      features=lambda c: {"n_experts": c.num_local_experts,
                                          "experts_per_token": c.num_experts_per_tok}),
    "qwen3": Family(body="model", q_norm="q_norm", k_norm="k_norm",
                    features=lambda c: {"qk_norm": "rmsnorm", **sliding(c)}),
    "gemma": Family(body="model", norm_offset=True,
                    features=lambda c: {"embed_scale": c.hidden_size ** 0.5,
                                        "act_fn": get(c, "hidden_activation", "hidden_act")}),
    "gemma2": Family(
        body="model", norm_offset=True, post_attn_norm="post_attention_layernorm", ln2="pre_feedforward_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
        features=lambda c: {"embed_scale": c.hidden_size ** 0.5, "act_fn": c.hidden_activation,
                            "attn_scale": c.query_pre_attn_scalar ** 0.5, "attn_softcap": c.attn_logit_softcapping,
                            "final_softcap": c.final_logit_softcapping, "post_norms": True, **sliding(c)}),
    "gemma3_text": Family(
        body="model", norm_offset=True, post_attn_norm="post_attention_layernorm", ln2="pre_feedforward_layernorm",
        post_mlp_norm="post_feedforward_layernorm", q_norm="q_norm", k_norm="k_norm",
        features=lambda c: {"embed_scale": c.hidden_size ** 0.5, "act_fn": c.hidden_activation,
                            "attn_scale": c.query_pre_attn_scalar ** 0.5, "attn_softcap": c.attn_logit_softcapping,
                            "final_softcap": c.final_logit_softcapping, "post_norms": True, "qk_norm": "rmsnorm",
                            **sliding(c)}),
    "phi": Family(
        body="model", o_proj="dense", mlp_layout="plain", mlp_names=("fc1", "fc2"), ln2=None,
        final_norm="final_layernorm", norm="layernorm", q_norm="q_layernorm", k_norm="k_layernorm",
        features=lambda c: {"parallel_attn_mlp": True, "qk_norm": "layernorm" if c.qk_layernorm else None},
    ),
    "phi3": Family(body="model", qkv_layout="concat", qkv=("qkv_proj",), mlp_layout="gate_up",
                   mlp_names=("gate_up_proj", "down_proj"), features=sliding),
    "olmo": Family(body="model", norm="layernorm", features=lambda c: {"clip_qkv": c.clip_qkv}),
    "olmo2": Family(body="model", ln1=None, ln2=None, post_attn_norm="post_attention_layernorm",
                    post_mlp_norm="post_feedforward_layernorm", q_norm="q_norm", k_norm="k_norm",
                    features=lambda c: {"pre_norm": False, "post_norms": True, "qk_norm": "rmsnorm",
                                        "qk_norm_heads": False}),
    "olmo3": Family(body="model", ln1=None, ln2=None, post_attn_norm="post_attention_layernorm",
                    post_mlp_norm="post_feedforward_layernorm", q_norm="q_norm", k_norm="k_norm",
                    features=lambda c: {"pre_norm": False, "post_norms": True, "qk_norm": "rmsnorm",
                                        "qk_norm_heads": False, **sliding(c)}),
    "stablelm": Family(
        body="model", norm="layernorm", q_norm="q_layernorm", k_norm="k_layernorm",
        features=lambda c: {"parallel_attn_mlp": bool(c.use_parallel_residual),
                            "qk_norm": "layernorm" if c.qk_layernorm else None}),
    "cohere": Family(body="model", ln2=None, norm="layernorm", interleaved_rotary=True, q_norm="q_norm",
                     k_norm="k_norm",
                     features=lambda c: {"parallel_attn_mlp": True, "logit_scale": c.logit_scale,
                                         "qk_norm": "layernorm" if c.use_qk_norm else None}),
    "granite": Family(body="model", features=lambda c: {
        "embed_scale": c.embedding_multiplier, "residual_scale": c.residual_multiplier,
        "logit_scale": 1 / c.logits_scaling, "attn_scale": 1 / c.attention_multiplier}),
    "smollm3": Family(body="model", features=lambda c: {
        "rotary_layers": [bool(r) for r in c.no_rope_layers], **sliding(c)}),
    "glm": Family(body="model", mlp_layout="gate_up", mlp_names=("gate_up_proj", "down_proj"),
                  interleaved_rotary=True),
    "nemotron": Family(body="model", norm="layernorm", norm_offset=True, mlp_layout="plain",
                       mlp_names=("up_proj", "down_proj")),
    "exaone4": Family(body="model", ln1=None, ln2=None, post_attn_norm="post_attention_layernorm",
                      post_mlp_norm="post_feedforward_layernorm", q_norm="q_norm", k_norm="k_norm",
                      features=lambda c: {
                          "pre_norm": False, "post_norms": True, "qk_norm": "rmsnorm", **sliding(c),
                          # hybrid models rotate only their sliding layers (global NoPE)
                          **({"rotary_layers": [t == "sliding_attention" for t in c.layer_types]}
                             if c.sliding_window is not None else {})}),
}
