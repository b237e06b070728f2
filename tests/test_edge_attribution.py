"""Edges and a circuit (issue 53 item 4): edge attribution patching (EAP, EAP-IG) and a circuit's faithfulness.

Oracles, written here and independent of ``analysis/edges.py`` and of the model's forward:

* the graph: every edge listed from its definition (each upstream node writing before the input reads);
* the scores: the float64 forward of ``test_interventions.oracle`` (each head on its own), its hooks adding
  zeros that require grad to each head's query, key and value input stream, each MLP's input and the final
  stream; torch's autograd gives ``dm/dx_d`` on the clean run (EAP) or on each run whose embedding lies
  ``k / steps`` of the way from the corrupted one to the clean one (EAP-IG, the resid hook setting it), and
  each edge's score is ``(a_u(corrupted) - a_u(clean)) . mean_k dm/dx_d``, the outputs ``a_u`` read from
  the oracle's own runs;
* the faithfulness: the oracle's clean run whose hooks build every input from its definition, as the run
  goes: the stream less, for each edge left out of the circuit, the upstream node's output in this run
  (recorded by the hooks) minus its output in the oracle's corrupted run. And two identities through the
  separately tested exact patching: every edge but those out of one head is the clean run with that head's
  output from the corrupted run (``activation_patch(site="head_out", direction="noise")``), every edge but
  those into one head's key input the key input from the corrupted run (``site="k_input"``).

Tolerances: both sides float64. A score is a sum of ``b * pos * d_model`` products of an output difference
and a gradient each reached through a forward's chain of roundings: ``chain_tol`` of the forward's length
plus that sum's, at the sum of the products' absolute values. A faithfulness metric: two forwards' logits
(``logit_tol``, twice: two computations), as the exact patching tests.
"""

import math

import pytest
import torch

import pycircuits_widgets as pcw
from family_configs import tiny_model
from pycircuits_widgets.analysis.edges import Circuit, EdgeAttribution, Faithfulness, edge_attribution
from pycircuits_widgets.analysis.patching import Task, activation_patch, logit_diff
from pycircuits_widgets.models.interventions import Interventions
from test_attribution import gpt2_64  # noqa: F401 (fixture)
from test_interventions import oracle
from test_patching import model  # noqa: F401 (fixture)
from tolerance import chain_tol, logit_tol, model_forward_length

INDUCTION_HEADS = (2, 3, 5, 6, 7)
"""The shipped attn-only-2l's induction heads in layer 1 (its previous-token head: L0.H4)."""


@pytest.fixture(scope="module")
def induction_keys(model):
    """A random sequence, then its repeat (clean); the corrupted prompt has the first occurrence replaced by
    other random tokens and the same repeat, so its induction predicts the other sequence's next token: the
    answer is the token the clean prompt's induction predicts against that one. What differs is where the
    induction heads look (the key: which token came before), not what they look for (the query)."""
    g = torch.Generator().manual_seed(1)
    first, other = torch.randint(100, 1000, (16, 10), generator=g), torch.randint(100, 1000, (16, 10), generator=g)
    return Task(model, torch.cat([first, first[:, :-1]], 1), torch.cat([other, first[:, :-1]], 1),
                answers=[(int(a), int(b)) for a, b in zip(first[:, -1], other[:, -1])])


@pytest.fixture(scope="module")
def small_task(model):
    g = torch.Generator().manual_seed(2)
    first, other = torch.randint(100, 1000, (3, 5), generator=g), torch.randint(100, 1000, (3, 5), generator=g)
    return Task(model, torch.cat([first, first[:, :-1]], 1), torch.cat([other, first[:, :-1]], 1),
                answers=[(int(a), int(b)) for a, b in zip(first[:, -1], other[:, -1])])


def graph(cfg):
    """``(upstream names, [(downstream, via, [upstream it reads])])`` from the definition."""
    L, H, mlps = cfg.n_layers, cfg.n_heads, not cfg.attn_only
    upstream, inputs = ["embed"], []
    for layer in range(L):
        for via in "QKV":
            for h in range(H):
                inputs.append((f"L{layer}.H{h}", via, list(upstream)))
        upstream += [f"L{layer}.H{h}" for h in range(H)]
        if mlps:
            inputs.append((f"MLP{layer}", "mlp", list(upstream)))
            upstream.append(f"MLP{layer}")
    inputs.append(("logits", "logits", list(upstream)))
    return upstream, inputs


