"""from_hf on tiny Hugging Face models built locally from configs (random init, fixed seed, no hub).

Oracles: the Hugging Face model's own logits, attention probabilities (eager attention,
``output_attentions=True``) and loss on identical weights; dense folding math on its raw weights.
"""

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import pycircuits_widgets as pcw
from pycircuits_widgets.models.tokenizer import visible_whitespace
from tolerance import assert_within, centred_mean_tol, logit_tol, pattern_tol, product_tol

D_VOCAB = 320
TEXT = "def add(a, b):\n    return a + b\n"
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=D_VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        vocab_size=D_VOCAB, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, rotary_pct=0.5, attention_bias=True, use_parallel_residual=True),
    "gpt_neox_sequential": lambda: transformers.GPTNeoXConfig(
        vocab_size=D_VOCAB, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, rotary_pct=0.25, use_parallel_residual=False, hidden_act="gelu_new"),
    "llama_gqa_tied": lambda: transformers.LlamaConfig(
        vocab_size=D_VOCAB, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, tie_word_embeddings=True, rms_norm_eps=1e-6),
    "llama_mha_bias": lambda: transformers.LlamaConfig(
        vocab_size=D_VOCAB, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, tie_word_embeddings=False, attention_bias=True),
    # linear RoPE scaling, spelled as every transformers release in range accepts it (4.40 knows only "type")
    "llama_linear_rope": lambda: transformers.LlamaConfig(
        vocab_size=D_VOCAB, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, rope_scaling={"type": "linear", "factor": 2.0}),
    "gpt_neox_linear_rope": lambda: transformers.GPTNeoXConfig(
        vocab_size=D_VOCAB, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, rotary_pct=0.5, rope_scaling={"type": "linear", "factor": 3.0}),
}
PARTIAL_ROTARY = {"gpt_neox": 0.5, "gpt_neox_sequential": 0.25, "gpt_neox_linear_rope": 0.5}
ROPE_SCALE = {"llama_linear_rope": 2.0, "gpt_neox_linear_rope": 3.0}


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random (norm scales around 1), so folding of scales and biases is exercised:
    Hugging Face initialises norms to weight 1, bias 0, and linear biases to 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_scale = ("norm" in name or ".ln_" in name) and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if is_scale else 0.3) + (1.0 if is_scale else 0.0))
    return model.eval()


def float64_pair(config, seed: int):
    """``(hf, pcw.from_hf(hf))``: a random float64 Hugging Face model built from ``config`` (eager
    attention, every parameter random) and its weight view."""
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"), seed).double()
    return hf, pcw.from_hf(hf)


def tiny_model(kind: str, seed: int = 0):
    config = CONFIGS[kind]()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return randomize(model, seed)


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer trained here on a few lines, wrapped like a hub tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=D_VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 3, "import os\nprint('héllo wörld')\n"], trainer=trainer)
    assert tok.get_vocab_size() <= D_VOCAB
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def adapted(request):
    model = tiny_model(request.param)
    return request.param, model, pcw.from_hf(model)


