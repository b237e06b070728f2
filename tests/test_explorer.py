"""CircuitExplorer (Python side): children built per model, one selection linking them,
kernel-side recomputes matching direct analysis calls, honest notices, standalone state.

Tolerances (``tests/tolerance.py``): the loss view against a float64 cross-entropy of the model's float32
logits within twice ``logit_tol`` (a log-softmax moves by at most twice its inputs' largest change; the two
forward passes' and the float32 log-softmax's rounding), the mean adding its own (``gamma(n + 1)``);
the explorer's mean loss against ``pcw.run``'s own within ``COPY``."""

import copy
import json
import re

import numpy as np
import pytest
import torch
import traitlets

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.sharing.standalone import render_html
from random_models import custom_model, paper_model
from tolerance import COPY, assert_within, gamma, logit_tol

TEXT = "t1 t2 t3 t1 t2 t3 t7 t1"


@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=2, n_heads=3, dtype=torch.float32)


@pytest.fixture
def explorer(model):
    e = CircuitExplorer(model, TEXT)
    assert e.wait()
    return e


CircuitExplorer = pcw.CircuitExplorer


def table_triples(table):
    t = table.trigrams
    src, dest, out = (t[k].tolist() for k in ("src", "dest", "out"))
    return (t["layer"], t["head"]), list(zip(src, dest, out))


def test_two_layer_model_gets_every_view_and_no_notice_but_the_mlp_neurons(explorer):
    assert set(explorer.views()) == {"loss", "causal", "attention", "trigrams", "composition", "eigen",
                                     "paths", "induction", "positional", "virtual", "bigrams"}
    # attention-only: the one view it cannot have is the MLP neurons' (tests/test_neurons.py)
    assert explorer.notices == {"neurons": "No MLP neurons for this model: model 'attn-only-2l' is attention-only: "
                                           "it has no MLP paths"}
    for view in explorer.views().values():
        assert view.model_id  # a real child widget, synced as IPY_MODEL_<id>
    assert explorer.get_state()["attention"] == f"IPY_MODEL_{explorer.attention.model_id}"


def test_loss_view_shows_the_next_token_loss_of_every_predicted_token(explorer, model):
    ids = [int(t[1:]) for t in TEXT.split()]
    logits, cache = model.run_with_cache(torch.tensor([ids]))
    dense = torch.nn.functional.cross_entropy(logits[0, :-1].double(), torch.tensor(ids[1:]), reduction="none")
    assert explorer.loss.tokens == TEXT.split()[1:]
    tol = 2 * logit_tol(model, cache, len(ids))
    assert_within(torch.tensor(explorer.loss.values), dense, tol)
    assert_within(torch.tensor(explorer.mean_loss), dense.mean(), tol + gamma(len(dense) + 1) * float(dense.mean()))


@pytest.mark.parametrize("clicked", ["attention", "eigen", "composition", "trigrams"])
def test_head_clicked_in_any_view_selects_it_everywhere_and_recomputes(explorer, model, clicked):
    view = getattr(explorer, clicked)
    if clicked == "composition":  # a cell click: pair (0, 2) -> (1, 1) selects the reading head
        view.set_state({"selected_pair": [0, 2, 1, 1]})
    else:
        view.set_state({"layer": 1, "head": 1})
    assert explorer.wait()
    assert (explorer.layer, explorer.head) == (1, 1)
    for name in ("attention", "trigrams", "composition", "eigen"):
        child = getattr(explorer, name)
        assert (child.layer, child.head) == (1, 1), name
    head, triples = table_triples(explorer.trigrams)
    direct = pcw.skip_trigrams(model, 1, 1, k=len(triples), approximate=True)
    assert head == (1, 1)
    assert triples == [(t.source, t.destination, t.out) for t in direct]
    assert (explorer.eigen.detail["layer"], explorer.eigen.detail["head"]) == (1, 1)


