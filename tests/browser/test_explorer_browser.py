"""CircuitExplorer in headless Chromium, from the real bundle: child views shown inside it,
clicks in one view reaching Python and coming back to every other view with recomputed
content (checked against direct analysis calls), notices, and the demo's offline page."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import pycircuits_widgets as pcw
from harness import show_explorer
from random_models import paper_model

pytestmark = pytest.mark.browser

REPO = pathlib.Path(__file__).resolve().parents[2]

TEXT = "t1 t2 t3 t4 t1 t2 t3 t4"
VIEWS = {
    "loss": ".pcw-colored-tokens .token",
    "attention": "button.thumb",
    "trigrams": "[data-testid=trigram-table] tr.trigram",
    "composition": "[data-testid^=heatmap-]",
    "eigen": "[data-testid=scatter] g.head",
}



@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=2, n_heads=3, dtype=torch.float32)


def section(view, name):
    return view.page.locator(f".pcw-explorer section[data-view={name}]")


def page_trigrams(view, n):
    """(source, destination, out) strings of the first ``n`` rows shown in the table."""
    rows = section(view, "trigrams").locator("tr.trigram")
    return [tuple(rows.nth(i).locator(".pcw-tok").all_inner_texts()) for i in range(n)]


def test_every_view_is_shown_inside_the_explorer(show, model):
    explorer = pcw.CircuitExplorer(model, TEXT)
    explorer.wait()
    view = show_explorer(show, explorer)
    for name, selector in VIEWS.items():
        assert section(view, name).locator(selector).first.is_visible(), name
    # the one notice of an attention-only model: no MLP neurons
    assert view.page.locator("[data-testid=notice]").count() == 1
    assert "attention-only" in section(view, "neurons").locator("[data-testid=notice]").inner_text()
    assert view.page.locator("[data-testid=selected-head]").inner_text() == "L0.H0"


def test_click_on_a_head_thumbnail_recomputes_the_other_views(show, model):
    explorer = pcw.CircuitExplorer(model, TEXT)
    explorer.wait()
    view = show_explorer(show, explorer)
    before, sent_before = len(view.received), len(view.sent)
    section(view, "attention").locator("button.thumb[data-layer='1'][data-head='2']").click()
    view.wait_until(lambda: (explorer.layer, explorer.head) == (1, 2) and explorer.wait(0.01) and not explorer.busy,
                    what="kernel selection and recompute")
    # one message: the explorer's; the kernel moves its views (one per view would be 9 requests a click)
    assert view.received[before:] == [(explorer.model_id, "update")]
    for name, child in explorer.views().items():
        if "head" in type(child).class_trait_names():
            view.wait_until(lambda child=child: view.js_model(child, "head") == 2, what=f"the page's {name} model at head 2")
            # its layer and head in one message: the page never shows (new layer, old head)
            moved = [keys for mid, keys in view.sent[sent_before:] if mid == child.model_id and keys & {"layer", "head"}]
            assert len(moved) == 1 and {"layer", "head"} <= moved[0], (name, moved)
    view.wait_until(lambda: view.page.locator("[data-testid=selected-head]").inner_text() == "L1.H2",
                    what="header updated")
    caption = section(view, "trigrams").locator("caption")
    view.wait_until(lambda: "head L1.H2" in caption.inner_text(), what="skip-trigram table of the clicked head")
    direct = pcw.skip_trigrams(model, 1, 2, k=5, approximate=True)
    assert page_trigrams(view, 5) == [(t.source_str, t.destination_str, t.out_str) for t in direct]
    selected = section(view, "eigen").locator("g.head[aria-pressed=true]")
    assert selected.get_attribute("data-label") == "L1.H2"
    assert explorer.composition.head == 2 and explorer.eigen.detail["head"] == 2


def test_click_in_eigenvalue_plot_moves_the_attention_view(show, model):
    explorer = pcw.CircuitExplorer(model, TEXT)
    explorer.wait()
    view = show_explorer(show, explorer)
    section(view, "eigen").locator("g.head[data-head='4']").press("Enter")  # flat index 4 = head L1.H1 (keyboard)
    view.wait_until(lambda: (explorer.attention.layer, explorer.attention.head) == (1, 1), what="attention follows")
    selected = section(view, "attention").locator("button.thumb.selected")
    view.wait_until(lambda: selected.get_attribute("data-head") == "1" and selected.get_attribute("data-layer") == "1",
                    what="thumbnail selected in the page")


def test_click_on_a_token_selects_it_and_shows_its_query(show, model):
    explorer = pcw.CircuitExplorer(model, TEXT)
    explorer.wait()
    view = show_explorer(show, explorer)
    section(view, "loss").locator(".token").nth(3).click()  # text position 4: "t1"
    view.wait_until(lambda: explorer.position == 4 and explorer.trigrams.related.get("token") == 1,
                    what="token query in the kernel")
    view.wait_until(lambda: view.page.locator("[data-testid=selected-token]").count() == 1, what="header token")
    assert view.page.locator("[data-testid=selected-token]").inner_text() == "t1"
    related = section(view, "trigrams").locator("[data-testid=list-copies_to] .pcw-tok")
    view.wait_until(lambda: related.count() > 0, what="related lists shown")
    direct = pcw.analysis.circuit_query(model, 0, 0, 1, "copies_to", k=related.count(), approximate=True)
    assert related.all_inner_texts() == [s for _, s, _ in direct]


def test_view_the_model_cannot_support_shows_a_notice_not_numbers(show):
    explorer = pcw.CircuitExplorer(paper_model(n_layers=1, dtype=torch.float32), "t1 t2 t3")
    view = show_explorer(show, explorer)
    composition = section(view, "composition")
    assert "at least 2 layers" in composition.locator("[data-testid=notice]").inner_text()
    assert composition.locator(".pcw-child").count() == 0
    assert section(view, "trigrams").locator("tr.trigram").first.is_visible()


def test_demo_writes_an_offline_page_showing_every_view(tmp_path, browser):
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # as if installed: run from another directory
    run = subprocess.run([sys.executable, "-m", "pycircuits_widgets.demo", "--out", "demo.html"], cwd=tmp_path,
                         capture_output=True, text=True, check=True, env=env)
    path = tmp_path / "demo.html"
    assert str(path) in run.stdout and "jupyter lab" in run.stdout
    context = browser.new_context(offline=True, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-pcw-ready]")
    for name, selector in VIEWS.items():
        assert page.locator(f"section[data-view={name}] {selector}").first.is_visible(), name
    assert page.locator("[data-testid=selected-head]").inner_text() != ""
    assert not errors
    context.close()