def test_logits_and_patterns_match_the_hf_model(adapted):
    _kind, hf, model = adapted
    tokens = torch.randint(0, D_VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(tokens, output_attentions=True)
    logits, cache = model.run_with_cache(tokens)
    # two float32 forwards: tolerance.logit_tol and pattern_tol of this run
    assert_within(logits, out.logits, logit_tol(model, cache, tokens.shape[1]))
    patterns = torch.stack(out.attentions, 1)
    assert_within(cache.patterns, patterns, pattern_tol(model.cfg, tokens.shape[1], patterns))
    assert cache.patterns.shape == (2, 2, 4, 24, 24)


def test_config_records_what_analyses_must_refuse_or_note(adapted):
    kind, hf, model = adapted
    cfg = model.cfg
    assert not cfg.attn_only and cfg.d_mlp == hf.config.to_dict().get("intermediate_size", 4 * 32)
    if kind == "gpt2":
        assert (cfg.positional, cfg.normalization, cfg.act_fn) == ("learned", "layernorm", "gelu_new")
        assert model.W_pos.shape == (32, 32)
        with pytest.raises(ValueError, match="offset only applies to rotary models"):
            pcw.eigenvalue_positivity(model, "QK", offset=1)
    else:
        assert cfg.positional == "rotary" and model.W_pos is None
        assert pcw.eigenvalue_positivity(model, "QK", offset=1).shape == (2, 4)  # read at a query - key offset
    if kind.startswith("gpt_neox"):
        assert cfg.rotary_dim == int(8 * PARTIAL_ROTARY[kind])
        assert cfg.parallel_attn_mlp == hf.config.use_parallel_residual
    if kind.startswith("llama"):
        expected = ("rmsnorm", True, "silu", hf.config.rms_norm_eps)
        assert (cfg.normalization, cfg.gated_mlp, cfg.act_fn, cfg.eps) == expected
    assert cfg.n_kv_heads == (2 if kind == "llama_gqa_tied" else None)
    assert cfg.rotary_scale == ROPE_SCALE.get(kind, 1.0)


def test_layer_norm_folding_centers_writers_and_keeps_logits(adapted):
    """Layer norm models: every weight writing the residual stream writes mean-zero vectors (so
    the norm's centering is the identity); RMSNorm models are not centered (RMSNorm does not center)."""
    kind, hf, model = adapted
    writers = [model.W_E, model.W_O, model.b_O, model.W_out]
    if kind == "gpt2":
        writers.append(model.W_pos)
    means = [w.mean(-1).abs().max().item() for w in writers if w is not None]
    if model.cfg.normalization == "layernorm":
        # centred in float32: centred_mean_tol of a row as large as the largest raw parameter
        largest = max(float(p.detach().abs().max()) for p in hf.parameters())
        assert max(means) <= float(centred_mean_tol(torch.full((model.cfg.d_model,), largest)))
    else:
        torch.testing.assert_close(model.W_E, hf.get_input_embeddings().weight, atol=0, rtol=0)


def test_llama_folded_circuits_equal_dense_math_on_raw_weights():
    """QK and OV of a GQA head vs the dense product of HF's raw weights with the RMSNorm scale:
    ``QK = diag(w) Wq_h Wk_g^T diag(w)``, ``OV = diag(w) Wv_g Wo_h`` with ``g = h // 2``."""
    hf = tiny_model("llama_gqa_tied", seed=3)
    model = pcw.from_hf(hf)
    layer, dh = 1, 8
    attn, w = hf.model.layers[layer].self_attn, hf.model.layers[layer].input_layernorm.weight.detach()
    for h in range(4):
        g = h // 2
        Wq = attn.q_proj.weight[h * dh:(h + 1) * dh].T.detach()
        Wk = attn.k_proj.weight[g * dh:(g + 1) * dh].T.detach()
        Wv = attn.v_proj.weight[g * dh:(g + 1) * dh].T.detach()
        Wo = attn.o_proj.weight[:, h * dh:(h + 1) * dh].T.detach()
        qk = torch.diag(w) @ Wq @ Wk.T @ torch.diag(w)
        ov = torch.diag(w) @ Wv @ Wo
        assert_within(model.QK[layer, h].AB, qk, product_tol(torch.diag(w), Wq, Wk.T, torch.diag(w)))
        assert_within(model.OV[layer, h].AB, ov, product_tol(torch.diag(w), Wv, Wo))
    # heads 0 and 1 share key/value head 0, heads 2 and 3 share head 1
    torch.testing.assert_close(model.W_K[:, 0], model.W_K[:, 1], atol=0, rtol=0)
    assert not torch.allclose(model.W_K[:, 1], model.W_K[:, 2])


def test_tied_embeddings_give_an_unembedding_from_the_embedding():
    hf = tiny_model("llama_gqa_tied", seed=4)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    model = pcw.from_hf(hf)
    expected = hf.model.norm.weight.detach()[:, None] * hf.model.embed_tokens.weight.detach().T
    torch.testing.assert_close(model.W_U, expected, atol=0, rtol=0)


def test_gpt2_biases_are_exposed_and_folded():
    """b_Q = ln_1.bias @ W_Q + c_attn bias (the norm's bias folds into the reader's bias)."""
    hf = tiny_model("gpt2", seed=5)
    model = pcw.from_hf(hf)
    block = hf.transformer.h[0]
    Wq, bq = block.attn.c_attn.weight[:, :32].detach(), block.attn.c_attn.bias[:32].detach()
    expected = (block.ln_1.bias.detach() @ Wq + bq).reshape(4, 8)
    # the bias added as one more term of the reduction: [ln_1.bias, 1] @ [[W_Q], [b_Q]]
    affine = product_tol(torch.cat([block.ln_1.bias.detach(), torch.ones(1)])[None], torch.cat([Wq, bq[None]]))
    assert_within(model.b_Q[0], expected, affine.reshape(4, 8))
    # GPT-2's lm_head has no bias; the final norm's bias becomes one: b_U = ln_f.bias @ W_U
    ln_f, W_U = hf.transformer.ln_f.bias.detach(), hf.lm_head.weight.detach().T
    assert_within(model.b_U, ln_f @ W_U, product_tol(ln_f[None], W_U)[0])
    assert any("biases" in note for note in model.metadata["notes"])


def test_run_on_text_matches_hf_loss_and_token_strings(tokenizer):
    hf = tiny_model("gpt2", seed=6)
    model = pcw.from_hf(hf, tokenizer)
    out = pcw.run(model, TEXT)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        hf_out = hf(ids, labels=ids, output_attentions=True)
    torch.testing.assert_close(out.tokens, ids)
    # a log-softmax moves by at most twice its inputs' largest change: the loss within 2 x logit_tol
    _, cache = model.run_with_cache(ids)
    assert_within(out.loss, hf_out.loss, 2 * logit_tol(model, cache, ids.shape[1]))
    patterns = torch.stack(hf_out.attentions, 1)
    assert_within(out.patterns, patterns, pattern_tol(model.cfg, ids.shape[1], patterns))
    assert "".join(out.str_tokens[0]) == visible_whitespace(TEXT)


def test_display_strings_show_partial_utf8_bytes_and_special_tokens(tokenizer):
    model = pcw.from_hf(tiny_model("gpt2"), tokenizer)
    strings = model.token_strings
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert strings[eos] == "<|endoftext|>"
    assert strings[tokenizer.convert_tokens_to_ids("\u00c3")] == "\\xc3"  # byte 0xC3 alone: not valid UTF-8
    assert strings[tokenizer.convert_tokens_to_ids("\u010a")] == "↵"  # byte-level "Ċ" is a newline


@pytest.mark.parametrize("kind, change, message", [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("llama_mha_bias", {"rope_scaling": {"type": "proportional", "factor": 2.0}},
     (r"rope_type 'proportional' is not supported; supported: \('default', 'linear', 'dynamic', 'yarn', "
     r"'longrope', 'llama3'\)$")),
])
def test_unsupported_features_are_refused(kind, change, message):
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), attn_implementation="eager")
    for key, value in change.items():  # after building: transformers 5.x cannot build a model with some of these
        setattr(hf.config, key, value)
    with pytest.raises(ValueError, match=message):
        pcw.from_hf(hf)


def test_linear_rope_scaling_changes_the_patterns_it_is_checked_on():
    """The scaled-RoPE cases above can fail: the same weights read with factor 1 give other patterns."""
    hf = tiny_model("llama_linear_rope")
    model = pcw.from_hf(hf)
    unscaled = pcw.models.CircuitModel(dataclasses.replace(model.cfg, rotary_scale=1.0),
                                       **{k: getattr(model, k) for k in ("W_E", "W_U", "W_Q", "W_K", "W_V", "W_O",
                                                                         "W_in", "W_gate", "W_out")})
    tokens = torch.randint(0, D_VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf_patterns = torch.stack(hf(tokens, output_attentions=True).attentions, 1)
    gap = (unscaled.run_with_cache(tokens)[1].patterns - hf_patterns).abs().max()
    assert gap > 1e-2


def test_unsupported_architecture_is_refused_with_the_supported_list():
    config = transformers.XGLMConfig(vocab_size=64, d_model=16, num_layers=1, attention_heads=2, ffn_dim=32)
    with pytest.raises(ValueError, match=r"config.model_type='xglm'\); supported model types: \['bloom', 'codegen', "):
        pcw.from_hf(transformers.AutoModelForCausalLM.from_config(config))
