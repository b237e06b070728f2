"""Causal checks (``pcw.ablate``, ``pcw.path_patch``, ``pcw.measured_composition``) and the one
intervention mechanism under them (``run_with_cache(interventions=..., resume=...)``).

Oracles, each written independently of the intervention code:

* ``oracle``: a float64 forward written here over the weight view's tensors (layer norm, learned or
  Shortformer positions, a gelu_new MLP, biases: GPT-2 and the paper's models), each head computed on
  its own, with explicit hooks on each head's query/key/value input stream, its ``z``, its output, and
  each MLP neuron's activation;
* TransformerLens 4.x ``run_with_hooks`` on a ``TransformerBridge`` around a tiny random GPT-2 built
  from a config (no download), read into ours with ``pcw.from_transformer_lens``: ``hook_z`` zeroed for
  ablation, ``use_split_qkv_input`` with ``hook_q_input`` / ``hook_k_input`` / ``hook_v_input``
  patched for path patching;
* every family of the families table (``family_configs``): ablation equals the same model with the
  head's ``W_O`` (the neuron's ``W_out`` row) set to zero, through the model's own forward;
* ``measured_composition`` equals ``path_patch`` pair by pair.

Tolerances come from ``tolerance``'s rounding-error model: ``logit_tol`` for logits (losses: twice
that, a log-softmax adds at most one logit's error per side), ``pattern_tol`` for attention
probabilities, so a total-variation distance (half a sum of ``pos`` differences) moves by at most
``pos * pattern_tol`` between two computations of both its patterns; a head output's norm by at most
``sqrt(N)`` times the per-entry ``chain_tol`` of the forward. A resumed forward (the clean prefix
reused) is compared bit for bit with the whole forward: it runs the same operations on the same
inputs.
"""

import copy
import functools
import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import pycircuits_widgets as pcw
from family_configs import CONFIGS, probe_tokens, tiny_model
from pycircuits_widgets.analysis.neurons import neuron_activations
from pycircuits_widgets.analysis.path_patching import writer_removal
from pycircuits_widgets.demo import SAMPLE_TEXT
from pycircuits_widgets.models.corpus import corpus_documents
from pycircuits_widgets.models.interventions import Interventions
from random_models import custom_model
from tolerance import assert_within, chain_tol, logit_tol, model_forward_length, pattern_tol

# --- the float64 oracle ----------------------------------------------------------------------

def oracle(model, tokens, *, resid=None, inputs=None, pattern=None, z=None, head_out=None, neurons=None,
           mlp_input=None, final=None) -> dict:
    """A float64 forward of ``model``'s folded tensors, each head on its own. Hooks, each
    ``(layer, tensor) -> tensor``: ``resid(layer, x [b, pos, d_model])`` the stream before each layer,
    ``inputs(layer, via, x [b, H, pos, d_model])`` each head's query,
    key or value input stream (before its norm), ``pattern(layer, p [b, H, dest, src])``,
    ``z(layer, z [b, H, pos, d_head])``,
    ``head_out(layer, out [b, H, pos, d_model])``, ``neurons(layer, act [b, pos, d_mlp])``,
    ``mlp_input(layer, x [b, pos, d_model])`` the stream the MLP reads (before its norm; the residual stream
    goes on without the hook's change), ``final(x [b, pos, d_model])`` the stream the unembedding reads.
    Returns logits, patterns ``[b, L, H, pos, pos]``, z ``[b, L, H, pos, d_head]``, the
    heads' outputs ``[b, L, H, pos, d_model]`` and (models with MLPs) the MLPs' ``mlp_out [b, L, pos, d_model]``."""
    c = model.cfg
    assert c.normalization == "layernorm" and c.positional in ("learned", "shortformer") and c.pre_norm
    assert not (c.post_norms or c.qk_norm or c.parallel_attn_mlp or c.gated_mlp or c.rotary_dim)

    def w(name):
        value = getattr(model, name)
        return None if value is None else value.double()

    def bias(name, layer=None, per_head=False):
        value = w(name)
        if value is None:
            return 0
        value = value if layer is None else value[layer]
        return value[:, None] if per_head else value

    def norm(x):
        x = x - x.mean(-1, keepdim=True)
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.eps)

    def gelu_new(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    b, n = tokens.shape
    W_pos = w("W_pos")
    x = w("W_E")[tokens] + (W_pos[:n] if c.positional == "learned" else 0)
    qk_pos = W_pos[:n] if c.positional == "shortformer" else 0
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    patterns, zs, outs, mlp_outs = [], [], [], []
    for layer in range(c.n_layers):
        x = resid(layer, x) if resid else x
        per_head = x[:, None].expand(b, c.n_heads, n, c.d_model)
        streams = {via: inputs(layer, via, per_head) if inputs else per_head for via in "QKV"}
        q, k, v = (torch.einsum("bhpd,hde->bhpe", norm(streams[via]) + (qk_pos if via != "V" else 0),
                                w(f"W_{via}")[layer]) + bias(f"b_{via}", layer, per_head=True) for via in "QKV")
        scores = (q @ k.transpose(-1, -2) / c.attn_scale).masked_fill(~causal, -math.inf)
        patterns_l = scores.softmax(-1)
        patterns_l = pattern(layer, patterns_l) if pattern else patterns_l
        zl = patterns_l @ v
        zl = z(layer, zl) if z else zl
        out = torch.einsum("bhpe,hed->bhpd", zl, w("W_O")[layer])
        out = head_out(layer, out) if head_out else out
        patterns.append(patterns_l), zs.append(zl), outs.append(out)
        x = x + out.sum(1) + bias("b_O", layer)
        if not c.attn_only:
            read = mlp_input(layer, x) if mlp_input else x
            act = gelu_new(norm(read) @ w("W_in")[layer] + bias("b_in", layer))
            act = neurons(layer, act) if neurons else act
            mlp_outs.append(act @ w("W_out")[layer] + bias("b_out", layer))
            x = x + mlp_outs[-1]
    x = final(x) if final else x
    logits = norm(x) @ w("W_U") + bias("b_U")
    return {"logits": logits, "patterns": torch.stack(patterns, 1), "z": torch.stack(zs, 1),
            "head_out": torch.stack(outs, 1), "mlp_out": torch.stack(mlp_outs, 1) if mlp_outs else None}


def token_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].transpose(1, 2).double(), tokens[:, 1:], reduction="none")


