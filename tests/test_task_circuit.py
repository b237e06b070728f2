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
from runner_loop import WAIT, manual_kernel_loop  # noqa: F401 (fixture)

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis.patching import Task
from pycircuits_widgets.widgets.views.task_circuit import AGREEMENT_K, SITES

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