def oracle_outputs(model, tokens) -> dict:
    """``{upstream node: [b, pos, d_model]}``: each node's output in the oracle's run of ``tokens``."""
    seen = {}
    out = oracle(model, tokens, resid=lambda layer, x: seen.setdefault("embed", x) if layer == 0 else x)
    for layer in range(model.cfg.n_layers):
        for h in range(model.cfg.n_heads):
            seen[f"L{layer}.H{h}"] = out["head_out"][:, layer, h]
        if out["mlp_out"] is not None:
            seen[f"MLP{layer}"] = out["mlp_out"][:, layer]
    return seen


def oracle_gradients(model, task, embed=None) -> dict:
    """``{(downstream, via): dm/dx [b, pos, d_model]}`` on the oracle's clean run (``embed``: with that
    embedding)."""
    leaves = {}

    def on_inputs(layer, via, x):  # [b, H, pos, d]
        leaf = torch.zeros(x.shape, dtype=torch.float64, requires_grad=True)
        leaves[layer, via] = leaf
        return x + leaf

    def on_stream(name):
        def hook(*args):
            x = args[-1]
            leaf = torch.zeros(x.shape, dtype=torch.float64, requires_grad=True)
            leaves[name if len(args) == 1 else (args[0], name)] = leaf
            return x + leaf
        return hook

    hooks = {"inputs": on_inputs, "final": on_stream("logits")}
    if not model.cfg.attn_only:
        hooks["mlp_input"] = on_stream("mlp")
    if embed is not None:
        hooks["resid"] = lambda layer, x: embed if layer == 0 else x
    with torch.enable_grad():
        value = logit_diff(oracle(model, task.tokens_clean, **hooks)["logits"], task)
        grads = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))
    out = {}
    for key, g in grads.items():
        if key == "logits":
            out["logits", "logits"] = g
        elif key[1] == "mlp":
            out[f"MLP{key[0]}", "mlp"] = g
        else:
            for h in range(model.cfg.n_heads):
                out[f"L{key[0]}.H{h}", key[1]] = g[:, h]
    return out


def oracle_scores(model, task, steps=None):
    """``(edges, scores [n], magnitudes [n])``: EAP (``steps`` None) or EAP-IG's score of every edge, and the
    sum of its products' absolute values."""
    clean, corrupted = oracle_outputs(model, task.tokens_clean), oracle_outputs(model, task.tokens_corrupted)
    if steps is None:
        grads = oracle_gradients(model, task)
    else:
        runs = [oracle_gradients(model, task, corrupted["embed"] + k / steps * (clean["embed"] - corrupted["embed"]))
                for k in range(1, steps + 1)]
        grads = {key: sum(run[key] for run in runs) / steps for key in runs[0]}
    edges, scores, magnitudes = [], [], []
    for down, via, ups in graph(model.cfg)[1]:
        g = grads[down, via]
        for u in ups:
            diff = corrupted[u] - clean[u]
            edges.append((u, down, via))
            scores.append(float((diff * g).sum()))
            magnitudes.append(float((diff * g).abs().sum()))
    return edges, torch.tensor(scores, dtype=torch.float64), torch.tensor(magnitudes, dtype=torch.float64)


def score_tol(model, task, magnitudes):
    n = model_forward_length(model.cfg, task.n_pos) + model.cfg.d_model * task.n_pos * len(task.tokens_clean)
    return chain_tol(n, 1.0, torch.float64) * (magnitudes + 1e-3 * magnitudes.max())