def set_heads(layer_heads: dict, values=None):
    """An oracle hook setting heads ``{layer: [head, ...]}`` to zero (or ``values[layer, head]``)."""
    def hook(layer, t):
        t = t.clone()
        for h in layer_heads.get(layer, ()):
            t[:, h] = 0 if values is None else values[layer, h]
        return t
    return hook


def set_neurons(layer_neurons: dict, values=None):
    def hook(layer, act):
        act = act.clone()
        for n in layer_neurons.get(layer, ()):
            act[..., n] = 0 if values is None else values[layer, n]
        return act
    return hook


def total_variation(patched, clean) -> float:
    """Mean over sequences and destinations of ``0.5 * sum_src |patched - clean|``, ``[b, dest, src]``."""
    return float(0.5 * (patched.double() - clean.double()).abs().sum(-1).mean())


def output_norm_tol(model, cache, out, n_tokens, dtype=torch.float32) -> float:
    """Bound on the difference of two computations of ``||out||`` (``out [..., d_model]`` a head's output):
    ``sqrt(N)`` entries each within the forward's chain bound of the largest entry."""
    entry = chain_tol(model_forward_length(model.cfg, n_tokens), float(out.abs().max()), dtype)
    return math.sqrt(out.numel()) * entry


# --- models ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_64():
    """A tiny random GPT-2 (MLPs, learned positions, every bias) as a float64 weight view."""
    return pcw.from_hf(tiny_model("gpt2", dtype=torch.float64), verify=False)


@pytest.fixture(scope="module")
def shipped():
    return pcw.load_pretrained("attn-only-2l")


def means_over(model, windows) -> dict:
    """Each head's mean output and each neuron's mean activation over ``windows``, from our forward."""
    _, cache = model.run_with_cache(windows)
    means = {"heads": cache.head_out.mean((0, 3))}
    if not model.cfg.attn_only:
        means["neurons"] = torch.stack([neuron_activations(model, cache, l).mean((0, 1))
                                        for l in range(model.cfg.n_layers)])
    return means


class SweepLike:
    """What ``ablate`` reads of a ``pcw.Sweep``: ``head_means()`` and ``neuron_means()``."""

    def __init__(self, means):
        self.means = means

    def head_means(self):
        return self.means["heads"]

    def neuron_means(self):
        return self.means.get("neurons")


# --- ablation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["gpt2_64", "shipped_64"])
def test_zero_ablation_equals_the_oracle_with_those_heads_z_zeroed(which, gpt2_64, shipped):
    model = gpt2_64 if which == "gpt2_64" else shipped.to(torch.float64)
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    heads = {0: [1], 1: [0, 2]}
    neurons = {} if model.cfg.attn_only else {0: [3, 17], 1: [5]}
    result = pcw.ablate(model, tokens, heads=[(l, h) for l, hs in heads.items() for h in hs],
                        neurons=[(l, n) for l, ns in neurons.items() for n in ns])
    clean = oracle(model, tokens)
    ref = oracle(model, tokens, z=set_heads(heads), neurons=set_neurons(neurons))
    tol = logit_tol(model, result.cache, tokens.shape[1], torch.float64)
    assert_within(result.logits, ref["logits"], tol)
    assert_within(result.loss, token_loss(ref["logits"], tokens), 2 * tol)
    assert_within(result.clean_loss, token_loss(clean["logits"], tokens), 2 * tol)
    assert_within(result.cache.z, ref["z"], tol)
    assert result.loss.shape == (2, 15)
    assert result.loss_change == pytest.approx(float((result.loss - result.clean_loss).mean()))
    assert float(result.cache.head_out[:, 1, 2].abs().max()) == 0  # an ablated head wrote nothing


