"""PathExpansion, InductionMechanism, PositionalQK, VirtualHeads and BigramTable from the real
bundle in headless Chromium: what they show equals the analysis, clicks reach the kernel, and
saved pages work (or say "needs a kernel") without one."""

import pytest

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import path_expansion
from pycircuits_widgets.analysis.bigrams import bigram_top
from pycircuits_widgets.analysis.induction import induction_pair
from pycircuits_widgets.analysis.positional import positional_scores_by_offset
from pycircuits_widgets.widgets.core import offline
from random_models import paper_model

pytestmark = pytest.mark.browser

TEXT = "t1 t5 t9 t2 t1 t5 t9 t2 t7 t3"


@pytest.fixture(scope="module")
def m2():
    return paper_model(n_layers=2, n_heads=3, d_vocab=40, n_ctx=16, seed=2)


def test_path_terms_select_heads_and_pairs_and_hover_explains_the_next_token(show, m2):
    w = pcw.PathExpansion(m2, TEXT, top_n=16)
    view = show(w)
    page = view.page
    assert page.get_by_test_id("ladder").locator("tr.rung").count() == 4
    pe = path_expansion(m2, TEXT)
    importance = pe.term_importance()
    shown = page.locator("tr.term").evaluate_all("rows => rows.map(r => r.dataset.term)")
    assert shown == [pe.terms[i].name for i in importance.argsort(descending=True).tolist()]
    page.locator('tr.term[data-term="L1.H2"] button').click()
    assert (w.layer, w.head) == (1, 2)
    page.locator('tr.term[data-term="L0.H1 → L1.H0"] button').click()
    assert w.selected_pair == [0, 1, 1, 0] and (w.layer, w.head) == (1, 0)
    # the pair and its later head (now the selected head) are both highlighted
    selected = page.locator('tr.term.selected').evaluate_all("rows => rows.map(r => r.dataset.term)")
    assert sorted(selected) == ["L0.H1 → L1.H0", "L1.H0"]
    # hover position 4: the terms listed are those whose centred contribution to token 5 is largest and positive
    page.locator('.tok[data-position="4"]').hover()
    col = pe.next_token_contributions()[:, 0, 4]
    expected = [pe.terms[i].name for i in col.argsort(descending=True).tolist() if col[i] > 0][:6]
    names = page.get_by_test_id("raising").locator(".tname").all_inner_texts()
    assert names == expected
    page.locator('.tok[data-position="9"]').click()
    assert w.position == 9
    page.mouse.move(0, 0)
    assert "last token" in page.get_by_test_id("position-panel").inner_text()
    w.text = "t1 t2 t3"  # Python side: the view redraws with the new text
    view.wait_until(lambda: page.locator(".tok").count() == 3, what="new text")
    assert w.position == -1


def test_induction_pickers_verdict_and_kernel_computed_table(show, m2):
    w = pcw.InductionMechanism(m2, k=5, n_tables=1)
    view = show(w)
    page = view.page
    key = ",".join(map(str, w.selected_pair))
    assert page.get_by_test_id("verdict").inner_text() == w.pairs[key]["sentence"]
    assert page.get_by_test_id("kcomp-table").locator("tr.row").count() == 5
    # a pair whose table is not embedded: the kernel computes it on selection
    other = next(k for k in w.pairs if k not in w.tables)
    l1, h1, l2, h2 = map(int, other.split(","))
    page.get_by_test_id("h1-picker").select_option(f"{l1},{h1}")
    page.get_by_test_id("h2-picker").select_option(f"{l2},{h2}")
    assert w.selected_pair == [l1, h1, l2, h2] and (w.layer, w.head) == (l2, h2)
    ref = induction_pair(m2, (l1, h1), (l2, h2), k=5)
    view.wait_until(lambda: page.get_by_test_id("kcomp-table").locator("tr.row").count() == 5, what="computed table")
    assert page.get_by_test_id("verdict").get_attribute("data-kind") == ref.kind
    scores = [float(x) for x in page.get_by_test_id("kcomp-score").all_inner_texts()]
    assert scores == pytest.approx(ref.top_values.tolist(), rel=1e-3)
    assert float(page.get_by_test_id("value-qk").inner_text()) == pytest.approx(ref.qk_positivity, abs=1e-3)
    page.get_by_test_id("kcomp-table").locator("tr.row").first.locator(".pcw-tok").first.click()
    assert w.token == int(ref.top_dest[0])


