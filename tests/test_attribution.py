"""Attribution patching (issue 53 item 3): the first-order estimate of every cell of a site.

Oracle: the float64 forward written in ``test_interventions`` (each head on its own), with its hooks
adding zero tensors that require grad where each activation is: the estimate of a cell is its change
between the two runs dotted with the metric's gradient at that activation, by torch's autograd through
that forward (a head's own output, a layer's stream, a neuron's activation), independent of the model's
forward and of ``Interventions.taps``. For ``mlp_out`` the oracle reads the neurons: the output's change
dotted with its gradient is the activations' change dotted with theirs (``W_out`` is linear).

Tolerance: both sides float64; each estimate is a sum of ``b * pos * d_model`` products of an
activation difference and a gradient that two float64 computations reach by different roundings: the
exact patching tests' logit bound (``logit_tol``) scaled by the sum's magnitude over the logits'.
"""

import pytest
import torch

import pycircuits_widgets as pcw
from family_configs import tiny_model
from pycircuits_widgets.analysis.attribution import GRADDROP_SITES, SITES, attribution_patch
from pycircuits_widgets.analysis.patching import Task, activation_patch, logit_diff
from pycircuits_widgets.models import CircuitModel, ModelConfig
from random_models import IdTokenizer, custom_model
from test_interventions import oracle
from test_patching import N_PROMPTS, induction, model  # noqa: F401 (fixtures)
from tolerance import chain_tol, logit_tol, model_forward_length


@pytest.fixture(scope="module")
def gpt2_64():
    """A tiny random GPT-2 (MLPs, learned positions, every bias), float64, and an induction-like task."""
    m = pcw.from_hf(tiny_model("gpt2", dtype=torch.float64), verify=False)
    g = torch.Generator().manual_seed(1)
    V = m.cfg.d_vocab
    first, other = torch.randint(1, V, (4, 5), generator=g), torch.randint(1, V, (4, 5), generator=g)
    task = Task(m, torch.cat([first, first[:, :-1]], 1), torch.cat([first, other[:, :-1]], 1),
                answers=[(int(a), int(b)) for a, b in zip(first[:, -1], other[:, -1])])
    return m, task


def oracle_gradients(model, task, tokens, drop=None) -> dict:
    """``{"pre": [L] x [b, pos, d], "head": [L] x [b, H, pos, d], "act": [L] x [b, pos, d_mlp], "Q"/"K"/"V":
    [L] x [b, H, pos, d], "pattern": [L] x [b, H, dest, src]}``: the metric's gradient at every layer's
    stream, head output, neuron activation, each head's query, key and value input stream and pattern,
    through the oracle's forward. ``drop``: a layer whose heads' outputs and neurons' activations (all it
    adds to the stream but constant biases) are detached, after the zeros are added (GradDrop: no
    gradient through that layer's attention or MLP, theirs included)."""
    b, n = tokens.shape
    c = model.cfg
    leaves = {"pre": [], "head": [], "act": [], "Q": [], "K": [], "V": [], "pattern": []}

    def add(kind, shape):
        def hook(layer, x):
            leaf = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
            leaves[kind].append(leaf)
            return (x + leaf).detach() if layer == drop and kind in ("head", "act") else x + leaf
        return hook

    def add_input(layer, via, x):  # x [b, H, pos, d]: each head's own read of the stream
        leaf = torch.zeros(x.shape, dtype=torch.float64, requires_grad=True)
        leaves[via].append(leaf)
        return x + leaf

    hooks = {"resid": add("pre", (b, n, c.d_model)), "head_out": add("head", (b, c.n_heads, n, c.d_model)),
             "inputs": add_input, "pattern": add("pattern", (b, c.n_heads, n, n))}
    if not c.attn_only:
        hooks["neurons"] = add("act", (b, n, c.d_mlp))
    with torch.enable_grad():
        value = logit_diff(oracle(model, tokens, **hooks)["logits"], task)
        flat = [leaf for kind in leaves.values() for leaf in kind]
        grads = iter(torch.zeros_like(leaf) if g is None else g  # (a leaf the detached layer cut off: no gradient)
                     for leaf, g in zip(flat, torch.autograd.grad(value, flat, allow_unused=True)))
    return {kind: [next(grads) for _ in leaves[kind]] for kind in leaves}