def test_one_click_changes_each_selection_trait_once_without_echo(explorer):
    seen = {"explorer": [], "trigrams": [], "attention": []}
    explorer.observe(lambda c: seen["explorer"].append(c["name"]), ["layer", "head"])
    explorer.trigrams.observe(lambda c: seen["trigrams"].append(c["name"]), ["layer", "head"])
    explorer.attention.observe(lambda c: seen["attention"].append(c["name"]), ["layer", "head"])
    explorer.eigen.set_state({"layer": 1, "head": 2})
    assert explorer.wait()
    assert {k: sorted(v) for k, v in seen.items()} == {k: ["head", "layer"] for k in seen}


def test_explorer_selection_set_from_python_reaches_every_view(explorer):
    explorer.head = 2
    assert explorer.wait()
    assert [getattr(explorer, n).head for n in ("attention", "trigrams", "composition", "eigen")] == [2, 2, 2, 2]
    assert table_triples(explorer.trigrams)[0] == (0, 2)


def test_token_clicked_in_loss_view_selects_position_and_queries_the_token(explorer, model):
    explorer.loss.set_state({"position": 3})  # positions are text positions in every view
    assert explorer.wait()
    assert explorer.position == 3
    assert explorer.token == 1 and explorer.token_str == "t1"
    assert explorer.attention.position == 3
    assert explorer.trigrams.token == 1
    related = explorer.trigrams.related
    direct = pcw.analysis.circuit_query(model, 0, 0, 1, "copies_to", k=len(related["copies_to"]), approximate=True)
    assert [r["id"] for r in related["copies_to"]] == [i for i, _, _ in direct]


def test_token_chosen_in_trigram_table_points_at_its_last_occurrence(explorer):
    explorer.trigrams.set_state({"token": 2})
    assert explorer.wait()
    assert (explorer.token, explorer.position) == (2, 4)
    assert explorer.loss.position == 4 and explorer.attention.position == 4
    explorer.trigrams.set_state({"token": 30})  # not in the text: no position
    assert (explorer.token, explorer.position) == (30, -1)
    assert explorer.loss.position == -1 and explorer.attention.position == -1


def test_position_pinned_in_attention_view_selects_token(explorer):
    explorer.attention.set_state({"position": 6})
    assert (explorer.position, explorer.token, explorer.trigrams.token) == (6, 7, 7)


def test_new_text_reruns_loss_and_attention(explorer, model):
    explorer.loss.set_state({"position": 1})
    explorer.attention.set_state({"text": "t5 t6 t5 t6"})  # edited in the attention view
    assert explorer.text == "t5 t6 t5 t6"
    assert explorer.loss.tokens == ["t6", "t5", "t6"]
    assert explorer.attention.tokens == ["t5", "t6", "t5", "t6"]
    assert explorer.position == -1  # positions of the old text mean nothing now
    assert explorer.mean_loss == pytest.approx(float(pcw.run(model, "t5 t6 t5 t6").loss), rel=COPY["rtol"], abs=0)
    explorer.text = "t9 t8"  # and from Python
    assert explorer.attention.tokens == ["t9", "t8"] and explorer.loss.tokens == ["t8"]


def test_bad_selection_from_browser_is_rejected_and_last_good_state_kept(explorer):
    explorer.set_state({"position": 99})
    assert "position must be -1 (none) or in 0..7, got 99" in explorer.error
    assert explorer.position == -1
    explorer.set_state({"head": 1})
    assert explorer.error == "" and explorer.attention.head == 1
    with pytest.raises(traitlets.TraitError, match="head must be in 0..2"):
        explorer.head = 3


def test_one_layer_model_explains_why_it_has_no_composition():
    e = CircuitExplorer(paper_model(n_layers=1, dtype=torch.float32), "t1 t2 t3")
    assert e.composition is None
    assert set(e.notices) == {"composition", "induction", "virtual", "neurons"}
    assert all("at least 2 layers" in e.notices[name] for name in ("composition", "induction", "virtual"))
    assert "attention-only" in e.notices["neurons"]
    assert set(e.views()) == {"loss", "causal", "attention", "trigrams", "eigen", "paths", "positional", "bigrams"}
    assert not e.trigrams.approximate  # exact skip-trigrams for a one-layer attention-only model


