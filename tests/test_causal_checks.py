"""The causal checks section on its own (``pcw.CausalChecks(model, text)``), the run it writes
(``core.shown_run.ShownRun``), and the explorer's declared links (``registry.LINKS``).

The explorer's use of it (the loss, attention and induction sections showing the ablated run) is in
``test_explorer_ablation.py``; here the view is checked against ``pcw.ablate`` and
``pcw.head_loss_changes`` given the same clean run (the same computation by construction: bit-equal).
"""

import numpy as np
import pytest
import torch
import traitlets

import pycircuits_widgets as pcw
from pycircuits_widgets.demo import SAMPLE_TEXT
from pycircuits_widgets.widgets.core.shown_run import ShownRun
from pycircuits_widgets.widgets.views.registry import BY_NAME, EXPLORER, LINKS, VIEWS
from random_models import paper_model
from runner_loop import WAIT, manual_kernel_loop  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def model():
    return pcw.load_pretrained("attn-only-2l")


def test_ablating_the_selected_head_writes_the_ablated_run_and_off_the_clean_one(model):
    view = pcw.CausalChecks(model, SAMPLE_TEXT, layer=1, head=6)
    clean = view.run.clean
    assert view.run.shown.result is None and view.ablated == ""
    view.ablation = "zero"
    expected = pcw.ablate(model, clean.tokens, heads=[(1, 6)], clean=clean)
    shown = view.run.shown
    assert shown.label == view.ablated == "ablated: L1.H6 (zero)"
    assert torch.equal(shown.result.loss, expected.loss) and shown.clean is clean
    view.head = 2  # another head while on: ablates that
    assert view.ablated == "ablated: L1.H2 (zero)"
    assert torch.equal(view.run.shown.result.loss, pcw.ablate(model, clean.tokens, heads=[(1, 2)], clean=clean).loss)
    view.ablation = "off"
    assert view.run.shown.result is None and view.ablated == "" and view.run.clean is clean


def test_the_head_loss_table_is_head_loss_changes_and_a_script_computes_it_only_when_asked(model):
    view = pcw.CausalChecks(model, SAMPLE_TEXT)
    assert view.head_loss_change is None  # a script computes nothing in the background
    view.compute_head_loss_change()
    clean = view.run.clean
    assert np.array_equal(view.head_loss_change, pcw.head_loss_changes(model, clean.tokens, clean=clean).numpy())
    assert view.progress == {}


def test_under_a_kernel_a_new_text_restarts_the_table_and_the_ablation(model, manual_kernel_loop):
    run = ShownRun()
    run.read(SAMPLE_TEXT, pcw.run(model, SAMPLE_TEXT))
    view = pcw.CausalChecks(model, run, layer=0, head=4, ablation="zero")
    assert view.wait_background(WAIT)
    text = "def f(x):\n    return x + 1\n"
    run.read(text, pcw.run(model, text))
    assert view.head_loss_change is None  # of the old text: dropped at once
    assert view.wait(WAIT) and view.wait_background(WAIT)
    clean = run.clean
    assert np.array_equal(view.head_loss_change, pcw.head_loss_changes(model, clean.tokens, clean=clean).numpy())
    assert run.shown.text == text and view.ablated == "ablated: L0.H4 (zero)"
    assert torch.equal(run.shown.result.loss, pcw.ablate(model, clean.tokens, heads=[(0, 4)], clean=clean).loss)


def test_a_result_of_a_replaced_text_is_not_shown():
    run = ShownRun()
    run.read("a", object())
    assert not run.show("b", "ablated: L0.H0 (zero)", object(), by=None)
    assert run.shown.text == "a" and run.shown.result is None


@pytest.mark.parametrize("kind, text, message", [
    ("mean", SAMPLE_TEXT, "mean ablation needs a sweep"),
    ("zero", "x", "needs at least 2 tokens; the text has 1"),
])
def test_an_ablation_it_cannot_make_is_refused_by_name_and_the_toggle_stays(model, kind, text, message):
    view = pcw.CausalChecks(model, text)
    with pytest.raises(traitlets.TraitError, match=message):
        view.ablation = kind
    assert view.ablation == "off" and view.run.shown.result is None


def test_from_the_browser_only_the_selection_and_the_toggle_are_writable(model):
    view = pcw.CausalChecks(model, SAMPLE_TEXT)
    view.set_state({"head_loss_change": None, "ablated": "forged"})
    assert view.ablated == "" and "cannot be set from the browser" in view.error
    view.set_state({"ablation": "zero"})
    assert view.ablated == "ablated: L0.H0 (zero)" and view.error == ""


def test_every_declared_link_names_a_section_and_traits_it_has():
    """A link is data: one naming a section or a trait that does not exist would never fire, silently."""
    assert LINKS
    for link in LINKS:
        cls = pcw.CircuitExplorer if link.source == EXPLORER else BY_NAME[link.source].cls
        assert all(cls.class_traits().get(name) is not None for name in link.traits), link
    for spec in VIEWS:
        for name in spec.options:
            assert spec.cls.class_traits().get(name) is not None, (spec.name, name)


def test_a_section_closed_while_its_run_is_shown_leaves_the_clean_run_and_follows_no_text(model):
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT, layer=1, head=6)
    section = explorer.causal
    section.ablation = "zero"
    assert explorer.attention.run_label == "ablated: L1.H6 (zero)"
    section.close()
    assert explorer.causal is None and explorer.attention.run_label == "" and explorer.run.shown.result is None
    explorer.text = "x = 1\ny = 2\n"  # the closed section computes nothing for it
    assert explorer.run.shown.result is None and section.head_loss_change is None


def test_an_ablation_asked_of_a_model_without_heads_is_refused_naming_the_section():
    model = paper_model(n_layers=0, dtype=torch.float32)
    assert set(pcw.CircuitExplorer(model, "t1 t2 t3", ablation="off").views()) == {"loss", "bigrams"}
    with pytest.raises(ValueError, match=r"ablation='zero' is an option of the causal checks section, which this "
                                         r"model has not: No causal checks: .*n_layers=0"):
        pcw.CircuitExplorer(model, "t1 t2 t3", ablation="zero")