def oracle_estimates(model, task, direction, drop=None) -> dict:
    """Each site's estimates ``[site shape]`` (not normalised) from the oracle's gradients and activations
    (``drop``: the gradients with that layer detached, ``oracle_gradients``)."""
    base, source = ((task.tokens_corrupted, task.tokens_clean) if direction == "denoise"
                    else (task.tokens_clean, task.tokens_corrupted))
    g = oracle_gradients(model, task, base, drop)
    runs = {}
    for name, tokens in (("base", base), ("source", source)):
        seen = {"pre": [], "act": []}

        def keep(kind, seen=seen):
            def hook(layer, x):
                seen[kind].append(x.clone())
                return x
            return hook

        hooks = {"resid": keep("pre")}
        if not model.cfg.attn_only:
            hooks["neurons"] = keep("act")
        out = oracle(model, tokens, **hooks)
        runs[name] = {**seen, "head": out["head_out"], "pattern": out["patterns"]}  # [b, L, H, pos, d | src]
    L = model.cfg.n_layers
    d_pre = [runs["source"]["pre"][l] - runs["base"]["pre"][l] for l in range(L)]
    d_head = [runs["source"]["head"][:, l] - runs["base"]["head"][:, l] for l in range(L)]
    out = {
        "resid_pre": torch.stack([torch.einsum("bpd,bpd->p", d_pre[l], g["pre"][l]) for l in range(L)]),
        "head_out": torch.stack([torch.einsum("bhpd,bhpd->h", d_head[l], g["head"][l]) for l in range(L)]),
        "head_out_pos": torch.stack([torch.einsum("bhpd,bhpd->hp", d_head[l], g["head"][l]) for l in range(L)]),
        "attn_out": torch.stack([torch.einsum("bhpd,bhpd->p", d_head[l], g["head"][l]) for l in range(L)]),
        "v_input": torch.stack([torch.einsum("bpd,bhpd->h", d_pre[l], g["V"][l]) for l in range(L)]),
    }
    base_patterns = runs["base"]["pattern"]
    d_pattern = runs["source"]["pattern"] - base_patterns
    out["pattern"] = torch.stack([torch.einsum("bhqs,bhqs->h", d_pattern[:, l], g["pattern"][l]) for l in range(L)])
    # AtP*'s query-key correction: each head's pattern with its query (key) read from the other run's stream,
    # computed exactly by the oracle, its change dotted with the gradient at the pattern
    streams = runs["source"]["pre"]  # [L] x [b, pos, d]: the other run's stream before each layer
    for via in "QK":
        est = torch.zeros(L, model.cfg.n_heads, dtype=torch.float64)
        for l in range(L):
            for h in range(model.cfg.n_heads):
                def swap(at, v, x, l=l, h=h, via=via):
                    if at == l and v == via:
                        x = x.clone()
                        x[:, h] = streams[l]
                    return x
                patched = oracle(model, base, inputs=swap)["patterns"][:, l, h]
                est[l, h] = ((patched - base_patterns[:, l, h]) * g["pattern"][l][:, h]).sum()
        out[f"{via.lower()}_input"] = est
    if not model.cfg.attn_only:
        d_act = [runs["source"]["act"][l] - runs["base"]["act"][l] for l in range(L)]
        out["mlp_out"] = torch.stack([torch.einsum("bpn,bpn->p", d_act[l], g["act"][l]) for l in range(L)])
        out["neuron"] = torch.stack([torch.einsum("bpn,bpn->n", d_act[l], g["act"][l]) for l in range(L)])
    return out


def tolerance(model, task, magnitude: float) -> float:
    """Two float64 computations of a forward's length of roundings at ``magnitude``, on the normalised scale."""
    n = model_forward_length(model.cfg, task.n_pos) + model.cfg.d_model * task.n_pos * len(task.tokens_clean)
    return chain_tol(n, magnitude, torch.float64) / abs(task.metric_clean - task.metric_corrupted)


@pytest.mark.parametrize("which", ["shipped", "gpt2"])
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_every_site_equals_the_float64_autograd_oracle(which, direction, model, induction, gpt2_64):
    m, task = (model, induction) if which == "shipped" else gpt2_64
    want_all = oracle_estimates(m, task, direction)
    start = task.metric_corrupted if direction == "denoise" else task.metric_clean
    for site in SITES:
        if site in ("mlp_out", "neuron") and m.cfg.attn_only:
            continue
        got = attribution_patch(m, task, site, direction)
        want = task.normalise(start + want_all[site])
        assert got.dims == SITES[site] and got.scores.shape == want.shape and got.scores.dtype == torch.float64
        tol = tolerance(m, task, 1.0 + float(want_all[site].abs().max()))
        assert float((got.scores - want).abs().max()) <= tol, (site, direction, got.scores, want)


