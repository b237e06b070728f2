"""Tiny random-weight Hugging Face models of every decoder family (2 layers, d_model 64, 4 heads,
vocab 128), built from configs with eager attention: no download.

``CONFIGS[name]`` is ``(model_type, config kwargs)``; variants exercise a family's features
(rope types, sliding windows, QK-norm, parallel blocks). ``tiny_model(name)`` randomises every
parameter (norm scales around 1, biases nonzero) so that folding is exercised.
Run ``python tests/family_configs.py`` for the table of errors against Hugging Face's forward.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers

D_VOCAB, N_TOKENS = 128, 24
LLAMA_LIKE = {"vocab_size": D_VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 64, "pad_token_id": 0,
                  "bos_token_id": None, "eos_token_id": None}
WINDOW = {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]}
ROPE = "rope_parameters"


def _rope(rope_type: str, **params) -> dict:
    return {ROPE: {"rope_type": rope_type, "rope_theta": 10000.0, **params}}


CONFIGS: dict[str, tuple[str, dict]] = {
    "gpt2": ("gpt2", {"vocab_size": D_VOCAB, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}),
    "gpt_neo": ("gpt_neo", {"vocab_size": D_VOCAB, "max_position_embeddings": 64, "hidden_size": 64, "num_layers": 2,
                                "num_heads": 4, "attention_types": [[["global", "local"], 1]], "window_size": 5,
                                "intermediate_size": 96}),
    "gpt_bigcode": ("gpt_bigcode", {"vocab_size": D_VOCAB, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                        "multi_query": True}),
    "gptj": ("gptj", {"vocab_size": D_VOCAB, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8}),
    "codegen": ("codegen", {"vocab_size": D_VOCAB, "n_positions": 64, "n_ctx": 64, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                "rotary_dim": 8}),
    "gpt_neox": ("gpt_neox", {"vocab_size": D_VOCAB, "max_position_embeddings": 64, "hidden_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
                                  "rotary_pct": 0.25, "use_parallel_residual": True}),
    "opt": ("opt", {"vocab_size": D_VOCAB, "max_position_embeddings": 64, "hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "ffn_dim": 96, "word_embed_proj_dim": 64}),
    "bloom": ("bloom", {"vocab_size": D_VOCAB, "hidden_size": 64, "n_layer": 2, "n_head": 4}),
    "mpt": ("mpt", {"vocab_size": D_VOCAB, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "expansion_ratio": 2,
                        "attn_config": {"clip_qkv": 2.0}}),
    "falcon": ("falcon", {"vocab_size": D_VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "max_position_embeddings": 64, "bias": True}),
    "falcon_new_architecture": ("falcon", {"vocab_size": D_VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
                                               "num_attention_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 64,
                                               "new_decoder_architecture": True}),
    "falcon_sequential": ("falcon", {"vocab_size": D_VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
                                         "num_attention_heads": 4, "max_position_embeddings": 64, "multi_query": False,
                                         "parallel_attn": False, "bias": True}),
    "llama": ("llama", dict(LLAMA_LIKE, attention_bias=True, mlp_bias=True)),
    "llama_linear": ("llama", dict(LLAMA_LIKE, **_rope("linear", factor=2.0))),
    "llama_dynamic": ("llama", dict(LLAMA_LIKE, max_position_embeddings=16, **_rope("dynamic", factor=2.0))),
    "llama_yarn": ("llama", dict(LLAMA_LIKE, **_rope("yarn", factor=4.0, original_max_position_embeddings=16))),
    "llama_llama3": ("llama", dict(LLAMA_LIKE, **_rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=8))),
    "llama_longrope": ("llama", dict(LLAMA_LIKE, **_rope("longrope", short_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0],
                                                         long_factor=[2.0] * 8, original_max_position_embeddings=16))),
    "mistral": ("mistral", dict(LLAMA_LIKE, sliding_window=5)),
    "starcoder2": ("starcoder2", dict(LLAMA_LIKE, sliding_window=5, use_bias=True)),
    "mixtral": ("mixtral", dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("qwen2", dict(LLAMA_LIKE, use_sliding_window=True, max_window_layers=1, sliding_window=5)),
    "qwen3": ("qwen3", dict(LLAMA_LIKE, head_dim=16)),
    "gemma": ("gemma", dict(LLAMA_LIKE, head_dim=16)),
    "gemma2": ("gemma2", dict(LLAMA_LIKE, head_dim=16, query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                              attn_logit_softcapping=5.0, **WINDOW)),
    "gemma3_text": ("gemma3_text", dict(LLAMA_LIKE, head_dim=16, query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1e6}}, **WINDOW)),
    "phi": ("phi", {"vocab_size": D_VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "intermediate_size": 96, "max_position_embeddings": 64, "partial_rotary_factor": 0.5,
                        "qk_layernorm": True}),
    "phi3": ("phi3", dict(LLAMA_LIKE, sliding_window=5, partial_rotary_factor=0.5)),
    "olmo": ("olmo", dict(LLAMA_LIKE, clip_qkv=1.5)),
    "olmo2": ("olmo2", dict(LLAMA_LIKE)),
    "olmo3": ("olmo3", dict(LLAMA_LIKE, **WINDOW)),
    "stablelm": ("stablelm", dict(LLAMA_LIKE, partial_rotary_factor=0.25, use_qkv_bias=True, qk_layernorm=True,
                                  use_parallel_residual=True)),
    "cohere": ("cohere", dict(LLAMA_LIKE, use_qk_norm=True, logit_scale=0.5)),
    "granite": ("granite", dict(LLAMA_LIKE, embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=4.0,
                                attention_multiplier=0.3)),
    "smollm3": ("smollm3", dict(LLAMA_LIKE, no_rope_layers=[1, 0], use_sliding_window=False)),
    "glm": ("glm", dict(LLAMA_LIKE, head_dim=16, partial_rotary_factor=0.5)),
    "nemotron": ("nemotron", dict(LLAMA_LIKE, partial_rotary_factor=0.5, norm_eps=1e-5)),
    "exaone4": ("exaone4", dict(LLAMA_LIKE, sliding_window=5, sliding_window_pattern=2,
                                layer_types=["sliding_attention", "full_attention"])),
}
REFUSED: dict[str, str] = {}  # every family here is translated exactly


def tiny_model(name: str, seed: int = 0, dtype=torch.float32, **overrides):
    """``name``'s model (``overrides``: config fields replacing the table's), every parameter random."""
    model_type, kwargs = CONFIGS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            is_scale = ("norm" in pname or ".ln" in pname) and pname.endswith("weight")
            offset = 0.0 if (is_scale and model_type in ("gemma", "gemma2", "gemma3_text", "nemotron")) else 1.0
            noise = torch.randn(p.shape, generator=gen) * (0.2 if is_scale else 0.3)
            p.copy_(noise + (offset if is_scale else 0.0))
    return model.eval()


def reference(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's own (logits, patterns ``[b, L, H, n, n]``) on ``tokens``."""
    with torch.no_grad():
        out = model(tokens, output_attentions=True)
    return out.logits, torch.stack(out.attentions, 1)


