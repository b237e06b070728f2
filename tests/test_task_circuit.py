"""The task section (``pcw.TaskCircuit``, and ``CircuitExplorer(..., task=)``): its heatmaps are
``pcw.activation_patch`` and ``pcw.attribution_patch`` of the task (the same computations, run apart from
the widget: equal as sent, float32), its agreement is theirs, a switch of direction computes the other
once, a click on a head selects it everywhere, and bad input is refused by name.

The patching itself is checked against a float64 oracle in ``test_patching.py`` and
``test_attribution.py``; the page in real Chromium in ``browser/test_task_circuit_browser.py``.
"""

import numpy as np
import pytest
import torch
import traitlets

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis.patching import Task
from pycircuits_widgets.widgets.views.task_circuit import AGREEMENT_K, CIRCUIT_SIZES, FAITHFUL, SITES
from runner_loop import WAIT, manual_kernel_loop  # noqa: F401 (fixture)
from test_interventions import oracle, token_loss
from tolerance import assert_within, logit_tol

N_PROMPTS, HALF = 4, 6


@pytest.fixture(scope="module")
def model():
    return pcw.load_pretrained("attn-only-2l")


def induction_task(model, seed: int = 0) -> Task:
    """A random token sequence and its repeat (clean); the repeat replaced by other tokens (corrupted); the
    answer: the token the repeat continues with, against the corrupted sequence's."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(100, 1000, (N_PROMPTS, HALF), generator=g)
    other = torch.randint(100, 1000, (N_PROMPTS, HALF), generator=g)
    return Task(model, torch.cat([first, first[:, :-1]], 1), torch.cat([first, other[:, :-1]], 1),
                answers=[(int(first[i, -1]), int(other[i, -1])) for i in range(N_PROMPTS)])


@pytest.fixture(scope="module")
def task(model):
    return induction_task(model)


def test_the_heatmaps_are_the_patching_functions_and_the_agreement_theirs(model, task):
    view = pcw.TaskCircuit(model, task, layer=1, head=6)
    assert view.progress == {} and view.agreement.keys() == set(SITES)
    for site in SITES:
        exact = pcw.activation_patch(model, task, site, "denoise")
        estimate = pcw.attribution_patch(model, task, site, "denoise")
        assert np.array_equal(view.exact[site], exact.scores.float().numpy()), site
        assert np.array_equal(view.estimate[site], estimate.scores.float().numpy()), site
        agreement = estimate.agreement(exact, AGREEMENT_K)
        assert view.agreement[site]["rank_correlation"] == agreement.rank_correlation
        assert view.agreement[site]["top_k_overlap"] == agreement.top_k_overlap
        assert [tuple(w[0]) for w in view.agreement[site]["worst"]] == [w[0] for w in agreement.worst]
    strings = model.token_strings
    assert view.prompt["clean"] == [strings[int(i)] for i in task.tokens_clean[0]]
    assert view.prompt["answer"] == strings[int(task.answer_ids[0, 0])] and view.prompt["position"] == 2 * HALF - 2
    assert (view.prompt["metric_clean"], view.prompt["metric_corrupted"]) == (task.metric_clean, task.metric_corrupted)


def test_each_direction_is_computed_once(model, task, monkeypatch):
    view = pcw.TaskCircuit(model, task)
    denoised = {site: view.exact[site].copy() for site in SITES}
    view.direction = "noise"
    assert np.array_equal(view.exact["head_out"],
                          pcw.activation_patch(model, task, "head_out", "noise").scores.float().numpy())
    calls = []
    monkeypatch.setattr(model, "run_with_cache", lambda *a, **k: calls.append(1))
    view.direction = "denoise"
    assert calls == [] and all(np.array_equal(view.exact[site], denoised[site]) for site in SITES)


def test_under_a_kernel_the_cells_come_layer_by_layer_and_cancel_keeps_them(model, task, manual_kernel_loop):
    view = pcw.TaskCircuit(model, task)
    assert view.wait(WAIT)
    assert np.isfinite(view.exact["head_out"]).all() and view.progress == {}
    view.direction = "noise"
    view.cancel()  # before any piece: what the view showed stays
    assert view.wait(WAIT) and view.direction == "noise"


def test_in_the_explorer_a_head_clicked_in_the_task_section_is_selected_everywhere(model, task):
    text = " ".join(str(int(i)) for i in task.tokens_clean[0])
    explorer = pcw.CircuitExplorer(model, task.tokens_clean[0], task=task)
    assert explorer.task is task
    section = explorer.views()["circuit"]
    assert {s["name"] for s in explorer.sections} >= {"circuit", "causal"}
    with section.hold_trait_notifications():
        section.layer, section.head = 1, 5
    assert (explorer.layer, explorer.head) == (1, 5) and (explorer.attention.layer, explorer.attention.head) == (1, 5)
    assert explorer.text == text
    without = pcw.CircuitExplorer(model, "x = 1")
    assert "circuit" not in without.views() and "circuit" not in without.notices
    assert "circuit" not in {s["name"] for s in without.sections}


@pytest.mark.parametrize("make, error, match", [
    (lambda m, t: pcw.TaskCircuit(m, "not a task"), TypeError, "task must be the pcw.Task of this model"),
    (lambda m, t: pcw.TaskCircuit(pcw.load_pretrained("attn-only-1l"), t), TypeError, "another model"),
    (lambda m, t: pcw.TaskCircuit(m, t, direction="sideways"), ValueError, r"direction must be one of"),
    (lambda m, t: pcw.CircuitExplorer(m, "x = 1", task="t"), TypeError, r"task must be a pcw.Task"),
    (lambda m, t: pcw.CircuitExplorer(pcw.load_pretrained("attn-only-1l"), "x = 1", task=t), ValueError,
     r"the task is of another model"),
])
def test_bad_input_is_refused_by_name(model, task, make, error, match):
    with pytest.raises(error, match=match):
        make(model, task)


def test_from_the_browser_only_the_selection_and_the_direction_are_writable(model, task):
    view = pcw.TaskCircuit(model, task)
    view.set_state({"exact": {}})
    assert "cannot be set from the browser" in view.error and view.exact
    with pytest.raises(traitlets.TraitError):
        view.direction = "both"


def test_the_patched_run_is_the_clean_prompt_with_one_heads_corrupted_output(model):
    """In float64: the loss section's change is the oracle's run of the clean prompt with head L1.H6's
    output replaced by its output on the corrupted prompt, minus the clean run (each loss within twice
    ``logit_tol``, the difference four times, then one float32 rounding of the value sent)."""
    model64 = model.to(torch.float64)
    task = induction_task(model64)
    explorer = pcw.CircuitExplorer(model64, task.tokens_clean[1], task=task, layer=1, head=6)
    section = explorer.circuit
    assert section.patch_run == ""
    section.patched = True
    tokens = task.tokens_clean[1:2]
    corrupted = oracle(model64, task.tokens_corrupted[1:2])["head_out"]  # [1, L, H, pos, d_model]
    patched = oracle(model64, tokens, head_out=lambda layer, out: torch.cat(
        [out[:, :6], corrupted[:, layer, 6:7], out[:, 7:]], 1) if layer == 1 else out)
    expected = (token_loss(patched["logits"], tokens) - token_loss(oracle(model64, tokens)["logits"], tokens))[0]
    run = explorer.forward(model64, explorer.text)
    tol = 4 * logit_tol(model64, run.cache, tokens.shape[1], torch.float64)
    assert_within(torch.as_tensor(explorer.loss.values, dtype=torch.float64), expected,
                  tol + float(expected.abs().max()) * 2.0 ** -24)
    label = "patched: L1.H6 from the corrupted prompt"
    assert explorer.attention.run_label == explorer.induction.run_label == label
    assert "patched − clean" in explorer.loss.label
    # one section's run at a time: ablating takes over and the patched toggle goes off; off: the clean run
    explorer.causal.ablation = "zero"
    assert not section.patched and explorer.attention.run_label == "ablated: L1.H6 (zero)"
    section.patched = True
    assert explorer.causal.ablation == "off" and explorer.attention.run_label == label
    section.patched = False
    assert explorer.attention.run_label == "" and explorer.run.shown.result is None


def test_the_patched_run_needs_an_explorer_reading_one_of_the_tasks_prompts(model, task):
    for view in (pcw.TaskCircuit(model, task), pcw.CircuitExplorer(model, "x = 1", task=task).circuit):
        assert "needs an explorer reading one of the task's clean prompts" in view.patch_run
        with pytest.raises(traitlets.TraitError, match="patched: patching the shown run needs"):
            view.patched = True
        assert not view.patched


def test_the_circuit_graph_is_edge_attributions_top_edges_and_their_faithfulness(model, task):
    view = pcw.TaskCircuit(model, task)
    found = pcw.edge_attribution(model, task, "eap")
    shown = view.circuit
    # the sizes tried: the ladder, in order, up to the first whose faithfulness reaches the target
    tried = [n for n, _ in shown["sizes"]]
    assert tried == sorted({min(n, len(found.edges)) for n in CIRCUIT_SIZES})[:len(tried)]
    # (pruned: the edges on paths to the logits, whose faithfulness is the whole top n's)
    assert [v for _, v in shown["sizes"]] == [float(found.faithfulness(found.circuit(top_n=n, prune=True)))
                                              for n in tried]
    reached = [v >= FAITHFUL for _, v in shown["sizes"]]
    assert not any(reached[:-1]) and (reached[-1] or tried[-1] == min(max(CIRCUIT_SIZES), len(found.edges)))
    circuit = found.circuit(top_n=tried[-1], prune=True)
    assert [(e["from"], e["to"], e["via"]) for e in shown["edges"]] == list(circuit.edges)
    assert [e["score"] for e in shown["edges"]] == circuit.scores.tolist()
    assert shown["total"] == len(found.edges) and shown["method"] == "eap"
    assert shown["faithfulness"]["score"] == float(found.faithfulness(circuit))
    assert [n["name"] for n in shown["nodes"]] == list(circuit.nodes)
    assert all(n["rank"] == circuit.ranks[n["name"]] for n in shown["nodes"])
    weights = {via: pcw.composition_scores(model, via) for via in "QKV"}
    for e in shown["edges"]:  # a head -> head edge: the pair's composition, from the weights and measured
        if e["via"] in "QKV" and e["from"].startswith("L"):
            (l1, h1), (l2, h2) = (map(int, name[1:].split(".H")) for name in (e["from"], e["to"]))
            assert e["composition"] == float(weights[e["via"]][l1, h1, l2, h2])
            measured = pcw.measured_composition(model, task.tokens_clean, e["via"])
            assert e["measured"] == float(measured[l1, h1, l2, h2])
        else:
            assert "composition" not in e and "measured" not in e
