"""The MLP neuron view and its analysis (``analysis/neurons.py``) on tiny random Hugging Face models built
from configs (float64): a LLaMA (gated SiLU MLP, rotary, GQA, RMSNorm) and a GPT-2 (GELU MLP, learned
positions, layer norm, biases). Oracles: neuron activations are what Hugging Face's own MLP computed
(forward hooks on ``down_proj``'s input and GPT-2's ``mlp.act``); the three token circuits' top tokens
are a dense float64 computation from the Hugging Face parameters (the norms' scales folded in by hand,
layer norm's centring applied to the stream's writers); the ranking by ``||W_out[n] W_U||`` is the dense
``[d_mlp, d_vocab]`` product's row norms.

Tolerances (``tests/tolerance.py``): activations against Hugging Face's within ``activation_tol`` (two
forwards' rounding chains through the activation's slope), the rebuilt MLP output within
``reduction_tol`` in float64, the views' float32 copies of float64 terms within a float32 rounding."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import traitlets
import transformers

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis.neurons import mlp_input, neuron_activations, neuron_terms
from pycircuits_widgets.models.tokenizer import reading_ids  # a model without a tokenizer reads ids
from pycircuits_widgets.widgets.core import offline
from test_adapters_hf import float64_pair
from tolerance import chain_tol, gamma, model_forward_length, reduction_tol

V, D_MLP, K = 48, 40, 10
IDS = [3, 7, 11, 3, 7, 11, 19, 2, 30, 5]
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=V, max_position_embeddings=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=D_MLP, mlp_bias=True),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                            n_inner=D_MLP),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def adapted(request):
    return request.param, *float64_pair(CONFIGS[request.param](), seed=3)


def hf_activations(kind, hf):
    """Each layer's neuron activations ``[pos, d_mlp]`` as Hugging Face's forward computed them on ``IDS``."""
    blocks = hf.transformer.h if kind == "gpt2" else hf.model.layers
    seen = []
    if kind == "gpt2":  # GELU's output is what c_proj reads
        hooks = [b.mlp.act.register_forward_hook(lambda mod, args, out: seen.append(out[0])) for b in blocks]
    else:  # act(gate_proj(x)) * up_proj(x): what down_proj reads
        hooks = [b.mlp.down_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0])) for b in blocks]
    with torch.no_grad():
        hf(torch.tensor([IDS]))
    for h in hooks:
        h.remove()
    return seen


def dense_terms(kind, hf, layer, head, neuron):
    """``{term: [d_vocab]}`` in float64 from the Hugging Face parameters: the reading norm's learned
    scale multiplied into the reader; for layer norm the writers (W_E, W_O, W_out) centred, which is
    what the norm's centring does to what they write."""
    d, H = hf.config.hidden_size, hf.config.num_attention_heads
    dh = d // H
    centre = (lambda W: W - W.mean(-1, keepdim=True)) if kind == "gpt2" else (lambda W: W)
    if kind == "gpt2":
        blk = hf.transformer.h[layer]
        E, W_U = hf.transformer.wte.weight, hf.transformer.ln_f.weight[:, None] * hf.transformer.wte.weight.T
        W_in = blk.ln_2.weight[:, None] * blk.mlp.c_fc.weight  # Conv1D: x @ weight
        W_V = blk.ln_1.weight[:, None] * blk.attn.c_attn.weight[:, 2 * d + head * dh: 2 * d + (head + 1) * dh]
        W_O = blk.attn.c_proj.weight[head * dh:(head + 1) * dh]
        W_out = blk.mlp.c_proj.weight[neuron]
        readers = {"in": W_in}
    else:
        blk = hf.model.layers[layer]
        kv = head // (H // hf.config.num_key_value_heads)
        E, W_U = hf.model.embed_tokens.weight, hf.model.norm.weight[:, None] * hf.lm_head.weight.T
        w = blk.post_attention_layernorm.weight[:, None]
        readers = {"in": w * blk.mlp.up_proj.weight.T, "gate": w * blk.mlp.gate_proj.weight.T}
        W_V = blk.input_layernorm.weight[:, None] * blk.self_attn.v_proj.weight[kv * dh:(kv + 1) * dh].T
        W_O = blk.self_attn.o_proj.weight[:, head * dh:(head + 1) * dh].T
        W_out = blk.mlp.down_proj.weight[:, neuron]
    E = centre(E)
    terms = {name: E @ R[:, neuron] for name, R in readers.items()}
    terms.update({f"head_{name}": E @ W_V @ centre(W_O) @ R[:, neuron] for name, R in readers.items()})
    terms["out"] = centre(W_out) @ W_U
    terms["out_bottom"] = -terms["out"]
    return {k: v.detach() for k, v in terms.items()}


