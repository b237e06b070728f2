"""SkipTrigramTable, CompositionMatrix, EigenvaluePlot: every recompute path equals a direct
analysis call; selection validation; newest request wins.

Tolerances (``tests/tolerance.py``): a view's numbers against the analysis function's own results within
``COPY`` (one float32 copy's rounding); a partial skip-trigram table against the exact one within the
rounding of two float32 recomputations of a score (``product_tol`` of the centred factors, ``score_tol``)."""

import numpy as np
import pytest
import torch
import traitlets

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import (
    cache,
    circuit_query,
    composition_detail,
    composition_scores,
    eigenvalue_positivity,
    eigenvalues,
    random_baseline,
    skip_trigrams,
)
from pycircuits_widgets.analysis.head_scores import head_scores
from pycircuits_widgets.analysis.skip_trigrams import centred_factors
from pycircuits_widgets.models import AttnOnlyTransformer, attn_only_config, from_attn_only
from pycircuits_widgets.widgets.core.runner import GIVE_WAY
from runner_loop import manual_kernel_loop  # noqa: F401 (fixture)
from tolerance import COPY, product_tol, score_tol

XSS = '<img src=x onerror="window.__pwned=1">'


class StubTokenizer:
    """Display strings only (all the views need); lets tests plant hostile strings."""

    def __init__(self, strings):
        self.strings = strings

    def display_token(self, i):
        return self.strings[i]


def tiny_model(n_layers, d_vocab=256, seed=0, strings=None):
    cfg = attn_only_config(n_layers, n_heads=4, d_model=32, d_head=8, d_vocab=d_vocab, n_ctx=32)
    strings = strings or [f"·w{i}" if i % 5 == 0 else f"t{i}" for i in range(d_vocab)]
    return from_attn_only(AttnOnlyTransformer(cfg, seed=seed), StubTokenizer(strings))


@pytest.fixture(scope="module")
def m1():
    return tiny_model(1)


@pytest.fixture(scope="module")
def m2():
    return tiny_model(2, seed=1)


def table_rows(w):
    t = w.trigrams
    cols = {k: t[k] for k in ("src", "dest", "out", "qk", "ov", "score")}
    return cols, t["strings"]


def assert_table_matches(w, model, layer, head, k, approximate=False):
    cols, strings = table_rows(w)
    ref = skip_trigrams(model, layer, head, k=k, approximate=approximate)
    assert len(ref) == len(cols["score"]) == k
    np.testing.assert_allclose(cols["score"], [r.score for r in ref], **COPY)
    np.testing.assert_allclose(cols["qk"], [r.qk for r in ref], **COPY)
    np.testing.assert_allclose(cols["ov"], [r.ov for r in ref], **COPY)
    assert {(r.source, r.destination, r.out) for r in ref} == set(zip(*(cols[c].tolist() for c in ("src", "dest", "out"))))
    for r in ref:
        assert strings[str(r.source)] == r.source_str and strings[str(r.out)] == r.out_str


def test_table_equals_skip_trigrams_and_head_change_recomputes(m1):
    w = pcw.SkipTrigramTable(m1, layer=0, head=1, k=15)
    assert_table_matches(w, m1, 0, 1, 15)
    w.head = 3
    assert w.wait(20)
    assert (w.trigrams["layer"], w.trigrams["head"]) == (0, 3) and not w.busy and not w.error
    assert_table_matches(w, m1, 0, 3, 15)
    w.head = 1  # revisited: answered from the widget's cache, still the same table
    assert w.wait(20)
    assert_table_matches(w, m1, 0, 1, 15)