@pytest.mark.parametrize("which", ["shipped", "gpt2"])
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_graddrop_equals_the_oracle_with_each_layer_detached(which, direction, model, induction, gpt2_64):
    # each of the L estimates: the oracle's gradients with that layer's heads and neurons detached (its own
    # cells then get none: the oracle's zeros cut off), dotted with the same activation differences
    m, task = (model, induction) if which == "shipped" else gpt2_64
    L, span = m.cfg.n_layers, task.metric_clean - task.metric_corrupted
    dropped = [oracle_estimates(m, task, direction, drop) for drop in range(L)]
    for site in GRADDROP_SITES:
        if site in ("mlp_out", "neuron") and m.cfg.attn_only:
            continue
        got = attribution_patch(m, task, site, direction, graddrop=True)
        want = torch.stack([d[site] for d in dropped]) / span  # [L, *shape]
        tol = tolerance(m, task, 1.0 + float(want.abs().max() * abs(span)))
        assert got.dropped.shape == (L, *got.scores.shape) and got.dropped.dtype == torch.float64
        assert float((got.dropped - want).abs().max()) <= tol, (site, direction, got.dropped, want)
        # the score: the magnitudes' sum over the layers, over the L - 1 that are not a cell's own
        assert float((got.graddrop - want.abs().sum(0) / (L - 1)).abs().max()) <= L / (L - 1) * tol, site
        assert torch.equal(got.scores, attribution_patch(m, task, site, direction).scores), site


def cancelling_model():
    """Two attention-only layers of one head, no norm and no positions, one-token prompts (each head reads
    its own token): the embedding is ``a e0 + c e2``; head 0.0 writes ``a e1``; head 1.0 writes minus the
    ``e1`` component of its input, ``-a e1``. Head 0.0's output reaches the logits directly (the
    unembedding reads ``e1``) and through head 1.0, the two cancelling exactly; ``c`` (``e2``) carries the
    task's behaviour."""
    cfg = ModelConfig(n_layers=2, n_heads=1, d_model=3, d_head=1, d_vocab=4, n_ctx=4, positional="none",
                      normalization=None)
    e = torch.eye(3, dtype=torch.float64)
    W_E = torch.tensor([[1.0, 0, 0.5], [2.0, 0, -1.0], [0.0, 0, 0], [0.0, 0, 0]], dtype=torch.float64)
    W_U = torch.tensor([[0.3, -0.2, 0, 0], [1.0, -1.5, 0, 0], [1.5, -0.5, 0, 0]], dtype=torch.float64)
    W_V = torch.stack([e[:, :1], e[:, 1:2]])[:, None]  # [L, H, d_model, d_head]: head 0.0 reads e0, 1.0 reads e1
    W_O = torch.stack([e[1:2], -e[1:2]])[:, None]  # [L, H, d_head, d_model]: both write to e1, 1.0 negated
    W_Q = W_K = torch.zeros(2, 1, 3, 1, dtype=torch.float64)
    return CircuitModel(cfg, tokenizer=IdTokenizer(), W_E=W_E, W_U=W_U, W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O)


def test_graddrop_finds_a_head_whose_two_paths_cancel():
    m = cancelling_model()
    task = Task(m, [[0]], [[1]], answers=[(0, 1)])
    plain = attribution_patch(m, task, "head_out", graddrop=True)
    # the corrupted run to the clean one moves head 0.0's output by (1 - 2) e1: the direct path's change
    # of the logit difference is that times (W_U[1, 0] - W_U[1, 1]); through head 1.0 the opposite
    span = task.metric_clean - task.metric_corrupted
    direct = (1.0 - 2.0) * float(m.W_U[1, 0] - m.W_U[1, 1]) / span
    tol = tolerance(m, task, 1.0 + abs(direct * span))
    assert abs(float(plain.scores[0, 0])) <= tol  # the gradient at head 0.0's output: its two paths cancel
    # layer 1 dropped: the direct path alone; layer 0 dropped: head 0.0's own output, no gradient
    assert abs(float(plain.dropped[1, 0, 0]) - direct) <= tol and float(plain.dropped[0, 0, 0]) == 0
    assert abs(float(plain.graddrop[0, 0]) - abs(direct)) <= tol and abs(direct) > 0.1