SLOPE = 1.13
"""A bound on the slopes of GELU (exact and tanh form) and SiLU: 1.129 and 1.100 at most."""
COPIES = {"rtol": gamma(2), "atol": 1e-12}
"""The views' float32 copies of float64 numbers: one rounding (float64's own differences far below)."""


def activation_tol(kind, model, cache, layer) -> torch.Tensor:
    """Bound ``[pos, d_mlp]`` on ours (float64) against Hugging Face's activations of layer ``layer``: two
    forwards to this MLP, in float64 for GPT-2, and float32 chains for LLaMA, whose rotary tables and
    RMSNorm statistics Hugging Face keeps in float32 in a float64 model. A pre-activation ``xn W + b``
    is within ``chain_tol`` of the forward's length (a bound on the path to this MLP) times its terms'
    size ``|xn| |W| + |b|``; the activation moves by at most ``SLOPE`` times that; a gated one,
    ``act(g) u``, by ``SLOPE dg (|u| + du) + |g| du`` (``|silu(g)| <= |g|``)."""
    xn = mlp_input(model, cache, layer)[0].double().abs()
    dtype = torch.float64 if kind == "gpt2" else torch.float32
    factor = chain_tol(model_forward_length(model.cfg, len(IDS)), 1.0, dtype)

    def size(W, b):
        return xn @ W[layer].double().abs() + (b[layer].double().abs() if b is not None else 0)

    up = size(model.W_in, model.b_in)
    if not model.cfg.gated_mlp:
        return SLOPE * factor * up
    gate = size(model.W_gate, model.b_gate)
    return SLOPE * factor * gate * (up + factor * up) + gate * factor * up


def shown(view):
    """``{term: (token ids, values)}`` of the view's tables."""
    tables = view.direct["tables"] + view.through_head["tables"]
    return {t["term"]: (t["ids"].tolist(), t["values"].tolist()) for t in tables}


def test_activations_are_hugging_faces_and_rebuild_the_mlp_output(adapted):
    kind, hf, model = adapted
    _, cache = model.run_with_cache(torch.tensor(IDS))
    for layer, expected in enumerate(hf_activations(kind, hf)):
        acts = neuron_activations(model, cache, layer)[0]
        assert acts.shape == (len(IDS), D_MLP)
        assert bool(((acts - expected).abs() <= activation_tol(kind, model, cache, layer)).all())
        # the model's own forward: activations @ W_out + b_out is the cached MLP output (float64 both ways)
        rebuilt = acts @ model.W_out[layer] + model.b_out[layer]
        size = acts.abs() @ model.W_out[layer].abs() + model.b_out[layer].abs()
        bound = reduction_tol(D_MLP + 1, size, torch.float64, computations=2)
        assert bool(((rebuilt - cache.mlp_out[0, layer]).abs() <= bound).all())


def test_recorded_post_activations_are_hugging_faces_and_the_rest_of_the_cache_unchanged(adapted):
    kind, hf, model = adapted
    _plain_logits, plain = model.run_with_cache(torch.tensor(IDS))
    logits, cache = model.run_with_cache(torch.tensor(IDS), mlp_post=True, logits=False)
    assert logits is None and plain.mlp_post is None
    assert cache.mlp_post.shape == (1, 2, len(IDS), D_MLP)
    for layer, expected in enumerate(hf_activations(kind, hf)):
        assert bool(((cache.mlp_post[0, layer] - expected).abs() <= activation_tol(kind, model, cache, layer)).all())
    for name in ("resid", "patterns", "z", "mlp_out", "ln_scale", "ln_scale_mlp"):  # the same computation
        assert torch.equal(getattr(cache, name), getattr(plain, name)), name


@pytest.mark.parametrize("layer, head, neuron", [(0, 1, 7), (1, 3, 22)])
def test_the_three_terms_top_tokens_are_the_dense_float64_ones(adapted, layer, head, neuron):
    kind, hf, model = adapted
    view = pcw.NeuronView(*reading_ids(model, IDS), layer=layer, head=head, neuron=neuron)
    assert view.wait()
    tables = shown(view)
    expected = dense_terms(kind, hf, layer, head, neuron)
    gated = {"in", "gate", "head_in", "head_gate", "out", "out_bottom"}
    assert set(tables) == set(expected) == (gated if kind == "llama" else gated - {"gate", "head_gate"})
    for term, (ids, values) in tables.items():
        top = torch.topk(expected[term], K)
        sign = -1 if term == "out_bottom" else 1
        assert ids == top.indices.tolist(), term
        np.testing.assert_allclose(values, sign * top.values.numpy(), **COPIES)


