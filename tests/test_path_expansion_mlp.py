"""Path expansion of models with MLPs and biases (tiny random GPT-2 and LLaMA through ``pcw.from_hf``,
float64): the terms sum to Hugging Face's own logits, and the MLP and head terms are what the Hugging
Face modules wrote (captured with forward hooks), read by the final norm (its division taken from
the Hugging Face forward) and the unembedding.

Tolerances (``tests/tolerance.py``): the expansion against the weight view's forward within
``path_expansion_tol`` (both float64); against Hugging Face's forward within ``logit_tol`` of two
forwards, in float64 for GPT-2 and in float32 for LLaMA, whose modules keep the rotary tables and the
RMSNorm statistics in float32 even in a float64 model (so its activations are float32 chains); dense
float64 products within ``centred_product_tol`` (the centrings' roundings carried through)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import path_expansion
from pycircuits_widgets.analysis.path_expansion import path_specs
from test_adapters_hf import float64_pair
from tolerance import assert_within, centred_product_tol, gamma, logit_tol, path_expansion_tol

V = 64
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=4),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=V, max_position_embeddings=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, attention_bias=True),
}
TOKENS = torch.tensor([[3, 17, 5, 3, 17, 5, 40, 2, 9, 63], [1, 2, 3, 4, 1, 2, 3, 4, 0, 7]])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def adapted(request):
    return request.param, *float64_pair(CONFIGS[request.param](), seed=5)


def hf_tol(kind, model) -> float:
    """Ours (float64) against Hugging Face's forward: two float64 forwards for GPT-2; LLaMA's rotary
    tables and RMSNorm statistics are float32 in Hugging Face's modules whatever the model's dtype, so
    its forward is held to two float32 forwards' bound (``logit_tol``)."""
    _, cache = model.run_with_cache(TOKENS)
    return logit_tol(model, cache, TOKENS.shape[1], torch.float64 if kind == "gpt2" else torch.float32)


def _hf_forward_with_writes(kind, hf):
    """HF logits, each MLP's output [b, pos, d], and the final norm's input [b, pos, d]."""
    blocks = hf.transformer.h if kind == "gpt2" else hf.model.layers
    final = hf.transformer.ln_f if kind == "gpt2" else hf.model.norm
    mlp_out, final_in = [], []
    hooks = [block.mlp.register_forward_hook(lambda mod, args, out: mlp_out.append(out)) for block in blocks]
    hooks.append(final.register_forward_hook(lambda mod, args, out: final_in.append(args[0])))
    with torch.no_grad():
        logits = hf(TOKENS).logits
    for hook in hooks:
        hook.remove()
    return logits, mlp_out, final_in[0], final


def _read_final(kind, final, x, stream):
    """``x`` as the final norm and unembedding read it when the stream is ``stream`` (division frozen)."""
    if kind == "gpt2":
        x = x - x.mean(-1, keepdim=True)
        sigma = (stream.var(-1, unbiased=False, keepdim=True) + final.eps).sqrt()
    else:
        sigma = (stream.pow(2).mean(-1, keepdim=True) + final.variance_epsilon).sqrt()
    return x / sigma * final.weight


@pytest.mark.parametrize("max_order", [1, 2])
def test_terms_sum_to_the_hf_logits(adapted, max_order):
    kind, hf, model = adapted
    logits, *_ = _hf_forward_with_writes(kind, hf)
    pe = path_expansion(model, TOKENS, max_order=max_order)
    error = (pe.total() - model(TOKENS)).abs().max().item()  # the decomposition itself: float64 rounding
    assert error <= path_expansion_tol(model, pe), error
    assert (pe.total() - logits).abs().max().item() <= hf_tol(kind, model) + path_expansion_tol(model, pe)
    names = [t.name for t in pe.terms]
    assert len(names) == len(set(names)) == len([s for s in path_specs(model.cfg, max_order) if s[0] in pe.sources])
    assert {"direct", "MLP0", "MLP1", "bias L0", "bias L1", "L0.H3", "L1.H2"} <= set(names)
    if max_order == 2:  # two attention layers: virtual heads and what layer-1 heads move of MLP 0 and the bias
        assert {"L0.H1 → L1.H2", "MLP0 → L1.H2", "bias L0 → L1.H2"} <= set(names)
    assert ("b_U" in names) == (model.b_U is not None)