def test_mean_ablation_equals_the_oracle_with_those_heads_outputs_replaced(gpt2_64):
    windows = torch.randint(0, 128, (6, 24), generator=torch.Generator().manual_seed(5))
    means = means_over(gpt2_64, windows)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    result = pcw.ablate(gpt2_64, tokens, heads=[(0, 3), (1, 1)], neurons=[(0, 7)], kind="mean",
                        means=SweepLike(means))
    ref = oracle(gpt2_64, tokens, head_out=set_heads({0: [3], 1: [1]}, means["heads"]),
                 neurons=set_neurons({0: [7]}, means["neurons"]))
    tol = logit_tol(gpt2_64, result.cache, 16, torch.float64)
    assert_within(result.logits, ref["logits"], tol)
    # the cache's head outputs are what the run's heads wrote: the means for the ablated heads
    assert_within(result.cache.head_out, ref["head_out"], tol)
    # the same means as a dict, and as the heads' tensor alone
    by_dict = pcw.ablate(gpt2_64, tokens, heads=[(0, 3), (1, 1)], neurons=[(0, 7)], kind="mean", means=means)
    by_tensor = pcw.ablate(gpt2_64, tokens, heads=[(0, 3), (1, 1)], kind="mean", means=means["heads"])
    assert torch.equal(by_dict.logits, result.logits)
    heads_only = oracle(gpt2_64, tokens, head_out=set_heads({0: [3], 1: [1]}, means["heads"]))
    assert_within(by_tensor.logits, heads_only["logits"], tol)


@pytest.mark.parametrize("kind", ["zero", "mean"])
def test_each_heads_loss_change_is_the_oracle_with_that_head_alone_removed(gpt2_64, kind):
    """``pcw.head_loss_changes``: every head of the table against a float64 forward with that head's z
    zeroed (its output set to its mean), the mean per-token loss change."""
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(8))
    means = means_over(gpt2_64, torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(9)))
    table = pcw.head_loss_changes(gpt2_64, tokens, kind=kind, means=SweepLike(means) if kind == "mean" else None)
    L, H = gpt2_64.cfg.n_layers, gpt2_64.cfg.n_heads
    assert table.shape == (L, H) and table.dtype == torch.float32
    clean = oracle(gpt2_64, tokens)
    base = token_loss(clean["logits"], tokens)
    tol = 4 * logit_tol(gpt2_64, pcw.run(gpt2_64, tokens).cache, tokens.shape[1], torch.float64)
    for layer in range(L):
        for head in range(H):
            hook = set_heads({layer: [head]}, None if kind == "zero" else means["heads"])
            ref = oracle(gpt2_64, tokens, **{"z" if kind == "zero" else "head_out": hook})
            expected = float((token_loss(ref["logits"], tokens) - base).mean())
            # each loss within twice logit_tol, their difference four times; then one float32 rounding
            assert abs(float(table[layer, head]) - expected) <= tol + abs(expected) * 2.0 ** -24, (layer, head)


def test_mean_ablation_of_the_shipped_model_with_a_corpus_sweep(shipped, tmp_path):
    """``means=`` a real ``pcw.Sweep`` over stdlib-corpus windows (of the model ablated: a sweep is of one
    model, dtype included): the oracle with the head's output replaced by the sweep's mean output."""
    model64 = shipped.to(torch.float64)
    sweep = pcw.sweep(model64, pcw.Corpus.from_texts(corpus_documents("pydoc")[:4]), tmp_path, seq_len=32,
                      max_windows=8, progress=False)
    tokens = shipped.to_tokens(SAMPLE_TEXT)[None]
    mean = pcw.ablate(model64, tokens, heads=[(1, 3)], kind="mean", means=sweep)
    ref = oracle(model64, tokens, head_out=set_heads({1: [3]}, sweep.head_means().double()))
    assert_within(mean.logits, ref["logits"], logit_tol(model64, mean.cache, tokens.shape[1], torch.float64))
    assert torch.equal(pcw.ablate(model64, tokens, heads=[(1, 3)], kind="mean",
                                  means={"heads": sweep.head_means()}).logits, mean.logits)


def test_ablation_equals_the_model_with_w_o_zeroed(shipped):
    tokens = shipped.to_tokens(SAMPLE_TEXT)
    result = pcw.ablate(shipped, tokens, heads=[(0, 4), (1, 6)])
    zeroed = copy.copy(shipped)
    zeroed.W_O = shipped.W_O.clone()
    zeroed.W_O[0, 4] = zeroed.W_O[1, 6] = 0
    logits, cache = zeroed.run_with_cache(tokens)
    assert_within(result.logits, logits, logit_tol(zeroed, cache, len(tokens)))


# --- TransformerLens -------------------------------------------------------------------------

TL_VOCAB = 50