def test_a_head_of_a_later_layer_is_refused(adapted):
    _, _, model = adapted
    with pytest.raises(ValueError, match="MLP layer 0 reads before head"):
        neuron_terms(model, 0, 3, (1, 0))
    with pytest.raises(ValueError, match="neuron must be in 0..39"):
        neuron_terms(model, 0, D_MLP)


def test_neurons_are_ranked_by_activation_at_the_position_else_by_their_logit_norm(adapted):
    kind, hf, model = adapted
    explorer = pcw.CircuitExplorer(model, IDS, layer=1)
    explorer.compute("neurons")
    assert explorer.wait()
    view = explorer.neurons
    W_out, W_U = model.W_out[1], model.W_U
    norms = (W_out @ W_U).norm(dim=-1)  # dense [d_mlp, d_vocab]
    assert view.neurons.tolist() == torch.topk(norms, 10).indices.tolist()
    assert view.ranking == "norm" and view.listed_for == [1, -1]
    explorer.position = 4
    assert explorer.wait() and view.position == 4 and view.listed_for == [1, 4]
    acts = hf_activations(kind, hf)[1][4]
    _, cache = model.run_with_cache(torch.tensor(IDS))
    bound = activation_tol(kind, model, cache, 1)[4]
    top = torch.topk(acts.abs(), 11)  # the ranking is decided: neighbours lie further apart than their bounds
    assert bool((top.values[:-1] - top.values[1:] > bound[top.indices][:-1] + bound[top.indices][1:]).all())
    assert view.neurons.tolist() == top.indices[:10].tolist()
    # float32 copies of our activations: within the bound and the copy's rounding
    np.testing.assert_allclose(view.neuron_scores, acts[top.indices[:10]].numpy(), rtol=gamma(1),
                               atol=float(bound[top.indices[:10]].max()))
    assert view.ranking == "activation"


def test_a_browser_write_of_neuron_is_checked_and_rolled_back(adapted):
    _, _, model = adapted
    view = pcw.NeuronView(*reading_ids(model, IDS), layer=1, neuron=3)
    assert view.wait()
    before = shown(view)
    for bad, why in ((D_MLP, f"neuron must be -1 (none) or in 0..{D_MLP - 1}, got {D_MLP}"), (True, "must be an int"),
                     (2.5, "must be an int")):
        view.set_state({"neuron": bad})
        assert view.neuron == 3 and why in view.error, (bad, view.error)
        assert shown(view) == before
    view.set_state({"neuron": 5})
    assert view.wait() and view.error == "" and view.direct["neuron"] == 5
    assert shown(view)["out"] != before["out"]
    view.set_state({"neuron": -1})
    assert view.wait() and view.direct == {"layer": 1, "neuron": -1, "tables": []}
    with pytest.raises(traitlets.TraitError, match="neuron must be"):
        view.neuron = -2


def test_saved_answers_are_the_kernels_tables(adapted):
    _, _, model = adapted
    view = pcw.NeuronView(*reading_ids(model, IDS), layer=1, head=2, position=2)
    assert view.wait()
    state = offline.fill(view)
    rules = {tuple(r["on"]): r for r in offline.rules(state)}
    assert set(rules) == {("layer", "position"), ("layer", "head", "neuron")}
    listed = view.neurons.tolist()
    tables = rules[("layer", "head", "neuron")]["patches"]
    assert {offline.key(1, 2, n) for n in listed} <= set(tables)  # every listed neuron answers without a kernel
    # every layer's list for every position (and none) is saved
    lists = rules[("layer", "position")]["patches"]
    assert set(lists) == {offline.key(l, p) for l in (0, 1) for p in range(-1, len(IDS))}
    view.neuron = listed[0]
    assert view.wait()
    saved, data = tables[offline.key(1, 2, listed[0])], bytes(state["data"])
    for name in ("direct", "through_head"):
        assert [unpacked(t["ids"], data) for t in saved[name]["tables"]] == [
            t["ids"].tolist() for t in getattr(view, name)["tables"]]
    assert view.strings.items() <= rules[("layer", "head", "neuron")]["base"]["strings"].items()


def unpacked(ref, data: bytes) -> list:
    """A packed array of saved answers (``{"packed": [byte offset, dtype, shape]}``) as a list."""
    offset, dtype, shape = ref["packed"]
    return np.frombuffer(data, dtype=dtype, count=int(np.prod(shape)), offset=offset).tolist()


def test_explorers_with_mlps_have_the_section_attention_only_ones_a_notice(adapted):
    _, _, model = adapted
    assert pcw.CircuitExplorer(model, IDS).neurons is not None
    shipped = pcw.CircuitExplorer(pcw.load_pretrained("attn-only-2l"), "def f(x):")
    assert shipped.neurons is None and "attention-only" in shipped.notices["neurons"]
    with pytest.raises(ValueError, match="attention-only"):
        pcw.NeuronView(shipped.model, "def f(x):")