def test_mlp_terms_are_what_the_hf_mlp_wrote(adapted):
    kind, hf, model = adapted
    _, mlp_out, final_in, final = _hf_forward_with_writes(kind, hf)
    pe = path_expansion(model, TOKENS, max_order=1)
    head = hf.lm_head.weight
    # what the MLP wrote (an activation of HF's forward) as the final norm and unembedding read it: part
    # of the chain hf_tol bounds, the read-out of its last layer included
    tol = hf_tol(kind, model) + path_expansion_tol(model, pe)
    for layer in range(2):
        i = [t.name for t in pe.terms].index(f"MLP{layer}")
        expected = _read_final(kind, final, mlp_out[layer], final_in) @ head.T
        torch.testing.assert_close(pe.term_logits(i), expected, rtol=0, atol=tol)
    assert pe.terms[[t.name for t in pe.terms].index("MLP1")].order == 1
    # ablation importance of an MLP term: the loss without it
    imp = pe.term_importance()
    assert imp.shape == (len(pe.terms),) and torch.isfinite(imp).all()


def test_mlp_path_terms_equal_dense_products_of_the_hf_weights(adapted):
    """W_E W_in (token -> neuron), W_E W_OV W_in per head, W_out W_U (neuron -> logits): the folded
    circuits against the raw HF weights with the norm scales applied by hand (float64)."""
    kind, hf, model = adapted
    circuits = pcw.analysis
    if kind == "gpt2":
        E, block, final = hf.transformer.wte.weight, hf.transformer.h[1], hf.transformer.ln_f
        W_in = block.ln_2.weight[:, None] * block.mlp.c_fc.weight  # Conv1D: [d_model, d_mlp]
        W_out, readers = block.mlp.c_proj.weight, {"in": W_in}
    else:
        E, block, final = hf.model.embed_tokens.weight, hf.model.layers[1], hf.model.norm
        g = block.post_attention_layernorm.weight[:, None]
        readers = {"in": g * block.mlp.up_proj.weight.T, "gate": g * block.mlp.gate_proj.weight.T}
        W_out = block.mlp.down_proj.weight.T
    E_c = E - E.mean(-1, keepdim=True) if kind == "gpt2" else E  # layer norm reads the centred stream

    def centring(W, dim):  # a float64 centring's rounding per entry (its mean's d + 1, its subtraction)
        if kind != "gpt2":
            return None
        return gamma(W.shape[dim] + 2, torch.float64) * (W.abs() + W.abs().mean(dim, keepdim=True))

    def bound(A, B, dim_A, dim_B):  # two float64 evaluations, ours centring readers and writers too
        return 2 * centred_product_tol(A, B, dtype=torch.float64, errors=[centring(A, dim_A), centring(B, dim_B)],
                                       centre=False)

    for which, W in readers.items():
        gate = which == "gate"
        assert_within(circuits.mlp_in_circuit(model, 1, gate=gate).AB, E_c @ W, bound(E, W, -1, 0))
    unembed = final.weight[:, None] * hf.lm_head.weight.T
    W_out_c = W_out - W_out.mean(-1, keepdim=True) if kind == "gpt2" else W_out
    assert_within(circuits.mlp_out_circuit(model, 1).AB, W_out_c @ unembed, bound(W_out, unembed, -1, 0))
    # head L0.H2's OV into MLP 1: its W_O writes what the MLP's W_in reads
    ov = model.W_V[0, 2] @ model.W_O[0, 2]
    torch.testing.assert_close(circuits.head_mlp_circuit(model, (0, 2), 1).AB, model.W_E @ ov @ model.W_in[1])
    if kind == "gpt2":
        with pytest.raises(ValueError, match="no gated MLP"):
            circuits.mlp_in_circuit(model, 1, gate=True)