@pytest.mark.parametrize("which", ["shipped", "gpt2"])
@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_every_edge_score_equals_the_float64_autograd_oracle(which, method, model, small_task, gpt2_64):
    m, task = (model, small_task) if which == "shipped" else gpt2_64
    steps = 3 if method == "eap-ig" else None
    got = edge_attribution(m, task, method, steps)
    edges, want, magnitudes = oracle_scores(m, task, steps)
    assert isinstance(got, EdgeAttribution) and got.method == method and got.steps == (steps or 1)
    assert list(got.edges) == edges  # the graph, edge for edge, in the documented order
    assert got.scores.shape == (len(edges),) and got.scores.dtype == torch.float64
    assert float(want.abs().max()) > 0.1  # (scores that say something)
    gap = (got.scores - want).abs()
    tol = score_tol(m, task, magnitudes)
    assert bool((gap <= tol).all()), (method, [(edges[i], float(got.scores[i]), float(want[i]))
                                               for i in gap.argsort(descending=True)[:5].tolist()])
    assert got.score(*edges[7]) == float(got.scores[7])
    top = got.top(3)
    assert [abs(s) for *_, s in top] == sorted(float(x) for x in got.scores.abs().topk(3).values)[::-1]


def test_eap_ig_with_one_step_is_eap(model, small_task):
    eap, ig = edge_attribution(model, small_task), edge_attribution(model, small_task, "eap-ig", 1)
    assert ig.steps == 1 and torch.equal(eap.scores, ig.scores)  # lerp at weight 1 is the clean embedding itself


def oracle_circuit_metric(model, task, kept: set) -> float:
    """The logit difference of the oracle's clean run in which every input is its stream less, over its edges
    outside ``kept``, the upstream node's output in this run minus its corrupted run's."""
    corrupted = oracle_outputs(model, task.tokens_corrupted)
    reads = {(down, via): ups for down, via, ups in graph(model.cfg)[1]}
    here = {}
    W_out = None if model.cfg.attn_only else model.W_out.double()
    b_out = None if model.b_out is None else model.b_out.double()

    def less(down, via, x):
        for u in reads[down, via]:
            if (u, down, via) not in kept:
                x = x - (here[u] - corrupted[u])
        return x

    def resid(layer, x):
        if layer == 0:
            here["embed"] = x
        return x

    def inputs(layer, via, x):
        return torch.stack([less(f"L{layer}.H{h}", via, x[:, h]) for h in range(x.shape[1])], 1)

    def head_out(layer, out):
        for h in range(out.shape[1]):
            here[f"L{layer}.H{h}"] = out[:, h]
        return out

    def neurons(layer, act):  # the oracle's own MLP output formula
        here[f"MLP{layer}"] = act @ W_out[layer] + (0 if b_out is None else b_out[layer])
        return act

    hooks = {"resid": resid, "inputs": inputs, "head_out": head_out, "final": lambda x: less("logits", "logits", x)}
    if not model.cfg.attn_only:
        hooks.update(neurons=neurons, mlp_input=lambda layer, x: less(f"MLP{layer}", "mlp", x))
    return float(logit_diff(oracle(model, task.tokens_clean, **hooks)["logits"], task))


def metric_tol(model, task) -> float:
    return 2 * logit_tol(model, task.clean, task.n_pos, torch.float64)


