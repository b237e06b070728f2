"""The paper views inside CircuitExplorer (Python side): built inactive (nothing computed until
asked), one forward pass per text, the pair selection and its linking rules, and every number
equal to the analysis functions on the shipped two-layer model.

Tolerance (``tests/tolerance.py``): the views show the analysis functions' own results, within ``COPY``
(one float32 copy's rounding)."""

import numpy as np
import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import activations, path_expansion
from pycircuits_widgets.analysis.bigrams import bigram_top
from pycircuits_widgets.analysis.composition import composition_scores
from pycircuits_widgets.analysis.induction import induction_pair
from pycircuits_widgets.analysis.positional import attention_by_offset, positional_scores_by_offset
from pycircuits_widgets.analysis.virtual_heads import top_virtual_heads
from pycircuits_widgets.widgets.core.selection import SELECTION_KEYS
from pycircuits_widgets.widgets.views import explorer as explorer_module
from pycircuits_widgets.widgets.views import registry
from pycircuits_widgets.widgets.views.positional_qk import MAX_OFFSET
from tolerance import COPY

TEXT = "def f(x):\n    return x + 1\n\ndef g(x):\n    return f(x) + 1\n"
PAPER_VIEWS = ("paths", "induction", "positional", "virtual")


@pytest.fixture(scope="module")
def m2():
    return pcw.load_pretrained("attn-only-2l")


@pytest.fixture(scope="module")
def computed(m2):
    e = pcw.CircuitExplorer(m2, TEXT)
    e.compute()
    assert e.wait(None)
    return e


def writer_oracle(model, layer, head):
    """Strongest K-composition writer into (layer, head), from composition_scores directly."""
    k = composition_scores(model, "K", baseline=False)[:layer, :, layer, head].reshape(-1)
    return divmod(int(torch.argmax(k)), model.cfg.n_heads)


def test_paper_views_are_built_inactive_and_compute_nothing_until_asked(m2, monkeypatch):
    calls = []
    for name in ("top_virtual_heads_steps", "k_composition_positivity_offsets", "path_expansion_steps"):
        module = {"top_virtual_heads_steps": "widgets.views.virtual_heads", "k_composition_positivity_offsets": "analysis.induction",
                  "path_expansion_steps": "widgets.views.path_expansion"}[name]
        mod = __import__(f"pycircuits_widgets.{module}", fromlist=[name])
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    e = pcw.CircuitExplorer(m2, TEXT)
    assert e.wait() and calls == []
    assert [getattr(e, n).active for n in PAPER_VIEWS] == [False] * 4 and not e.bigrams.active
    assert e.paths.terms == [] and e.induction.pairs == {} and e.virtual.heads == [] and e.positional.positional is None
    e.set_state({"text": "a b a b"})  # a new text reaches the inactive views without computing them
    assert e.wait() and e.paths.text == "a b a b" and calls == []
    e.paths.set_state({"active": True})  # the section's "compute" button
    assert e.wait() and calls == ["path_expansion_steps"] and len(e.paths.terms) == 81
    e.compute("virtual")
    assert e.wait() and calls == ["path_expansion_steps", "top_virtual_heads_steps"] and e.induction.pairs == {}
    with pytest.raises(ValueError, match="compute\\(\\) takes names"):
        e.compute("eigen")


def test_one_forward_pass_per_text_serves_loss_paths_and_positions(m2, monkeypatch):
    runs = []
    real = activations.run
    monkeypatch.setattr(explorer_module, "run", lambda model, text: runs.append(text) or real(model, text))
    e = pcw.CircuitExplorer(m2, TEXT)
    e.compute("paths", "positional")
    assert e.wait() and runs == [TEXT]
    e.text = "x = 1\nx = 2\n"
    assert e.wait() and runs == [TEXT, "x = 1\nx = 2\n"]
    assert e.paths.tokens == e.tokens and e.positional.n_tokens == len(e.tokens)


def test_numbers_in_the_explorers_paper_views_equal_the_analysis_functions(computed, m2):
    e = computed
    pe = path_expansion(m2, TEXT)
    assert [t["name"] for t in e.paths.terms] == [t.name for t in pe.terms]
    np.testing.assert_allclose([r["loss"] for r in e.paths.ladder[:3]], pe.loss_by_order().numpy(), **COPY)
    np.testing.assert_allclose(e.paths.importance, pe.term_importance().numpy(), **COPY)
    out = pcw.run(m2, TEXT)
    n = out.tokens.shape[-1]
    k = min(MAX_OFFSET, n - 1)  # every offset of the text: each head's chart shows its own window of them
    np.testing.assert_allclose(e.positional.positional, positional_scores_by_offset(m2, n, k).numpy(), **COPY)
    np.testing.assert_allclose(e.positional.measured, attention_by_offset(out.patterns[0], k).numpy(), **COPY)
    ref = top_virtual_heads(m2, 12, 8)
    assert [r["pair"] for r in e.virtual.heads] == [[*v.h1, *v.h2] for v in ref]
    assert [r["norm"] for r in e.virtual.heads] == pytest.approx([v.norm for v in ref], rel=COPY["rtol"], abs=0)
    _values, ids = bigram_top(m2, 10)
    np.testing.assert_array_equal(e.bigrams.top_ids, ids.numpy())
    # the induction view: every verdict, and each embedded table
    assert len(e.induction.pairs) == 64 and len(e.induction.tables) == 16
    for key, table in e.induction.tables.items():
        l1, h1, l2, h2 = map(int, key.split(","))
        r = induction_pair(m2, (l1, h1), (l2, h2), k=12)
        info = e.induction.pairs[key]
        assert (info["kind"], info["sentence"]) == (r.kind, r.sentence)
        assert info["qk_positivity"] == pytest.approx(r.qk_positivity, rel=COPY["rtol"], abs=0)
        np.testing.assert_allclose(table["values"], r.top_values.numpy(), **COPY)
        assert table["tokens"].tolist() == [r.top_dest.tolist(), r.top_src.tolist()]