@pytest.fixture(scope="module")
def tl_gpt2():
    """A TransformerBridge (split Q/K/V inputs on) around a 3-layer random GPT-2, and ours from it."""
    from transformer_lens import TransformerBridge

    words = ["<unk>"] + [f"w{i}" for i in range(TL_VOCAB - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    config = transformers.GPT2Config(vocab_size=TL_VOCAB, n_positions=32, n_embd=32, n_layer=3, n_head=4)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            is_scale = ".ln" in name and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if is_scale else 0.3) + (1.0 if is_scale else 0.0))
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=hf, tokenizer=tokenizer)
    bridge.set_use_split_qkv_input(True)
    return bridge, pcw.from_transformer_lens(bridge)


def tl_run(bridge, tokens, hooks, saved=()):
    """TransformerLens logits with ``hooks`` and the activations named in ``saved``."""
    out = {}

    def saver(name):
        def save(x, hook):
            out[name] = x.detach().clone()
        return save

    with torch.no_grad():
        logits = bridge.run_with_hooks(tokens, fwd_hooks=list(hooks) + [(name, saver(name)) for name in saved])
    return logits, out


def test_ablation_equals_transformer_lens_with_hook_z_zeroed(tl_gpt2):
    bridge, model = tl_gpt2
    tokens = torch.randint(0, TL_VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))

    def zero(heads):
        def hook(z, hook):  # [b, pos, H, d_head]
            z = z.clone()
            z[:, :, heads] = 0
            return z
        return hook

    tl_logits, _ = tl_run(bridge, tokens, [("blocks.0.attn.hook_z", zero([2])), ("blocks.2.attn.hook_z", zero([0, 3]))])
    result = pcw.ablate(model, tokens, heads=[(0, 2), (2, 0), (2, 3)])
    assert_within(result.logits, tl_logits, logit_tol(model, result.cache, 14))
    assert_within(result.loss, token_loss(tl_logits, tokens), 2 * logit_tol(model, result.cache, 14))


@pytest.mark.parametrize("via", ["Q", "K", "V"])
def test_path_patching_equals_transformer_lens_split_inputs(tl_gpt2, via):
    bridge, model = tl_gpt2
    tokens = torch.randint(0, TL_VOCAB, (2, 14), generator=torch.Generator().manual_seed(2))
    (l1, h1), (l2, h2) = (0, 1), (2, 3)
    clean_logits, clean = tl_run(bridge, tokens, [], [f"blocks.{l1}.attn.hook_z", f"blocks.{l2}.attn.hook_pattern",
                                                      f"blocks.{l2}.attn.hook_z"])
    writer_out = clean[f"blocks.{l1}.attn.hook_z"][:, :, h1] @ bridge.W_O[l1, h1].detach()  # [b, pos, d_model]

    def remove(x, hook):  # [b, pos, H, d_model]: each head's own copy of the residual stream
        x = x.clone()
        x[:, :, h2] -= writer_out
        return x

    names = [f"blocks.{l2}.attn.hook_pattern", f"blocks.{l2}.attn.hook_z"]
    logits, patched = tl_run(bridge, tokens, [(f"blocks.{l2}.hook_{via.lower()}_input", remove)], names)
    result = pcw.path_patch(model, tokens, writer=(l1, h1), reader=(l2, h2), via=via)
    n = tokens.shape[1]
    tol = logit_tol(model, result.cache, n)
    assert result.loss_change == pytest.approx(
        float((token_loss(logits, tokens) - token_loss(clean_logits, tokens)).mean()), abs=4 * tol)
    if via == "V":
        # the weight view's outputs are centred (folding): TL's minus their mean over d_model, which
        # no layer-norm reader sees
        W_O = bridge.W_O[l2, h2].detach()
        W_O = W_O - W_O.mean(-1, keepdim=True)
        clean_out = clean[f"blocks.{l2}.attn.hook_z"][:, :, h2] @ W_O
        change = patched[f"blocks.{l2}.attn.hook_z"][:, :, h2] @ W_O - clean_out
        expected = float(change.norm() / clean_out.norm())
        bound = 2 * output_norm_tol(model, result.cache, clean_out, n) / float(clean_out.norm()) * (1 + expected)
    else:
        ref_pattern = patched[f"blocks.{l2}.attn.hook_pattern"][:, h2]
        expected = total_variation(ref_pattern, clean[f"blocks.{l2}.attn.hook_pattern"][:, h2])
        bound = n * pattern_tol(model.cfg, n, ref_pattern)
        assert_within(result.pattern, ref_pattern, pattern_tol(model.cfg, n, ref_pattern))
    assert expected > 10 * bound  # the path matters here: the comparison is not of two roundings
    assert result.attention_change == pytest.approx(expected, abs=bound)


# --- every family ---------------------------------------------------------------------------------