def test_induction_page_without_kernel_answers_other_pairs_within_its_budget(page, tmp_path, m2, monkeypatch):
    w = pcw.InductionMechanism(m2, k=4, n_tables=1)
    other = next(k for k in w.pairs if k not in w.tables)
    page.goto(w.save_html(tmp_path / "induction.html").as_uri())
    page.wait_for_selector("body[data-pcw-ready]")
    l1, h1, l2, h2 = map(int, other.split(","))
    page.get_by_test_id("h1-picker").select_option(f"{l1},{h1}")
    page.get_by_test_id("h2-picker").select_option(f"{l2},{h2}")
    assert page.get_by_test_id("verdict").inner_text() == w.pairs[other]["sentence"]  # embedded for every pair
    ref = induction_pair(m2, (l1, h1), (l2, h2), k=4)  # the saved answer (float16) against the analysis
    scores = [float(x) for x in page.get_by_test_id("kcomp-score").all_inner_texts()]
    assert scores == pytest.approx(ref.top_values.tolist(), rel=2e-3, abs=1e-3)
    assert page.get_by_test_id("needs-kernel").count() == 0

    monkeypatch.setattr(offline, "BUDGET", 600)  # room for about one pair's answer
    small = pcw.InductionMechanism(m2, k=4, n_tables=1)
    page.goto(small.save_html(tmp_path / "small.html").as_uri())
    page.wait_for_selector("body[data-pcw-ready]")
    last = [k for k in small.pairs if k not in small.tables][-1]
    l1, h1, l2, h2 = map(int, last.split(","))
    page.get_by_test_id("h1-picker").select_option(f"{l1},{h1}")
    page.get_by_test_id("h2-picker").select_option(f"{l2},{h2}")
    assert page.get_by_test_id("verdict").inner_text() == small.pairs[last]["sentence"]
    assert "needs a kernel" in page.get_by_test_id("needs-kernel").inner_text()
    assert page.get_by_test_id("offline-note").inner_text() == offline.over_budget("This pair's ranked table")
    assert page.get_by_test_id("error").count() == 0


def test_positional_chart_follows_the_head_picker(show, m2):
    w = pcw.PositionalQK(m2, TEXT, max_offset=5)
    view = show(w)
    page = view.page
    page.get_by_test_id("layer-picker").select_option("1")
    page.get_by_test_id("head-picker").select_option("2")
    assert (w.layer, w.head) == (1, 2)
    ref = positional_scores_by_offset(m2, 10, 5)[1, 2]
    values = page.locator("circle.score").evaluate_all("cs => cs.map(c => Number(c.dataset.value))")
    assert values == pytest.approx(ref.tolist(), rel=1e-5)
    assert int(page.get_by_test_id("positional-peak").inner_text()) == int(ref.argmax())
    measured = w.measured[1, 2]
    bars = page.locator("rect.measured").evaluate_all("rs => rs.map(r => Number(r.dataset.value))")
    assert bars == pytest.approx(measured.tolist(), rel=1e-5)


def test_virtual_head_rows_select_pairs(show, m2):
    w = pcw.VirtualHeads(m2, k=4, n_copies=3)
    view = show(w)
    rows = view.page.locator("tr.vh")
    assert rows.count() == 4
    assert rows.nth(0).get_attribute("data-pair") == ",".join(map(str, w.heads[0]["pair"]))
    rows.nth(2).locator("button.name").click()
    assert w.selected_pair == w.heads[2]["pair"]
    view.wait_until(lambda: rows.nth(2).get_attribute("class").find("selected") >= 0, what="selected row")
    assert rows.nth(2).locator(".pcw-tok").count() == 3


def test_bigram_search_select_and_follow_the_chain_without_kernel(page, tmp_path):
    m0 = pcw.load_pretrained("attn-only-0l")
    w = pcw.BigramTable(m0, k=5)
    page.goto(w.save_html(tmp_path / "bigrams.html").as_uri())
    page.wait_for_selector("body[data-pcw-ready]")
    vocab = w.vocab
    target = next(i for i, s in enumerate(vocab) if s == "def")
    page.get_by_test_id("search").fill("def")
    page.get_by_test_id("matches").locator(f'[data-token-id="{target}"]').click()
    _, ids = bigram_top(m0, 5, [target])
    shown = page.get_by_test_id("next-tokens").locator(".pcw-tok").evaluate_all("ts => ts.map(t => Number(t.dataset.tokenId))")
    assert shown == ids[0].tolist()
    page.get_by_test_id("next-tokens").locator(".pcw-tok").first.click()  # follow the chain
    _, ids2 = bigram_top(m0, 5, [ids[0, 0].item()])
    shown = page.get_by_test_id("next-tokens").locator(".pcw-tok").evaluate_all("ts => ts.map(t => Number(t.dataset.tokenId))")
    assert shown == ids2[0].tolist()


def test_a_refused_path_expansion_shows_why_instead_of_terms(show):
    """A tiny MPT (``clip_qkv`` 2) whose values reach the clamp on the text: the view shows the refusal
    as a notice, and no ladder or terms."""
    from family_configs import tiny_model
    from random_models import IdTokenizer
    model = pcw.from_hf(tiny_model("mpt"), verify=False)
    model.tokenizer = IdTokenizer()
    w = pcw.PathExpansion(model, "t3 t17 t5 t3 t17 t5 t40 t2 t9 t63 t1 t2")
    assert w.wait(60) and w.refusal.startswith("path expansion refused: clip_qkv:")
    page = show(w).page
    assert page.get_by_test_id("paths-refusal").inner_text() == w.refusal
    assert page.get_by_test_id("ladder").count() == 0 and page.locator("tr.term").count() == 0