def test_a_composition_cell_selects_the_pair_everywhere_and_its_later_head(computed):
    e = computed
    e.composition.set_state({"selected_pair": [0, 3, 1, 2]})  # a cell click, as the kernel hears it
    assert e.wait()
    assert e.selected_pair == [0, 3, 1, 2] and (e.layer, e.head) == (1, 2)
    for name in ("composition", "paths", "induction", "virtual"):
        view = getattr(e, name)
        assert (view.selected_pair, view.layer, view.head) == ([0, 3, 1, 2], 1, 2), name
    assert "0,3,1,2" in e.induction.tables  # the pair's ranked table, computed on selection


def test_a_virtual_head_or_a_virtual_term_selects_its_pair(computed):
    e = computed
    pair = e.virtual.heads[1]["pair"]
    e.virtual.set_state({"selected_pair": pair, "layer": pair[2], "head": pair[3]})
    assert e.wait() and e.selected_pair == pair and e.induction.selected_pair == pair
    term = next(t for t in e.paths.terms if t["order"] == 2 and [*t["heads"][0], *t["heads"][1]] != pair)
    new = [*term["heads"][0], *term["heads"][1]]
    e.paths.set_state({"selected_pair": new, "layer": new[2], "head": new[3]})
    assert e.wait() and e.selected_pair == new and e.composition.selected_pair == new and (e.layer, e.head) == tuple(new[2:])


def test_a_head_term_selects_that_head_in_every_view(computed):
    e = computed
    e.paths.set_state({"layer": 0, "head": 5})
    assert e.wait()
    heads = {name: (v.layer, v.head) for name, v in e.views().items() if hasattr(v, "head") and name != "bigrams"}
    assert set(heads.values()) == {(0, 5)} and (e.layer, e.head) == (0, 5)


@pytest.mark.parametrize("head", [0, 2, 6])
def test_a_reading_head_brings_its_strongest_k_composition_writer(computed, m2, head):
    e = computed
    e.layer = 0  # a layer-0 head keeps whatever pair is selected
    before = list(e.selected_pair)
    assert e.selected_pair == before
    e.eigen.set_state({"layer": 1, "head": head})  # a click on a later-layer head
    assert e.wait()
    writer = writer_oracle(m2, 1, head)
    assert e.strongest_writer(1, head) == writer
    assert e.selected_pair == [*writer, 1, head] == e.induction.selected_pair == e.composition.selected_pair
    e.head = head  # the same head again: the pair stays
    assert e.selected_pair == [*writer, 1, head]


def test_the_browser_gets_every_section_from_the_registry_in_order(computed):
    """The sections the browser lays out and links are the registry's, each with its followed
    keys (no list of views in js/src: tests/browser/test_selection_rules_browser.py)."""
    # no sweep and no task given: no examples, no task section
    without_sweep = [spec.name for spec in registry.VIEWS if not (spec.needs_sweep or spec.needs_task)]
    assert [s["name"] for s in computed.sections] == without_sweep
    assert list(computed.views()) == [name for name in without_sweep if name != "neurons"]
    assert set(computed.notices) == {"neurons"}  # attention-only: no MLP neurons (tests/test_neurons.py)
    for section in computed.sections:
        spec = registry.BY_NAME[section["name"]]
        assert section["follows"] == list(spec.follows) and section["title"] == spec.title
        assert set(spec.follows) <= set(SELECTION_KEYS)
        assert isinstance(getattr(computed, spec.name), spec.cls) or spec.name in computed.notices


def test_the_strongest_writer_table_is_every_heads_argmax_of_the_k_scores(computed, m2):
    writers = computed.strongest_writers
    assert writers.shape == (2, m2.cfg.n_heads, 2) and (writers[0] == -1).all()  # layer 0: nothing earlier
    for head in range(m2.cfg.n_heads):
        assert tuple(writers[1, head]) == writer_oracle(m2, 1, head) == computed.strongest_writer(1, head)


def test_save_html_computes_a_small_models_paper_views_and_never_saves_busy(m2, tmp_path):
    e = pcw.CircuitExplorer(m2, TEXT)
    e.save_html(tmp_path / "page.html")
    assert not e.busy and all(getattr(e, n).active and not getattr(e, n).busy for n in PAPER_VIEWS)
    assert len(e.paths.terms) == 81 and len(e.induction.pairs) == 64