def test_zero_layer_model_shows_the_loss_and_bigram_views():
    e = CircuitExplorer(paper_model(n_layers=0, dtype=torch.float32), "t1 t2 t3")
    assert set(e.views()) == {"loss", "bigrams"}
    assert set(e.notices) == {"causal", "attention", "trigrams", "composition", "eigen", "paths", "induction", "positional",
                              "neurons", "virtual"}
    assert all("n_layers=0" in message for message in e.notices.values())


def test_rotary_model_reads_token_by_token_qk_views_over_the_texts_offsets():
    model = custom_model(positional="rotary", dtype=torch.float32)
    e = CircuitExplorer(model, "t1 t2 t3")
    assert set(e.notices) == {"neurons"}  # attention-only: no MLP neurons, every other view
    for view in (e.trigrams, e.composition, e.eigen, e.induction):
        assert "at the strongest of query - key offsets 0..2" in view.offset_note
    e.compute("positional")
    assert e.wait() and "rotary rule" in e.positional.rule  # the rule, not a positional table
    assert e.attention is not None and e.composition is not None


def test_a_new_text_moves_the_rotary_views_default_window_but_not_one_the_reader_chose():
    model = custom_model(positional="rotary", dtype=torch.float32)
    e = CircuitExplorer(model, "t1 t2 t3")
    e.compute("induction")
    views = (e.trigrams, e.composition, e.eigen, e.induction)
    e.text = "t1 t2 t3 t1 t2"
    assert e.wait()
    for view in views:
        assert view.offsets == [0, 1, 2, 3, 4] and "query - key offsets 0..4" in view.offset_note
    eigen_scores = e.eigen.qk_positivity
    e.eigen.offsets = [1, 2]  # the reader's window
    assert e.wait()
    assert not np.array_equal(e.eigen.qk_positivity, eigen_scores)  # it read the new window
    e.text = "t1 t2"
    assert e.wait()
    assert e.eigen.offsets == [1, 2] and "offsets 1..2" in e.eigen.offset_note
    for view in (e.trigrams, e.composition, e.induction):
        assert view.offsets == [0, 1] and "query - key offsets 0..1" in view.offset_note
    # the composition table is the one read over the new window
    fresh = pcw.CompositionMatrix(model, offsets=range(0, 2))
    assert fresh.wait()
    assert np.array_equal(e.composition.scores["K"]["correct"],
                          fresh.scores["K"]["correct"], equal_nan=True)


def test_bad_arguments_raise_clear_errors(model):
    with pytest.raises(TypeError, match="text must be a non-empty str"):
        CircuitExplorer(model, "")
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        CircuitExplorer(model, TEXT, haed=1)
    with pytest.raises(TypeError, match="weight view"):
        CircuitExplorer(object(), TEXT)
    no_tokenizer = copy.copy(model)
    no_tokenizer.tokenizer = None
    with pytest.raises(ValueError, match="needs a tokenizer"):
        CircuitExplorer(no_tokenizer, TEXT)


def test_initial_selection_is_applied_to_every_view(model):
    e = CircuitExplorer(model, TEXT, layer=1, head=2, position=2)
    assert e.wait()
    assert (e.attention.layer, e.attention.head, e.trigrams.head, e.eigen.layer) == (1, 2, 2, 1)
    assert (e.token, e.trigrams.token, e.attention.position, e.loss.position) == (3, 3, 2, 2)


def test_standalone_page_registers_every_child_once_without_mounting_it(explorer):
    page = render_html([explorer, explorer.loss])  # the loss view also shown on its own
    state = json.loads(re.search(r'id="pcw-state">(.*?)</script>', page, re.DOTALL).group(1))
    ids = [w["model_id"] for w in state["widgets"]]
    assert len(ids) == len(set(ids)) == 1 + len(explorer.views())
    mounted = {w["model_id"] for w in state["widgets"] if w["el"]}
    assert mounted == {explorer.model_id, explorer.loss.model_id}
    children = {v.model_id for v in explorer.views().values()}
    assert set(ids) == {explorer.model_id} | children