def test_graddrop_is_refused_where_it_does_not_apply(model, induction):
    with pytest.raises(ValueError, match=r"graddrop is for the sites \('resid_pre'.*got 'k_input'"):
        attribution_patch(model, induction, "k_input", graddrop=True)
    with pytest.raises(TypeError, match="graddrop must be True or False, got 'yes'"):
        attribution_patch(model, induction, "head_out", graddrop="yes")
    one = custom_model(n_layers=1, n_heads=1, d_model=3, d_head=1, d_vocab=4, n_ctx=4)
    task = Task(one, [[0, 1]], [[2, 1]], answers=[(0, 1)])
    with pytest.raises(ValueError, match="scores a cell over the other layers; 'model' has 1"):
        attribution_patch(one, task, "head_out", graddrop=True)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_exact_neuron_patching_equals_the_oracle_and_top_patches_the_estimates_first(gpt2_64, direction, monkeypatch):
    m, task = gpt2_64
    base, source = ((task.tokens_corrupted, task.tokens_clean) if direction == "denoise"
                    else (task.tokens_clean, task.tokens_corrupted))
    acts = []
    oracle(m, source, neurons=lambda layer, act: acts.append(act.clone()) or act)
    every = activation_patch(m, task, "neuron", direction)
    assert every.dims == ("layer", "neuron") and every.scores.shape == (m.cfg.n_layers, m.cfg.d_mlp)
    tol = 2 * logit_tol(m, task.clean, task.n_pos, torch.float64) / abs(task.metric_clean - task.metric_corrupted)
    for layer, n in ((0, 0), (0, 17), (1, 5), (1, m.cfg.d_mlp - 1)):
        def swap(at, act, layer=layer, n=n):
            if at == layer:
                act = act.clone()
                act[..., n] = acts[layer][..., n]
            return act
        want = task.normalise(float(logit_diff(oracle(m, base, neurons=swap)["logits"], task)))
        assert abs(float(every.scores[layer, n]) - want) <= tol, (layer, n)
    top = activation_patch(m, task, "neuron", direction, top=3)
    estimate = attribution_patch(m, task, "neuron", direction).scores
    unpatched = 0.0 if direction == "denoise" else 1.0
    for layer in range(m.cfg.n_layers):
        chosen = torch.isfinite(top.scores[layer]).nonzero().flatten()
        assert len(chosen) == 3 and set(chosen.tolist()) == set((estimate[layer] - unpatched).abs().topk(3).indices.tolist())
        assert torch.equal(top.scores[layer, chosen], every.scores[layer, chosen])
    with pytest.raises(ValueError, match="top is an int >= 1 for site 'neuron'"):
        activation_patch(m, task, "head_out", top=3)
    from pycircuits_widgets.analysis import patching
    monkeypatch.setattr(patching, "EVERY_NEURON_MAX", m.cfg.n_layers * m.cfg.d_mlp - 1)  # (a larger model's)
    with pytest.raises(ValueError, match="is a forward each .*: pass top=k"):
        activation_patch(m, task, "neuron", direction)


def test_the_estimate_agrees_with_exact_patching_on_the_known_circuit(model, induction):
    """On the shipped model's induction task the heads' outputs are nearly linear in their effect: the
    estimate ranks the heads as exact patching does and finds its top cells."""
    exact = activation_patch(model, induction, "head_out")
    estimate = attribution_patch(model, induction, "head_out")
    agreement = estimate.agreement(exact, k=4)
    assert agreement.rank_correlation > 0.5 and agreement.top_k_overlap >= 0.5, agreement
    assert len(agreement.worst) == 5 and all(len(w) == 3 for w in agreement.worst)
    _cell, ours, theirs = agreement.worst[0]
    assert abs(ours - theirs) == pytest.approx(float((estimate.scores - exact.scores).abs().max()))
    # the induction heads' keys and queries: through the pattern recomputed exactly (AtP*), the estimate
    # finds exact patching's top 4 (plain first-order attribution: Spearman 0.17 and 0.02 here)
    for site in ("k_input", "q_input"):
        agreement = attribution_patch(model, induction, site).agreement(activation_patch(model, induction, site), k=4)
        assert agreement.rank_correlation > 0.8 and agreement.top_k_overlap == 1.0, (site, agreement)


def test_bad_input_is_refused_by_name(model, induction):
    with pytest.raises(ValueError, match="site must be one of"):
        attribution_patch(model, induction, "embed")
    with pytest.raises(ValueError, match="direction must be one of"):
        attribution_patch(model, induction, "head_out", "sideways")
    for site in ("mlp_out", "neuron"):
        with pytest.raises(ValueError, match=f"site '{site}' needs MLPs"):
            attribution_patch(model, induction, site)
    floats = Task(model, induction.tokens_clean, induction.tokens_corrupted,
                  answers=[tuple(map(int, a)) for a in induction.answer_ids],
                  metric=lambda logits, task: logit_diff(logits, task).detach().item())
    with pytest.raises(TypeError, match="its gradient is taken"):
        attribution_patch(model, floats, "head_out")
    exact = activation_patch(model, induction, "attn_out")
    with pytest.raises(ValueError, match="agreement: exact must be activation_patch"):
        attribution_patch(model, induction, "head_out").agreement(exact)
    assert N_PROMPTS == len(induction.tokens_clean)
