"""Path expansion of models with MLPs and biases (tiny random GPT-2 and LLaMA through ``pcw.from_hf``,
float64): the terms sum to Hugging Face's own logits, and the MLP and head terms are what the Hugging
Face modules wrote (captured with forward hooks), read by the final norm (its division taken from
the Hugging Face forward) and the unembedding."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import path_expansion
from pycircuits_widgets.analysis.path_expansion import path_specs
from test_adapters_hf import float64_pair

V = 64
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=4),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=V, max_position_embeddings=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, attention_bias=True),
}
# Hugging Face keeps LLaMA's rotary frequencies in float32 even in a float64 model, so its forward
# differs from the weight view's float64 one by ~2e-6; GPT-2 (learned positions) agrees to rounding.
HF_TOL = {"gpt2": 1e-9, "llama": 1e-5}
TOKENS = torch.tensor([[3, 17, 5, 3, 17, 5, 40, 2, 9, 63], [1, 2, 3, 4, 1, 2, 3, 4, 0, 7]])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def adapted(request):
    return request.param, *float64_pair(CONFIGS[request.param](), seed=5)


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
    assert error < 1e-12, error
    assert (pe.total() - logits).abs().max().item() < HF_TOL[kind]
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
    for layer in range(2):
        i = [t.name for t in pe.terms].index(f"MLP{layer}")
        expected = _read_final(kind, final, mlp_out[layer], final_in) @ head.T
        torch.testing.assert_close(pe.term_logits(i), expected, rtol=HF_TOL[kind], atol=HF_TOL[kind])
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
    for which, W in readers.items():
        gate = which == "gate"
        torch.testing.assert_close(circuits.mlp_in_circuit(model, 1, gate=gate).AB, E_c @ W, rtol=1e-9, atol=1e-9)
    unembed = final.weight[:, None] * hf.lm_head.weight.T
    W_out_c = W_out - W_out.mean(-1, keepdim=True) if kind == "gpt2" else W_out
    torch.testing.assert_close(circuits.mlp_out_circuit(model, 1).AB, W_out_c @ unembed, rtol=1e-9, atol=1e-9)
    # head L0.H2's OV into MLP 1: its W_O writes what the MLP's W_in reads
    ov = model.W_V[0, 2] @ model.W_O[0, 2]
    torch.testing.assert_close(circuits.head_mlp_circuit(model, (0, 2), 1).AB, model.W_E @ ov @ model.W_in[1])
    if kind == "gpt2":
        with pytest.raises(ValueError, match="no gated MLP"):
            circuits.mlp_in_circuit(model, 1, gate=True)
