"""from_transformer_lens on TransformerLens 4.x native models (``TransformerBridge.boot_native``),
and the adapters' shared pieces (rotary layout reordering, K/V expansion, norm folding).

Oracles: TransformerLens's own logits and ``hook_pattern`` on identical weights; dense math.
TransformerLens 2.x ``HookedTransformer`` is not installable next to 4.x and is not tested here.
"""

import dataclasses

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformer_lens import TransformerBridge
from transformer_lens.config import TransformerBridgeConfig

import pycircuits_widgets as pcw
from pycircuits_widgets.models.adapters.weight_view import adjacent_pairs_to_halves, expand_kv_heads
from tolerance import assert_within, logit_tol, pattern_tol, product_tol, reduction_tol

WEIGHT_NAMES = ("W_E", "W_U", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out", "b_in", "b_out")
SHAPE = {"d_model": 32, "d_head": 8, "n_layers": 2, "n_ctx": 16, "n_heads": 4, "d_vocab": 50}
CASES = {
    "layernorm_learned_positions": {"act_fn": "gelu", "normalization_type": "LN"},
    "rmsnorm_rotary_gqa_gated": {"act_fn": "silu", "normalization_type": "RMS", "positional_embedding_type": "rotary",
                                     "n_key_value_heads": 2, "gated_mlp": True, "final_rms": True, "rotary_dim": 4},
    "layernorm_rotary_gelu_new": {"act_fn": "gelu_new", "normalization_type": "LN", "positional_embedding_type": "rotary"},
    "attn_only_lnpre": {"normalization_type": "LNPre", "attn_only": True},
}


WORDS = ["<unk>"] + [f"w{i}" for i in range(SHAPE["d_vocab"] - 1)]


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the model's 50 ids ("w0" ... "w48"), built here, no download."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def native_bridge(seed: int = 0, **options) -> TransformerBridge:
    """A TL-native model with every parameter random (norm scales around 1, biases nonzero)."""
    config = TransformerBridgeConfig(**SHAPE, seed=seed, **options)
    bridge = TransformerBridge.boot_native(config, tokenizer=word_tokenizer())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bridge.original_model.named_parameters():
            is_scale = ".ln" in name and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if is_scale else 0.3) + (1.0 if is_scale else 0.0))
    return bridge


@pytest.fixture(scope="module", params=sorted(CASES))
def adapted(request):
    bridge = native_bridge(**CASES[request.param])
    return request.param, bridge, pcw.from_transformer_lens(bridge)


def assert_same_logits(model, tokens, reference) -> None:
    """Our float32 logits and the reference's agree within two float32 forwards' rounding
    (``tolerance.logit_tol``: reduction lengths of the forward, sizes of the unembedding's sums)."""
    ours, cache = model.run_with_cache(tokens)
    assert_within(ours, reference, logit_tol(model, cache, tokens.shape[1]))


def test_logits_and_patterns_match_transformer_lens(adapted):
    _name, bridge, model = adapted
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_logits, ref_cache = bridge.run_with_cache(tokens)
    ref_patterns = torch.stack([ref_cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(2)], 1)
    out = pcw.run(model, tokens)
    assert_same_logits(model, tokens, ref_logits)
    assert_within(out.patterns, ref_patterns, pattern_tol(model.cfg, tokens.shape[1], ref_patterns))
    assert out.patterns.shape == (2, 2, 4, 12, 12)
    assert out.str_tokens[0] == [WORDS[i] for i in tokens[0].tolist()]  # bridge.tokenizer is the default


def test_run_on_text_uses_the_bridges_tokenizer(adapted):
    _name, bridge, model = adapted
    out = pcw.run(model, "w3 w1 w4 w1 w5")
    assert out.str_tokens == [["w3", "w1", "w4", "w1", "w5"]]
    with torch.no_grad():
        theirs = bridge(out.tokens)
    assert_within(out.logits, theirs, logit_tol(model, out.cache, out.tokens.shape[1]))