@functools.cache
def family_model(name):
    """``name``'s tiny model as a weight view (the translation is verified in test_families); built once."""
    return pcw.from_hf(tiny_model(name), verify=False)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_family_ablates_through_its_own_forward(name):
    model = family_model(name)
    tokens = probe_tokens()
    mlp = not model.cfg.attn_only
    clean = pcw.run(model, tokens)
    result = pcw.ablate(model, tokens, heads=[(0, 1), (1, 2)], neurons=[(0, 5), (1, 9)] if mlp else (), clean=clean)
    zeroed = copy.copy(model)
    zeroed.W_O = model.W_O.clone()
    zeroed.W_O[0, 1] = zeroed.W_O[1, 2] = 0
    if mlp:
        zeroed.W_out = model.W_out.clone()
        zeroed.W_out[0, 5] = zeroed.W_out[1, 9] = 0
    logits, cache = zeroed.run_with_cache(tokens)
    tol = logit_tol(zeroed, cache, tokens.shape[1])
    assert_within(result.logits, logits, tol)
    assert_within(result.cache.patterns, cache.patterns, pattern_tol(model.cfg, tokens.shape[1], cache.patterns))
    if model.cfg.post_norms:  # the post-norm divides the changed output
        assert not torch.equal(result.cache.post_scale_attn[:, 0], clean.cache.post_scale_attn[:, 0])
        assert_within(result.cache.post_scale_attn, cache.post_scale_attn, tol)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_forward_resumed_from_the_clean_run_is_the_whole_forward_bit_for_bit(name):
    model = family_model(name)
    tokens = probe_tokens()
    clean = model.run_with_cache(tokens, mlp_post=True)[1]
    mlp = not model.cfg.attn_only
    for edits in (Interventions(heads={(1, 2): None}),  # resumed at layer 1: layer 0 not run again
                  Interventions(heads={(0, 1): clean.head_out[:, 0, 1].mean((0, 1))},
                                neurons={(1, 3): None} if mlp else {}),
                  Interventions(head_inputs={(1, 0, "K"): clean.resid[:, 0]})):  # layer 0 removed from one key
        resumed, resumed_cache = model.run_with_cache(tokens, interventions=edits, resume=clean, mlp_post=True)
        whole, whole_cache = model.run_with_cache(tokens, interventions=edits, mlp_post=True)
        assert torch.equal(resumed, whole)
        for field in ("resid", "patterns", "z", "ln_scale", "mlp_out", "post_scale_attn", "mlp_post"):
            a, b = getattr(resumed_cache, field), getattr(whole_cache, field)
            assert (a is None and b is None) or torch.equal(a, b), field
        assert not torch.equal(resumed, model(tokens))


def test_without_interventions_a_resumed_forward_is_the_clean_one(shipped):
    tokens = shipped.to_tokens(SAMPLE_TEXT)
    logits, clean = shipped.run_with_cache(tokens)
    again, cache = shipped.run_with_cache(tokens, resume=clean)
    assert torch.equal(again, logits) and torch.equal(cache.resid, clean.resid) and cache.interventions is None


# --- path patching ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["zero", "mean"])
@pytest.mark.parametrize("via", ["Q", "K", "V"])
def test_path_patching_equals_the_oracle_with_the_writer_removed_from_one_input(gpt2_64, via, kind):
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    means = means_over(gpt2_64, torch.randint(0, 128, (6, 24), generator=torch.Generator().manual_seed(5)))
    (l1, h1), (l2, h2) = (0, 2), (1, 1)
    clean = oracle(gpt2_64, tokens)
    removed = clean["head_out"][:, l1, h1] - (means["heads"][l1, h1] if kind == "mean" else 0)

    def remove(layer, v, x):
        if (layer, v) != (l2, via):
            return x
        x = x.clone()
        x[:, h2] -= removed
        return x

    ref = oracle(gpt2_64, tokens, inputs=remove)
    result = pcw.path_patch(gpt2_64, tokens, writer=(l1, h1), reader=(l2, h2), via=via, kind=kind,
                            means=means if kind == "mean" else None)
    n = tokens.shape[1]
    tol = logit_tol(gpt2_64, result.cache, n, torch.float64)
    expected_loss = float((token_loss(ref["logits"], tokens) - token_loss(clean["logits"], tokens)).mean())
    assert result.loss_change == pytest.approx(expected_loss, abs=4 * tol)
    assert_within(result.loss, token_loss(ref["logits"], tokens), 2 * tol)
    if via == "V":
        clean_out = clean["head_out"][:, l2, h2]
        expected = float((ref["head_out"][:, l2, h2] - clean_out).norm() / clean_out.norm())
        bound = 2 * output_norm_tol(gpt2_64, result.cache, clean_out, n, torch.float64) / float(clean_out.norm()) \
            * (1 + expected)
        assert_within(result.pattern, clean["patterns"][:, l2, h2], pattern_tol(gpt2_64.cfg, n, result.pattern,
                                                                                  torch.float64))
    else:
        expected = total_variation(ref["patterns"][:, l2, h2], clean["patterns"][:, l2, h2])
        bound = n * pattern_tol(gpt2_64.cfg, n, ref["patterns"], torch.float64)
        assert_within(result.pattern, ref["patterns"][:, l2, h2], pattern_tol(gpt2_64.cfg, n, ref["patterns"],
                                                                              torch.float64))
    assert expected > 10 * bound
    assert result.attention_change == pytest.approx(expected, abs=bound)
    # everything but the reader is clean: the other heads of its layer attend as before
    others = [h for h in range(gpt2_64.cfg.n_heads) if h != h2]
    assert torch.equal(result.cache.patterns[:, l2, others], pcw.run(gpt2_64, tokens).patterns[:, l2, others])