def test_large_vocabulary_sends_a_partial_table_first_then_the_exact_one(m1):
    w = pcw.SkipTrigramTable(m1, head=2, k=12)
    w.partial_above, w.partial_sources = 100, 40  # as if 256 tokens were a large vocabulary
    cache.discard(m1, lambda key: key[0] == "skip_trigram_table")  # forget the table the constructor computed
    raw = list(w._table_steps(0, 2, 12))
    assert raw[1] is GIVE_WAY  # the exact search lets the click's other views go first
    steps = [s for s in raw if isinstance(s, dict) and "trigrams" in s]
    assert len(steps) == 2 and raw[-1] is steps[1]
    # between them, the exact search block by block (its count), each block after the other views' clicks
    search = raw[2:-1]
    assert search[1::2] == [GIVE_WAY] * (len(search) // 2) and all(s is None or "progress" in s for s in search[::2])
    assert [s["trigrams"]["progress"] for s in steps] == [40 / 256, 1]  # the same float division
    assert [s["trigrams"]["exact"] for s in steps] == [False, True]
    partial = np.asarray(steps[0]["trigrams"]["score"])  # the step as the trait receives it
    exact = np.asarray(steps[1]["trigrams"]["score"])
    # a subset's i-th best never beats the whole's, up to each search's own float32 rounding of a score
    # (the largest score_tol over every triple: products of the centred factors, product_tol)
    q, k, v, u = centred_factors(m1, 0, 2)
    qk, ov = (q.double() @ k.double().T).abs().max(), (v.double() @ u.double()).abs().max()
    rounding = score_tol(qk, ov, product_tol(q, k.T, computations=1).max(), product_tol(v, u, computations=1).max())
    assert np.all(partial <= exact + 2 * float(rounding))
    w.recompute()
    assert_table_matches(w, m1, 0, 2, 12)


def test_large_vocabulary_constructor_returns_at_once_and_fills_the_table_in_background(m1, monkeypatch,
                                                                                      manual_kernel_loop):
    monkeypatch.setattr(pcw.SkipTrigramTable, "partial_above", 100)
    w = pcw.SkipTrigramTable(m1, head=1, k=10)
    assert w.busy and w.trigrams == {}  # results wait for the kernel thread (here: wait())
    assert w.wait(20) and not w.busy
    assert w.trigrams["exact"]
    assert_table_matches(w, m1, 0, 1, 10)


def test_deeper_model_reads_direct_path_and_says_so(m2):
    w = pcw.SkipTrigramTable(m2, layer=1, head=0, k=10)
    assert w.approximate
    assert_table_matches(w, m2, 1, 0, 10, approximate=True)


def test_search_finds_tokens_over_whole_vocabulary_and_queries_match_circuit_query(m1):
    w = pcw.SkipTrigramTable(m1, head=1, k=5)
    w.query = " w25"  # a typed space matches the display "·"
    assert w.wait(20)
    assert w.matches[0] == {"id": 25, "str": "·w25"}
    assert [m["id"] for m in w.matches[1:]] == [250, 255]  # prefix matches "·w250", "·w255"
    assert w.token == 25
    for mode in ("attends_to", "attended_by", "copies_to"):
        ref = circuit_query(m1, 0, 1, 25, mode, k=10)
        got = w.related[mode]
        assert [g["id"] for g in got] == [r[0] for r in ref]
        np.testing.assert_allclose([g["score"] for g in got], [r[2] for r in ref], **COPY)


def test_token_and_head_change_update_the_query(m1):
    w = pcw.SkipTrigramTable(m1, head=0, k=5, token=7, n_related=4)
    assert w.related["token"] == 7 and len(w.related["copies_to"]) == 4
    w.head = 2
    assert w.wait(20)
    assert w.related["head"] == 2
    assert [r["id"] for r in w.related["attended_by"]] == [r[0] for r in circuit_query(m1, 0, 2, 7, "attended_by", k=4)]


@pytest.mark.parametrize("name,value", [("layer", 1), ("head", 4), ("head", -1), ("token", 256), ("k", 0)])
def test_out_of_range_selection_is_rejected_with_a_clear_message(m1, name, value):
    w = pcw.SkipTrigramTable(m1, k=5)
    with pytest.raises(traitlets.TraitError, match=name):
        setattr(w, name, value)


def test_unknown_kwarg_and_bad_model_raise(m1):
    with pytest.raises(TypeError, match="hed"):
        pcw.SkipTrigramTable(m1, hed=1)
    with pytest.raises(TypeError, match="weight view"):
        pcw.EigenvaluePlot(object())


def test_composition_scores_trait_holds_all_kinds_and_the_erratum_only_once_asked_for(m2):
    w = pcw.CompositionMatrix(m2)
    assert {k: set(v) for k, v in w.scores.items()} == {k: {"correct"} for k in "QKV"}  # no erratum yet
    w.show_erratum = True
    assert w.wait(20) and not w.error
    for kind in "QKV":
        for panel, norm in (("correct", "correct"), ("erratum", "erratum_left")):
            table = w.scores[kind][panel]
            assert table.shape == (2, 4, 2, 4)
            np.testing.assert_allclose(table, composition_scores(m2, kind, baseline=False, norm=norm).numpy(),
                                       equal_nan=True, **COPY)
    assert w.baselines == {"correct": random_baseline(31, 8), "erratum": random_baseline(31, 8, "erratum_left")}  # layer norm: 31 dims


def test_clicking_a_pair_computes_its_detail_and_selects_the_reading_head(m2):
    w = pcw.CompositionMatrix(m2)
    w.selected_pair = [0, 3, 1, 2]
    assert w.wait(20) and not w.error
    assert (w.layer, w.head) == (1, 2)
    ref = composition_detail(m2, "K", (0, 3), (1, 2))
    d = w.detail
    assert (d["kind"], d["h1"], d["h2"]) == ("K", [0, 3], [1, 2])
    copied = [ref.score, ref.erratum_scores["erratum_left"], ref.positivity]
    assert [d["score"], d["erratum_score"], d["positivity"]] == pytest.approx(copied, rel=COPY["rtol"], abs=0)
    np.testing.assert_allclose(d["singular_values"], ref.singular_values.numpy(), **COPY)
    w.kind = "V"
    assert w.wait(20)
    assert w.detail["score"] == pytest.approx(composition_detail(m2, "V", (0, 3), (1, 2)).score, rel=COPY["rtol"], abs=0)


def test_composition_pair_must_go_from_earlier_to_later_layer(m2):
    w = pcw.CompositionMatrix(m2)
    with pytest.raises(traitlets.TraitError, match="l1 < l2"):
        w.selected_pair = [1, 0, 1, 2]
    with pytest.raises(ValueError, match="at least 2 layers"):
        pcw.CompositionMatrix(tiny_model(1))


def test_eigenvalue_plot_positivity_scores_and_head_detail(m2):
    w = pcw.EigenvaluePlot(m2)
    for kind, trait in (("OV", w.ov_positivity), ("QK", w.qk_positivity)):
        np.testing.assert_allclose(trait, eigenvalue_positivity(m2, kind).numpy(), **COPY)
    ref_scores = head_scores(m2)
    assert set(w.scores) == set(ref_scores)
    np.testing.assert_allclose(w.scores["induction"], ref_scores["induction"].numpy(), equal_nan=True, **COPY)
    w.layer, w.head = 1, 3
    assert w.wait(20) and (w.detail["layer"], w.detail["head"]) == (1, 3)
    eig = eigenvalues(m2, "OV")[1, 3]
    np.testing.assert_allclose(w.detail["ov_re"], eig.real.numpy(), **COPY)
    np.testing.assert_allclose(w.detail["ov_im"], eig.imag.numpy(), **COPY)
    # the copied tokens are the top of the centred full OV circuit's diagonal, checked densely
    ov = m2.W_E @ m2.W_V[1, 3] @ m2.W_O[1, 3] @ m2.W_U  # dense [src, out]
    dense_diag = torch.diagonal(ov - ov.mean(1, keepdim=True))
    assert [c["id"] for c in w.detail["copies"]] == torch.topk(dense_diag, 12).indices.tolist()
    with pytest.raises(traitlets.TraitError, match="color_by"):
        w.color_by = "nope"


def test_failure_of_newest_request_shows_error_and_keeps_last_state(m1):
    w = pcw.SkipTrigramTable(m1, k=5)
    before = w.trigrams

    def broken():
        raise RuntimeError("boom")
        yield {}

    w._runner.submit("table", broken)
    assert w.wait(10)
    assert w.error == "table: RuntimeError: boom" and w.trigrams is before


def test_views_share_selection_through_link(m2):
    import ipywidgets

    plot, table = pcw.EigenvaluePlot(m2, scores={}), pcw.SkipTrigramTable(m2, k=5)
    links = [ipywidgets.link((plot, n), (table, n)) for n in ("layer", "head")]
    plot.layer, plot.head = 1, 2
    assert table.wait(20) and (table.trigrams["layer"], table.trigrams["head"]) == (1, 2)
    for link in links:
        link.unlink()


def test_rotary_model_composition_reads_q_and_k_over_a_stated_window_and_keeps_v():
    """Q/K cells: each pair's largest score over the offsets; the detail at the offset reaching it,
    named without Python advice; V as without rotary."""
    from random_models import custom_model
    model = custom_model(positional="rotary", dtype=torch.float32)
    w = pcw.CompositionMatrix(model, offsets=range(0, 5), selected_pair=[0, 1, 1, 2])
    assert w.wait(20) and not w.error
    assert "at the strongest of query - key offsets 0..4" in w.offset_note and "offsets=" not in w.offset_note
    for kind in "QK":
        by_offset = composition_scores(model, kind, baseline=False, offsets=range(0, 5))
        np.testing.assert_allclose(w.scores[kind]["correct"], by_offset.amax(0).numpy(), equal_nan=True,
                                   **COPY)
    best = int(composition_scores(model, "K", baseline=False, offsets=range(0, 5))[:, 0, 1, 1, 2].argmax())
    assert w.detail["offset"] == best and w.detail["offset_note"].startswith(f"at query - key offset {best} ")
    np.testing.assert_allclose(w.scores["V"]["correct"], composition_scores(model, "V", baseline=False).numpy(),
                               equal_nan=True, **COPY)