@pytest.mark.parametrize("which", ["shipped", "gpt2"])
def test_faithfulness_equals_the_oracle_circuit_run(which, model, small_task, gpt2_64):
    m, task = (model, small_task) if which == "shipped" else gpt2_64
    result = edge_attribution(m, task)
    n = len(result.edges)
    g = torch.Generator().manual_seed(3)
    circuits = [result.circuit(top_n=n // 10), result.circuit(top_n=n // 3),
                result.circuit(edges=[result.edges[i] for i in torch.randperm(n, generator=g)[: n // 2].tolist()]),
                result.circuit(edges=[result.edges[i] for i in torch.randperm(n, generator=g)[: n // 5].tolist()])]
    tol = metric_tol(m, task)
    for circuit in circuits:
        f = result.faithfulness(circuit)
        want = oracle_circuit_metric(m, task, set(circuit.edges))
        assert isinstance(f, Faithfulness) and f.edges == len(circuit) and f.total == n
        assert abs(f.metric - want) <= tol, (len(circuit), f.metric, want)
        assert float(f) == f.score == pytest.approx(task.normalise(f.metric), abs=1e-12)
        assert (f.metric_clean, f.metric_corrupted) == (task.metric_clean, task.metric_corrupted)
    # every edge: the clean run; none: the corrupted run
    assert abs(result.faithfulness(result.circuit(top_n=n)).metric - task.metric_clean) <= tol
    assert abs(result.faithfulness(result.circuit(top_n=0)).metric - task.metric_corrupted) <= tol
    assert abs(result.faithfulness(result.circuit(threshold=math.inf)).metric - task.metric_corrupted) <= tol


@pytest.mark.parametrize("which", ["shipped", "gpt2"])
def test_a_pruned_circuit_keeps_only_paths_to_the_logits_and_its_faithfulness(which, model, small_task, gpt2_64):
    """``prune=True`` drops edges into nodes whose output the circuit carries nowhere: checked by walking the
    kept edges back from the logits here, and by the faithfulness, which what such an edge carries cannot
    change (the same run: within the forward's rounding)."""
    m, task = (model, small_task) if which == "shipped" else gpt2_64
    result = edge_attribution(m, task)
    tol = metric_tol(m, task)
    g = torch.Generator().manual_seed(5)
    n = len(result.edges)
    for chosen in (result.circuit(top_n=n // 4).edges,
                   [result.edges[i] for i in torch.randperm(n, generator=g)[: n // 3].tolist()]):
        full, pruned = result.circuit(edges=chosen), result.circuit(edges=chosen, prune=True)
        reaching, frontier = set(), {"logits"}
        while frontier:  # the nodes with a kept path to the logits, walked back edge by edge
            reaching |= frontier
            frontier = {u for u, d, _ in full.edges if d in frontier} - reaching
        assert set(pruned.edges) == {e for e in full.edges if e[1] in reaching}
        assert len(pruned) < len(full)  # (these circuits have dangling edges to drop)
        assert all(pruned.scores[i] == result.score(*e) for i, e in enumerate(pruned.edges))
        assert abs(result.faithfulness(pruned).metric - result.faithfulness(full).metric) <= tol
    with pytest.raises(TypeError, match="prune must be True or False"):
        result.circuit(top_n=3, prune="yes")


def test_faithfulness_of_all_edges_but_one_nodes_is_exact_patching_of_that_node(model, small_task):
    task = small_task
    result = edge_attribution(model, task)
    scale = abs(task.metric_clean - task.metric_corrupted)
    heads = activation_patch(model, task, "head_out", "noise").scores
    keys = activation_patch(model, task, "k_input", "noise").scores
    tol = 2 * metric_tol(model, task) / scale
    for layer, head in ((0, 4), (1, 5), (0, 1)):
        name = f"L{layer}.H{head}"
        without_out = result.circuit(edges=[e for e in result.edges if e[0] != name])
        assert abs(float(result.faithfulness(without_out)) - float(heads[layer, head])) <= tol, name
        without_key = result.circuit(edges=[e for e in result.edges if e[1:] != (name, "K")])
        assert abs(float(result.faithfulness(without_key)) - float(keys[layer, head])) <= tol, name


def test_read_taps_equal_the_oracle_with_those_inputs_changed(gpt2_64):
    m, task = gpt2_64
    c, tokens = m.cfg, task.tokens_clean
    b, pos = tokens.shape
    g = torch.Generator().manual_seed(4)
    q_delta = 0.3 * torch.randn(b, c.n_heads, pos, c.d_model, generator=g, dtype=torch.float64)
    mlp_delta = 0.3 * torch.randn(b, pos, c.d_model, generator=g, dtype=torch.float64)
    final_delta = 0.3 * torch.randn(b, pos, c.d_model, generator=g, dtype=torch.float64)
    taps = {(1, "K"): q_delta, (0, "mlp_in"): mlp_delta, (1, "post"): final_delta}
    logits, cache = m.run_with_cache(tokens, Interventions(taps=taps))
    want = oracle(m, tokens, inputs=lambda layer, via, x: x + q_delta if (layer, via) == (1, "K") else x,
                  mlp_input=lambda layer, x: x + mlp_delta if layer == 0 else x, final=lambda x: x + final_delta)
    tol = 2 * logit_tol(m, cache, pos, torch.float64)
    assert float((logits - want["logits"]).abs().max()) <= tol
    assert float((logits - m.run_with_cache(tokens)[0]).abs().max()) > 100 * tol  # (they change the run)
    resumed, _ = m.run_with_cache(tokens, Interventions(taps=taps), resume=task.clean)
    assert torch.equal(resumed, logits)


def test_the_shipped_model_finds_its_induction_circuit(model, induction_keys):
    """L0.H4 (previous token) into the keys of the induction heads L1.H2/3/5/6/7, and those heads to the logits.
    Measured (this task, EAP, 257 edges, float32 and float64 alike): the five key edges rank 9, 21, 28, 31, 40
    by |score| (from 0); L1.H5, H3, H2, H7, H6 to the logits 5, 6, 10, 13, 24; the top 10 edges keep 0.00 of
    the behaviour, the top 60 0.69, 100 0.81, 120 0.91, 160 0.98."""
    result = edge_attribution(model, induction_keys)
    order = torch.argsort(result.scores.abs(), descending=True).tolist()
    rank = {result.edges[i]: k for k, i in enumerate(order)}
    keys = [("L0.H4", f"L1.H{h}", "K") for h in INDUCTION_HEADS]
    assert all(rank[e] < 50 for e in keys), {e: rank[e] for e in keys}
    assert all(result.score(*e) < 0 for e in keys)  # corrupting each lowers the logit difference
    to_logits = [rank[f"L1.H{h}", "logits", "logits"] for h in INDUCTION_HEADS]
    assert sum(r < 15 for r in to_logits) >= 3, to_logits
    top = result.circuit(top_n=120)
    assert set(keys) <= set(top.edges)
    assert {"L0.H4", *(f"L1.H{h}" for h in INDUCTION_HEADS), "logits"} <= set(top.nodes)
    assert top.ranks["embed"] == 0 and top.ranks["L0.H4"] == 1 and top.ranks["L1.H5"] == 3 and top.ranks["logits"] == 5
    assert float(result.faithfulness(top)) >= 0.8
    assert float(result.faithfulness(result.circuit(top_n=10))) < 0.5  # (a few edges are not the behaviour)


def test_bad_input_is_refused_by_name(model, small_task):
    task = small_task
    with pytest.raises(ValueError, match="method must be one of"):
        edge_attribution(model, task, "acdc")
    for steps in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="steps must be an int >= 1"):
            edge_attribution(model, task, "eap-ig", steps)
    with pytest.raises(ValueError, match="method 'eap' takes the gradient on the clean run alone"):
        edge_attribution(model, task, "eap", 4)
    with pytest.raises(TypeError, match="task must be the pcw.Task of this model"):
        edge_attribution(model, "a task")
    with pytest.raises(TypeError, match="another model"):
        edge_attribution(model.to(torch.float32), task)
    with pytest.raises(ValueError, match="corrupted must be one or more prompts"):
        Task(model, task.tokens_clean, [], answers=[(1, 2)] * 3)  # an empty task
    answers = [tuple(map(int, a)) for a in task.answer_ids]
    floats = Task(model, task.tokens_clean, task.tokens_corrupted, answers=answers,
                  metric=lambda logits, t: logit_diff(logits, t).detach().item())
    with pytest.raises(TypeError, match="edge_attribution: the task's metric must give a scalar tensor"):
        edge_attribution(model, floats)
    # a metric finite on the clean and corrupted runs (no gradient taken) but NaN where its gradient is
    nan = Task(model, task.tokens_clean, task.tokens_corrupted, answers=answers,
               metric=lambda logits, t: logit_diff(logits, t) * (math.nan if logits.requires_grad else 1.0))
    with pytest.raises(ValueError, match=r"edge_attribution \(step 1 of 2, .*\): the task's metric is nan"):
        edge_attribution(model, nan, "eap-ig", 2)
    result = edge_attribution(model, task)
    with pytest.raises(ValueError, match="give exactly one of top_n, threshold or edges, got none"):
        result.circuit()
    with pytest.raises(ValueError, match="got top_n, threshold"):
        result.circuit(top_n=3, threshold=0.1)
    for top_n in (-1, len(result.edges) + 1, 2.0):
        with pytest.raises(ValueError, match=rf"top_n must be an int in 0..{len(result.edges)}"):
            result.circuit(top_n=top_n)
    for threshold in (-0.1, math.nan, "0.1"):
        with pytest.raises(ValueError, match="threshold must be a number >= 0"):
            result.circuit(threshold=threshold)
    with pytest.raises(ValueError, match="unknown upstream node 'MLP0'"):
        result.circuit(edges=[("MLP0", "logits", "logits")])  # attention-only
    with pytest.raises(ValueError, match=r"unknown input \('L1.H2', 'key'\)"):
        result.circuit(edges=[("L0.H4", "L1.H2", "key")])
    with pytest.raises(ValueError, match="no edge 'L1.H0' -> \\('L0.H3', 'Q'\\): 'L1.H0' writes after"):
        result.circuit(edges=[("L1.H0", "L0.H3", "Q")])
    with pytest.raises(ValueError, match="an edge is an \\(upstream, downstream, via\\) triple"):
        result.circuit(edges=[("L0.H4", "L1.H2")])
    with pytest.raises(TypeError, match="faithfulness: circuit must be a Circuit"):
        result.faithfulness(result.edges[:3])
    stranger = Circuit((("L0.H4", "L9.H2", "K"),), torch.zeros(1), ("L0.H4",), {})
    with pytest.raises(ValueError, match=r"faithfulness: unknown input \('L9.H2', 'K'\)"):
        result.faithfulness(stranger)
    # read taps: a head input's delta has the heads' axis; an attention-only model has no MLP input
    tokens, d = task.tokens_clean, model.cfg.d_model
    with pytest.raises(ValueError, match=r"a head input's delta is a tensor \[batch, n_heads, pos, d_model\]"):
        model.run_with_cache(tokens, Interventions(taps={(0, "Q"): torch.zeros(3, 9, d, dtype=torch.float64)}))
    with pytest.raises(ValueError, match="is attention-only \\(no MLP to tap the input of\\)"):
        model.run_with_cache(tokens, Interventions(taps={(0, "mlp_in"): torch.zeros(3, 9, d)}))
    with pytest.raises(ValueError, match="where one of \\('pre', 'mid', 'post', 'Q', 'K', 'V', 'mlp_in'\\)"):
        model.run_with_cache(tokens, Interventions(taps={(0, "q"): torch.zeros(3, 9, d)}))


def test_a_post_norm_model_is_refused():
    m = pcw.from_hf(tiny_model("gemma2"), verify=False)
    tokens = torch.randint(0, m.cfg.d_vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    task = Task(m, tokens, tokens.flip(1), answers=[(1, 2), (3, 4)])
    with pytest.raises(ValueError, match="post-norms"):
        edge_attribution(m, task)


def test_a_deeper_model_s_circuit_run_equals_the_oracle():
    """Three layers (a forward stopped early holds fewer layers' z than the model has W_O: a head's output is
    read from its own layer's), one random circuit against the oracle's run built edge by edge."""
    m = pcw.from_hf(tiny_model("gpt2", dtype=torch.float64, n_layer=3), verify=False)
    g = torch.Generator().manual_seed(5)
    first, other = torch.randint(1, m.cfg.d_vocab, (3, 4), generator=g), torch.randint(1, m.cfg.d_vocab, (3, 4), generator=g)
    task = Task(m, torch.cat([first, first[:, :-1]], 1), torch.cat([other, first[:, :-1]], 1),
                answers=[(int(a), int(b)) for a, b in zip(first[:, -1], other[:, -1])])
    _, stopped = m.run_with_cache(task.tokens_clean, layers=1, logits=False)
    assert stopped.head_out.shape[1] == 1 and torch.equal(stopped.head_out[:, 0], task.clean.head_out[:, 0])
    result = edge_attribution(m, task)
    n = len(result.edges)
    circuit = result.circuit(edges=[result.edges[i] for i in torch.randperm(n, generator=g)[: n // 2].tolist()])
    want = oracle_circuit_metric(m, task, set(circuit.edges))
    assert abs(result.faithfulness(circuit).metric - want) <= metric_tol(m, task)


def test_a_parallel_block_model_s_edges_and_circuit():
    """GPT-NeoX (attention and MLP read the same stream, rotary): an MLP reads no head of its own layer. Each
    score against its definition through one read tap ``alpha * (a_u(corrupted) - a_u(clean))`` at the input,
    differentiated in ``alpha`` (a path apart from the batched gradients and product); every edge's circuit is
    the clean run, no edge's the corrupted run, all but one head's outgoing edges exact noising of that head."""
    m = pcw.from_hf(tiny_model("gpt_neox", dtype=torch.float64), verify=False)
    assert m.cfg.parallel_attn_mlp
    g = torch.Generator().manual_seed(6)
    first, other = torch.randint(1, m.cfg.d_vocab, (3, 4), generator=g), torch.randint(1, m.cfg.d_vocab, (3, 4), generator=g)
    task = Task(m, torch.cat([first, first[:, :-1]], 1), torch.cat([other, first[:, :-1]], 1),
                answers=[(int(a), int(b)) for a, b in zip(first[:, -1], other[:, -1])])
    result = edge_attribution(m, task)
    reads = {(d, via): [u for u, d2, v2 in result.edges if (d2, v2) == (d, via)] for d, via in result.inputs}
    assert reads["MLP1", "mlp"] == ["embed", *(f"L0.H{h}" for h in range(m.cfg.n_heads)), "MLP0"]
    H = m.cfg.n_heads
    outputs = {}
    for name, cache in (("clean", task.clean), ("corrupted", task.corrupted)):
        outputs[name] = {"embed": cache.embed, **{f"L{l}.H{h}": cache.head_out[:, l, h] for l in range(2) for h in range(H)},
                         **{f"MLP{l}": cache.mlp_out[:, l] for l in range(2)}}
    n = model_forward_length(m.cfg, task.n_pos) + m.cfg.d_model * task.n_pos * len(task.tokens_clean)
    for u, d, via in [("embed", "L0.H1", "K"), ("L0.H2", "L1.H3", "Q"), ("L0.H0", "MLP1", "mlp"), ("MLP0", "L1.H1", "V"),
                      ("MLP1", "logits", "logits"), ("L1.H2", "logits", "logits")]:
        diff = outputs["corrupted"][u] - outputs["clean"][u]
        alpha = torch.zeros((), dtype=torch.float64, requires_grad=True)
        if via in "QKV":
            layer, head = int(d[1]), int(d[4:])
            delta = torch.zeros(diff.shape[0], H, *diff.shape[1:], dtype=torch.float64)
            delta[:, head] = diff
            key = (layer, via)
        else:
            delta, key = diff, ((int(d[3]), "mlp_in") if via == "mlp" else (1, "post"))
        zero = torch.zeros_like(delta, requires_grad=True)  # its gradient: dm/dx at the input, for the bound
        with torch.enable_grad():
            value = task.metric_tensor(task.tokens_clean, Interventions(taps={key: alpha * delta + zero}))
            want, grad = torch.autograd.grad(value, (alpha, zero))
        tol = chain_tol(n, 1.0, torch.float64) * (1e-3 + float((delta * grad).abs().sum()))
        assert abs(result.score(u, d, via) - float(want)) <= tol, (u, d, via, result.score(u, d, via), float(want))
    tol = metric_tol(m, task)
    assert abs(result.faithfulness(result.circuit(top_n=len(result.edges))).metric - task.metric_clean) <= tol
    assert abs(result.faithfulness(result.circuit(top_n=0)).metric - task.metric_corrupted) <= tol
    heads = activation_patch(m, task, "head_out", "noise").scores
    for layer, head in ((0, 1), (1, 2)):
        name = f"L{layer}.H{head}"
        without = result.circuit(edges=[e for e in result.edges if e[0] != name])
        got = result.faithfulness(without).metric
        assert abs(task.normalise(got) - float(heads[layer, head])) <= 2 * tol / abs(task.metric_clean - task.metric_corrupted)