@pytest.mark.parametrize("cfg", [{"normalization": "layernorm"}, {"normalization": "rmsnorm"},
                                 {"normalization": "rmsnorm", "pre_norm": False}],
                         ids=["layernorm", "rmsnorm", "no_pre_norm"])
@pytest.mark.parametrize("kind", ["zero", "mean"])
def test_with_post_norms_the_writer_removal_is_what_ablating_it_takes_from_the_next_layer(cfg, kind):
    """Attention-only with post-norms: the next layer reads the stream with layer 0's normalised
    output changed, its norm's division recomputed. That stream, less the writer's removal, is the
    ablated run's input to layer 1."""
    model = custom_model(post_norms=True, n_layers=2, **cfg)
    tokens = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    clean = pcw.run(model, tokens)
    means = {"heads": torch.randn(2, 3, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(2))}
    means = means if kind == "mean" else None
    heads = means["heads"] if means else None
    ablated = pcw.ablate(model, tokens, heads=[(0, 1)], kind=kind, means=means, clean=clean)
    removal = writer_removal(model, clean.cache, 0, [1], heads)[0]
    magnitude = float(clean.cache.resid.abs().max() + removal.abs().max())
    tol = chain_tol(model_forward_length(model.cfg, 12), magnitude, torch.float64)
    assert_within(clean.cache.resid[:, 1] - removal, ablated.cache.resid[:, 1], tol)
    assert float(removal.abs().max()) > 1e6 * tol


# --- measured composition ----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_measured_composition_is_path_patching_pair_by_pair(name):
    model = family_model(name)
    tokens = probe_tokens()[:1, :16]
    clean = pcw.run(model, tokens)
    n, H = tokens.shape[1], model.cfg.n_heads
    for via in ("Q", "K", "V"):
        measured = pcw.measured_composition(model, tokens, via, clean=clean)
        assert measured.shape == (2, H, 2, H)
        assert measured[:, :, 0].isnan().all() and measured[1].isnan().all()
        for h1, h2 in [(h, (h + k) % H) for h in range(H) for k in (0, 1)]:  # every writer and reader
            pp = pcw.path_patch(model, tokens, (0, h1), (1, h2), via, clean=clean)
            if via == "V":
                clean_out = clean.cache.head_out[:, 1, h2]
                bound = 2 * output_norm_tol(model, clean.cache, clean_out, n) / float(clean_out.norm()) \
                    * (1 + pp.attention_change)
            else:
                bound = n * pattern_tol(model.cfg, n, clean.cache.patterns)
            assert float(measured[0, h1, 1, h2]) == pytest.approx(pp.attention_change, abs=bound), (via, h1, h2)


def test_measured_composition_of_mean_ablated_writers_and_a_batch(gpt2_64):
    tokens = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(9))
    means = means_over(gpt2_64, torch.randint(0, 128, (6, 24), generator=torch.Generator().manual_seed(5)))
    measured = pcw.measured_composition(gpt2_64, tokens, "k", kind="mean", means=SweepLike(means))
    clean = pcw.run(gpt2_64, tokens)
    bound = 10 * pattern_tol(gpt2_64.cfg, 10, clean.patterns, torch.float64)
    for h1, h2 in [(0, 0), (1, 3), (3, 2)]:
        pp = pcw.path_patch(gpt2_64, tokens, (0, h1), (1, h2), "K", kind="mean", means=means)
        assert float(measured[0, h1, 1, h2]) == pytest.approx(pp.attention_change, abs=bound)