def test_config_metadata(adapted):
    name, _bridge, model = adapted
    cfg = model.cfg
    assert cfg.n_kv_heads == (2 if "gqa" in name else None)
    assert cfg.positional == ("rotary" if "rotary" in name else "learned")
    assert cfg.attn_only == ("attn_only" in name)
    assert cfg.normalization == ("rmsnorm" if "rmsnorm" in name else "layernorm")
    if "gqa" in name:
        assert cfg.rotary_dim == 4 and cfg.gated_mlp and model.W_gate.shape == (2, 32, 128)


def test_folded_circuits_equal_dense_math_on_tl_weights():
    """For each head: ``OV = diag(w1) W_V W_O`` and ``QK = diag(w1) W_Q W_K^T diag(w1)`` from TL's
    own (unexpanded, adjacent-pair) weights; the rotary reordering leaves QK unchanged."""
    bridge = native_bridge(seed=2, **CASES["rmsnorm_rotary_gqa_gated"])
    model = pcw.from_transformer_lens(bridge)
    with torch.no_grad():
        W_Q, W_K, W_V, W_O = bridge.W_Q, bridge.W_K, bridge.W_V, bridge.W_O
        for layer in range(2):
            w = bridge.blocks[layer].ln1._original_component.weight
            for h in range(4):
                g = h // 2  # GQA: query heads 2g, 2g + 1 read key/value head g
                qk = torch.diag(w) @ W_Q[layer, h] @ W_K[layer, g].T @ torch.diag(w)
                ov = torch.diag(w) @ W_V[layer, g] @ W_O[layer, h]
                qk_factors = (torch.diag(w), W_Q[layer, h], W_K[layer, g].T, torch.diag(w))
                assert_within(model.QK[layer, h].AB, qk, product_tol(*qk_factors))
                assert_within(model.OV[layer, h].AB, ov, product_tol(torch.diag(w), W_V[layer, g], W_O[layer, h]))


def test_adjacent_pair_rotation_equals_rotate_half_after_reordering():
    """GPT-J layout (pairs 2i, 2i+1) on x == GPT-NeoX rotate_half layout (i, i + r/2) on the reordered x,
    up to the same reordering; dims past rotary_dim are untouched."""
    r, d_head, pos = 6, 8, 5
    x = torch.randn(pos, d_head, generator=torch.Generator().manual_seed(0))
    angle = torch.arange(pos)[:, None] * 10000.0 ** (-torch.arange(0, r, 2) / r)
    cos, sin = angle.cos(), angle.sin()
    adjacent = x.clone()
    adjacent[:, 0:r:2] = x[:, 0:r:2] * cos - x[:, 1:r:2] * sin
    adjacent[:, 1:r:2] = x[:, 1:r:2] * cos + x[:, 0:r:2] * sin
    y = adjacent_pairs_to_halves(x, r)
    half = y.clone()
    half[:, : r // 2] = y[:, : r // 2] * cos - y[:, r // 2:r] * sin
    half[:, r // 2:r] = y[:, r // 2:r] * cos + y[:, : r // 2] * sin
    torch.testing.assert_close(half, adjacent_pairs_to_halves(adjacent, r))
    torch.testing.assert_close(y[:, r:], x[:, r:], atol=0, rtol=0)


def test_expand_kv_heads_groups_consecutive_query_heads():
    W = torch.arange(2 * 3).reshape(1, 3, 2)  # [L, n_kv_heads, ...]
    assert expand_kv_heads(W, 6)[0, :, 0].tolist() == [0, 0, 2, 2, 4, 4]
    assert expand_kv_heads(W, 3) is W
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        expand_kv_heads(W, 4)


def test_layer_norm_bias_in_front_of_a_gated_mlp_folds_into_both_biases():
    """``act((x̂ w + b) W_gate) * ((x̂ w + b) W_in)``: ``b`` becomes ``b_gate = b W_gate`` and part of
    ``b_in``; the weight view then matches TransformerLens's forward."""
    bridge = native_bridge(act_fn="silu", normalization_type="LN", gated_mlp=True)
    model = pcw.from_transformer_lens(bridge)
    assert model.b_gate is not None
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(model, tokens, bridge(tokens))


@pytest.mark.parametrize("options, message", [
    ({"normalization_type": "LN", "final_rms": True}, "final_rms"),
    ({"attn_scores_soft_cap": 30.0}, "attn_scores_soft_cap"),
])
def test_unsupported_tl_configs_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        pcw.from_transformer_lens(native_bridge(**options))


def test_non_transformer_lens_input_is_refused():
    with pytest.raises(TypeError, match="TransformerBridge or HookedTransformer"):
        pcw.from_transformer_lens(torch.nn.Linear(2, 2))


def llama_bridge(seed: int, gate_bias: bool) -> TransformerBridge:
    """TransformerLens 4.x bridge around a local Hugging Face LLaMA whose MLP has a nonzero ``b_in``
    (``up_proj.bias``) and, with ``gate_bias``, a nonzero gate bias (TL-native gated MLPs have neither)."""
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    config = transformers.LlamaConfig(vocab_size=50, max_position_embeddings=16, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                      mlp_bias=True)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            is_scale = "norm" in name and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if is_scale else 0.3) + (1.0 if is_scale else 0.0))
    if not gate_bias:
        for layer in hf.model.layers:
            layer.mlp.gate_proj.bias = None
    return build_bridge_from_module(hf.eval(), "LlamaForCausalLM", hf_config=config)


