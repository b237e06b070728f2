"""Weights meet the corpus in headless Chromium: the skip-trigram table's corpus columns ("in corpus",
"attention", "never seen in the corpus") and the eigenvalue plot coloured by a sweep's head scores, live
and in a saved page (a real 64-window sweep of the shipped 2-layer model)."""

import pytest
import torch

import pycircuits_widgets as pcw
from harness import saved_page_open
from pycircuits_widgets.models import load_pretrained
from runner_loop import manual_kernel_loop  # noqa: F401 (fixture)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def model():
    return load_pretrained("attn-only-2l")


@pytest.fixture(scope="module")
def swept(model, tmp_path_factory):
    return pcw.sweep(model, pcw.Corpus.python_stdlib(), tmp_path_factory.mktemp("sweep"), seq_len=64, k=8,
                     max_windows=64, progress=False)


def shown_counts(page) -> list:
    """Per table row: its count (int) or the "never seen" text."""
    cells = page.locator("tr.trigram td[data-col=count]").all_inner_texts()
    return [int(c) if c.isdigit() else c for c in cells]


def expected_counts(table, swept, model) -> list:
    t = table.trigrams
    order = torch.as_tensor(t["score"]).argsort(descending=True, stable=True)
    triples = torch.stack([torch.as_tensor(t[c]).long() for c in ("src", "dest", "out")], 1)[order]
    counts = pcw.trigram_counts(swept, model, t["layer"], t["head"], triples).count.tolist()
    return [c if c else "never seen in the corpus" for c in counts]


def test_the_table_shows_counts_and_never_seen_live_and_in_a_saved_page(show, model, swept, browser, tmp_path):
    table = pcw.SkipTrigramTable(model, layer=0, head=2, k=40, page_size=40, sweep=swept)
    expected = expected_counts(table, swept, model)
    assert "never seen in the corpus" in expected and any(isinstance(c, int) for c in expected)  # both kinds shown
    view = show(table)
    page = view.page
    headers = page.locator("[data-testid=trigram-table] th").all_inner_texts()
    assert headers[-2:] == ["in corpus", "attention"]
    assert shown_counts(page) == expected
    seen = [i for i, c in enumerate(expected) if isinstance(c, int)]
    attention = page.locator("tr.trigram td[data-col=attention]").all_inner_texts()
    assert len(attention) == len(seen) and all(0 <= float(a) <= 1 for a in attention)
    assert "64 windows of 64 tokens" in page.get_by_test_id("corpus-note").inner_text()

    table.layer, table.head = 1, 2  # a head counted in the kernel, then back
    table.wait()
    other = expected_counts(table, swept, model)
    table.layer, table.head = 0, 2
    table.wait()
    path = table.save_html(tmp_path / "trigrams.html")
    with saved_page_open(browser, path) as saved:  # the counts shown are kept, and those of a head counted
        assert shown_counts(saved) == expected
        saved.get_by_test_id("layer-picker").select_option("1")
        saved.wait_for_function("() => document.querySelector('caption').textContent.includes('L1.H2')")
        assert shown_counts(saved) == other and any(isinstance(c, int) for c in other)
        saved.get_by_test_id("head-picker").select_option("3")  # never counted: the page says so
        saved.wait_for_function("() => document.querySelector('caption').textContent.includes('L1.H3')")
        assert set(shown_counts(saved)) == {"not counted (a saved page keeps the heads counted in the kernel)"}


def test_the_eigenvalue_plot_colours_by_a_corpus_head_score_with_its_legend(show, model, swept):
    plot = pcw.EigenvaluePlot(model, sweep=swept)
    view = show(plot)
    page = view.page
    assert page.get_by_test_id("legend").count() == 0  # by layer: no score legend
    page.get_by_test_id("color-by").select_option("induction")
    assert plot.color_by == "induction"
    legend = page.get_by_test_id("legend")
    view.wait_until(lambda: legend.count() == 1, what="the score legend")
    assert legend.get_by_test_id("legend-label").inner_text() == "induction score"
    text = legend.inner_text()
    assert "attention to its target, 0 to 1, pooled over the corpus sweep (64 windows of 64 tokens)" in text
    scores = swept.head_scores()["induction"]
    finite = scores[scores.isfinite()]
    ticks = legend.locator(".tick").all_inner_texts()  # the scale: the smallest and largest score
    assert [float(x) for x in ticks] == pytest.approx([float(finite.min()), float(finite.max())], abs=5e-3)