def test_measured_composition_of_a_one_layer_model_has_no_pairs():
    model = custom_model(n_layers=1)
    assert pcw.measured_composition(model, torch.arange(8), "Q").isnan().all()


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("call, error, match", [
    (lambda m, t: pcw.ablate(m, t, heads=[(2, 0)]), ValueError, r"ablate: heads: \(2, 0\): layer must be in 0\.\.1, got 2"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 8)]), ValueError, r"\(0, 8\): head must be in 0\.\.7, got 8"),
    (lambda m, t: pcw.ablate(m, t, heads=(0, 4)), ValueError, r"list of \(layer, head\) pairs"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1.0)]), TypeError, r"head must be an int in 0\.\.7, got 1\.0 \(float\)"),
    (lambda m, t: pcw.ablate(m, t), ValueError, "nothing to ablate"),
    (lambda m, t: pcw.ablate(m, t, neurons=[(0, 1)]), ValueError, "attention-only"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1)], kind="resample"), ValueError,
     r"kind must be one of \('zero', 'mean'\)"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1)], kind="mean"), ValueError, r"means=pcw\.sweep\("),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1)], means=torch.zeros(2, 8, 128)), ValueError, "kind='mean' only"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1)], kind="mean", means=torch.zeros(2, 8, 64)), ValueError,
     r"shape \(2, 8, 64\), expected \[2, 8, 128\]"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1)], kind="mean", means={"head": 0}), ValueError, "unknown keys"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1)], kind="mean", means=SweepLike({"heads": None})), ValueError,
     "no heads means"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1)], kind="mean", means=3), TypeError, "Sweep"),
    (lambda m, t: pcw.ablate(m, t[:1], heads=[(0, 1)]), ValueError, "at least 2 tokens"),
    (lambda m, t: pcw.ablate(m, [5000, 1], heads=[(0, 1)]), ValueError, r"token id 5000 out of range"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1)], clean=pcw.run(m, t[:-1])), ValueError, "other tokens"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1)], clean=m.run_with_cache(t)), TypeError, "RunResult"),
    (lambda m, t: pcw.path_patch(m, t, (1, 0), (1, 2), "K"), ValueError,
     "earlier layer.*writer layer 1, reader layer 1"),
    (lambda m, t: pcw.path_patch(m, t, (0, 0), (1, 2), "O"), ValueError, r"via must be one of \('Q', 'K', 'V'\)"),
    (lambda m, t: pcw.path_patch(m, t, (0, 0), (3, 2), "Q"), ValueError, r"path_patch: reader layer must be in 0\.\.1, got 3"),
    (lambda m, t: pcw.measured_composition(m, t, "QK"), ValueError, "via must be one of"),
    (lambda m, t: m.run_with_cache(t, interventions={(0, 1): None}), TypeError, "Interventions"),
    (lambda m, t: m.run_with_cache(t, interventions=Interventions(heads={(0, 9): None})), ValueError,
     r"Interventions.heads: \(0, 9\): head must be in 0\.\.7, got 9"),
    (lambda m, t: m.run_with_cache(t, interventions=Interventions(head_inputs={(1, 0, "Q"): torch.zeros(3)})),
     ValueError, r"stream must be a tensor \[batch, pos, d_model\]"),
    (lambda m, t: m.run_with_cache(t, resume=pcw.ablate(m, t, heads=[(0, 1)]).cache), ValueError, "clean run"),
    (lambda m, t: m.run_with_cache(t, interventions=Interventions(resid={2: torch.zeros(1, 10, 128)})), ValueError,
     r"Interventions.resid: a key \(a layer\) must be in 0\.\.1, got 2"),
    (lambda m, t: m.run_with_cache(t, interventions=Interventions(resid={1: torch.zeros(3)})), ValueError,
     r"Interventions.resid\[1\]: the stream must be a tensor \[batch, pos, d_model\]"),
    (lambda m, t: pcw.ablate(None, t, heads=[(0, 1)]), TypeError, "ablate: model must be a CircuitModel.*NoneType"),
    (lambda m, t: pcw.path_patch(None, t, (0, 0), (1, 2), "Q"), TypeError, "path_patch: model must be a CircuitModel"),
    (lambda m, t: pcw.measured_composition("gpt2", t, "K"), TypeError,
     "measured_composition: model must be a CircuitModel.*str"),
    # a clean run of another text: refused by every caller, measured composition included (it resumes no forward)
    (lambda m, t: pcw.measured_composition(m, t, "K", clean=pcw.run(m, "x = [1, 2, 3] + y")), ValueError,
     "measured_composition: clean is a run of other tokens"),
    (lambda m, t: pcw.ablate(m, t, heads=[(0, 1)], clean=pcw.run(m, "x = [1, 2, 3] + y")), ValueError,
     "ablate: clean is a run of other tokens"),
    (lambda m, t: pcw.measured_composition(m, t, "K", clean=pcw.run(pcw.load_pretrained("attn-only-1l"), t)),
     ValueError, "measured_composition: clean is the cache of another model"),
])
def test_bad_input_is_refused_by_name(shipped, call, error, match):
    tokens = shipped.to_tokens("def f(x):\n    return x")
    with pytest.raises(error, match=match):
        call(shipped, tokens)


def test_another_models_sweep_is_refused_as_means(shipped, tmp_path):
    # a model of the same shape (another checkpoint, say): the sweep's means are not its means, as the
    # explorer already says for the same sweep
    sweep = pcw.sweep(shipped, pcw.Corpus.from_texts(corpus_documents("pydoc")[:2]), tmp_path, seq_len=32,
                      max_windows=4, progress=False)
    other = copy.copy(shipped)
    other.W_O = shipped.W_O * 1.5
    tokens = shipped.to_tokens("def f(x):\n    return x")
    for call in (lambda: pcw.ablate(other, tokens, heads=[(0, 1)], kind="mean", means=sweep),
                 lambda: pcw.path_patch(other, tokens, (0, 1), (1, 2), "K", kind="mean", means=sweep),
                 lambda: pcw.measured_composition(other, tokens, "K", kind="mean", means=sweep)):
        with pytest.raises(ValueError, match="was made with model 'attn-only-2l', not with this model"):
            call()
    # the swept model itself is taken
    assert pcw.ablate(shipped, tokens, heads=[(0, 1)], kind="mean", means=sweep).loss.isfinite().all()