def test_gated_mlp_b_in_sits_where_the_bridge_puts_it():
    """TL 4.x bridge: ``act(x W_gate) * (x W_in + b_in)``; logits equal TL's own with a nonzero b_in, and
    adding b_in after the product instead (2.x ``GatedMLP``'s place) would be far off."""
    bridge = llama_bridge(seed=3, gate_bias=False)
    model = pcw.from_transformer_lens(bridge)
    assert model.b_in.abs().mean() > 0.1 and not model.cfg.b_in_outside_gate
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = bridge(tokens)
    assert_same_logits(model, tokens, ref)
    outside = pcw.models.CircuitModel(dataclasses.replace(model.cfg, b_in_outside_gate=True),
                                      **{name: getattr(model, name) for name in WEIGHT_NAMES})
    assert (outside(tokens) - ref).abs().max() > 0.1


def test_b_in_outside_gate_is_transformer_lens_2_gated_mlp():
    """2.x ``GatedMLP.forward``: ``post = act(x @ W_gate) * (x @ W_in) + b_in; out = post @ W_out + b_out``,
    written out densely on one layer's normalised input."""
    bridge = llama_bridge(seed=4, gate_bias=False)
    model = pcw.from_transformer_lens(bridge)
    tl2 = pcw.models.CircuitModel(dataclasses.replace(model.cfg, b_in_outside_gate=True),
                                  **{name: getattr(model, name) for name in WEIGHT_NAMES})
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(0))
    xn = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + model.cfg.eps)
    post = torch.nn.functional.silu(xn @ model.W_gate[1]) * (xn @ model.W_in[1]) + model.b_in[1]
    expected = post @ model.W_out[1] + (0 if model.b_out is None else model.b_out[1])
    # both float32: the norm (d_model terms), then W_in or W_gate (d_model), then W_out (d_mlp)
    magnitude = torch.nn.functional.silu(xn @ model.W_gate[1]).abs() * ((xn @ model.W_in[1]).abs() + model.b_in[1].abs())
    tol = reduction_tol(2 * xn.shape[-1] + model.W_out.shape[1], 1.0, computations=2) * (magnitude @ model.W_out[1].abs())
    assert_within(tl2._mlp(1, x)[0], expected, tol.detach())


def test_a_bridge_around_a_hugging_face_model_is_translated_from_that_model_gate_bias_included():
    """The bridge wraps a Hugging Face LLaMA with ``mlp_bias``: ``from_hf`` reads it (gate bias
    kept, ``b_gate``), and the result matches the bridge's own forward."""
    bridge = llama_bridge(seed=5, gate_bias=True)
    model = pcw.from_transformer_lens(bridge)
    assert model.metadata["source"] == "transformer_lens:TransformerBridge(hf:llama)"
    assert model.b_gate is not None and bool((model.b_gate != 0).any())
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(model, tokens, bridge(tokens))