def probe_tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, D_VOCAB, (2, N_TOKENS), generator=torch.Generator().manual_seed(seed))


def table(names=None, verify=True):
    """(variant, "exact" / "refused: ..." / "WRONG", logit error / max|logit|, pattern error) per variant;
    "exact": within two float32 forwards' rounding bounds (``tolerance.logit_tol``, ``pattern_tol``)."""
    import pycircuits_widgets as pcw
    tokens = probe_tokens()
    for name in names or CONFIGS:
        hf = tiny_model(name)
        try:
            model = pcw.from_hf(hf, verify=verify)
        except Exception as err:  # noqa: BLE001 - the table reports every outcome
            yield name, f"refused: {type(err).__name__}: {err}", None, None
            continue
        rel, perr = errors(hf, model, tokens)
        yield name, "exact" if within_rounding(hf, model, tokens) else "WRONG", rel, perr


def within_rounding(hf, model, tokens) -> bool:
    """Whether ``model``'s logits and patterns are within float32 rounding of ``hf``'s on ``tokens``."""
    from tolerance import logit_tol, pattern_tol
    logits, patterns = reference(hf, tokens)
    ours, cache = model.run_with_cache(tokens)
    return (float((ours - logits).abs().max()) <= logit_tol(model, cache, tokens.shape[1])
            and float((cache.patterns - patterns).abs().max()) <= pattern_tol(model.cfg, tokens.shape[1], patterns))


def errors(hf, model, tokens) -> tuple[float, float]:
    """(max logit error / max|logit|, max pattern error) of ``model`` against ``hf`` on ``tokens``."""
    logits, patterns = reference(hf, tokens)
    ours, cache = model.run_with_cache(tokens)
    return float((ours - logits).abs().max() / logits.abs().max()), float((cache.patterns - patterns).abs().max())


if __name__ == "__main__":
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's package
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {N_TOKENS} tokens, float32, eager")
    print("| variant | result | max logit error / max abs logit | max pattern error |\n|---|---|---|---|")
    for name, result, rel, perr in table(sys.argv[1:] or None, verify="--no-verify" not in sys.argv):
        fmt = (lambda v: "-" if v is None else f"{v:.1e}")
        print(f"| {name} | {result} | {fmt(rel)} | {fmt(perr)} |", flush=True)