def test_non_finite_weights_are_refused_by_name_not_returned_as_nan(shipped):
    broken = copy.copy(shipped)
    broken.W_K = shipped.W_K.clone()
    broken.W_K[1, 2, 0, 0] = float("nan")
    tokens = shipped.to_tokens("def f(x):\n    return x")
    for call in (lambda: pcw.ablate(broken, tokens, heads=[(0, 1)]),
                 lambda: pcw.path_patch(broken, tokens, (0, 1), (1, 2), "K"),
                 lambda: pcw.measured_composition(broken, tokens, "K")):
        with pytest.raises(pcw.NonFiniteError, match=r"clean run's logits are not finite: weight W_K .* 1 NaN/inf"):
            call()


def test_the_readme_causal_checks_example_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its sweep's store
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("## Causal checks\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(block, "README.md (causal checks example)", "exec"), namespace)
    assert namespace["pp"].reader == (1, 6)
    assert namespace["ablated"].loss.shape == (1, namespace["clean"].tokens.shape[1] - 1)


def test_zero_taps_leave_the_forward_as_it_is_and_bad_taps_and_patterns_are_refused(gpt2_64, shipped):
    """``Interventions.taps`` adds to the stream: zeros give the clean forward's logits bit for bit (resumed
    or not), a tap of ``delta`` before a layer is the stream before it set to the stream plus ``delta``."""
    tokens = torch.randint(0, gpt2_64.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    clean, cache = gpt2_64.run_with_cache(tokens)
    zeros = {(l, w): torch.zeros(2, 6, gpt2_64.cfg.d_model, dtype=torch.float64)
             for l in range(gpt2_64.cfg.n_layers) for w in ("pre", "mid", "post")}
    assert torch.equal(gpt2_64.run_with_cache(tokens, Interventions(taps=zeros))[0], clean)
    assert torch.equal(gpt2_64.run_with_cache(tokens, Interventions(taps=zeros), resume=cache)[0], clean)
    delta = torch.randn(2, 6, gpt2_64.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tapped = gpt2_64.run_with_cache(tokens, Interventions(taps={(1, "pre"): delta}), resume=cache)[0]
    set_ = gpt2_64.run_with_cache(tokens, Interventions(resid={1: cache.resid[:, 1] + delta}))[0]
    assert torch.equal(tapped, set_)
    for taps, match in (({(0, "after"): delta}, r"must be \(layer, where\) with where one of"),
                        ({(9, "pre"): delta}, r"\(9, 'pre'\): layer must be in 0\.\.1, got 9"),
                        ({(0, "pre"): delta[:, :3]}, r"taps\[\(0, 'pre'\)\]: the stream must be a tensor")):
        with pytest.raises(ValueError, match=match):
            gpt2_64.run_with_cache(tokens, Interventions(taps=taps))
    with pytest.raises(ValueError, match="is attention-only"):
        shipped.run_with_cache(torch.tensor([[1, 2]]), Interventions(taps={(0, "post"): torch.zeros(1, 2, 512)}))
    with pytest.raises(ValueError, match=r"patterns\[\(0, 1\)\]: a pattern is a tensor \[batch, dest, src\] = \[2, 6, 6\]"):
        gpt2_64.run_with_cache(tokens, Interventions(patterns={(0, 1): torch.ones(2, 6, 5)}))


def test_a_detached_layer_keeps_the_forward_and_its_gradient_goes_past_it_only(gpt2_64):
    """``Interventions.detached``: the logits bit for bit the clean forward's; the gradient at the stream
    before a detached layer is the gradient after it (only the skip connection carries it back), while
    without the detach it also flows through the layer's attention and MLP."""
    tokens = torch.randint(0, gpt2_64.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    clean, _ = gpt2_64.run_with_cache(tokens)

    def gradients(detached):
        taps = {(1, w): torch.zeros(2, 6, gpt2_64.cfg.d_model, dtype=torch.float64, requires_grad=True)
                for w in ("pre", "post")}
        logits, _ = gpt2_64.run_with_cache(tokens, Interventions(taps=taps, detached=detached))
        assert torch.equal(logits, clean)
        return torch.autograd.grad(logits[:, -1, :3].sum(), [taps[1, "pre"], taps[1, "post"]])

    before, after = gradients(frozenset({1}))
    assert torch.equal(before, after)
    before, after = gradients(frozenset())
    assert float((before - after).abs().max()) > 1e-3 * float(after.abs().max())
    with pytest.raises(ValueError, match=r"Interventions.detached: a layer must be in 0\.\.1, got 2"):
        gpt2_64.run_with_cache(tokens, Interventions(detached=frozenset({2})))
    with pytest.raises(TypeError, match="Interventions.detached: a set of layers, got list"):
        gpt2_64.run_with_cache(tokens, Interventions(detached=[0]))
