"""Never another head's numbers: on a saved explorer page (``save_html``, no kernel) whose saved
answers leave some heads out (a small answers budget, as a large model's page does), clicking such
a head greys what the view showed and names whose it is; nothing sits under the new head's label
as if it were its own. Waits are Playwright's auto-waiting assertions, never sleeps."""

import json

import pytest
import torch
from playwright.sync_api import expect

import pycircuits_widgets as pcw
from harness import explorer_section as section
from harness import page_room, saved_page_open
from pycircuits_widgets.widgets.core import offline
from pycircuits_widgets.widgets.core.save_plan import MEASURED
from random_models import paper_model

pytestmark = pytest.mark.browser

TEXT = "t1 t2 t3 t4 t1 t2 t3 t9"
HEADS = [(layer, head) for layer in range(2) for head in range(3)]


def saved_heads(view) -> set:
    """The heads whose answer the saved page holds (the view's own ``layer``/``head`` rule)."""
    rule = next(r for r in offline.rules(view._offline) if r["on"] == ["layer", "head"])
    return {tuple(json.loads(f"[{k}]")) for k in rule["patches"]}


@pytest.fixture(scope="module")
def saved_page(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offline, "BUDGET", 2500)  # room for a head or two of each weight-only view, not all six
        explorer = pcw.CircuitExplorer(paper_model(n_layers=2, n_heads=3, dtype=torch.float32), TEXT)
        # a page with room for the selected head's table, not the other heads' (save_plan.REST)
        path = explorer.save_html(tmp_path_factory.mktemp("saved") / "explorer.html",
                                  max_bytes=page_room([explorer], MEASURED, more=1000))
    return explorer, path


def greyed(locator) -> bool:
    return locator.evaluate("n => Number(getComputedStyle(n).opacity) < 1")


def test_a_head_without_a_saved_table_greys_the_last_one_and_names_it(browser, saved_page):
    explorer, path = saved_page
    kept = saved_heads(explorer.trigrams)
    missing = [h for h in HEADS if h not in kept]
    assert (0, 0) in kept and missing, kept  # the page's own head saved, some left out
    layer, head = missing[-1]
    with saved_page_open(browser, path) as page:
        trigrams = section(page, "trigrams")
        expect(trigrams.locator("caption")).to_contain_text("skip-trigrams of head L0.H0")
        expect(trigrams.locator(".scroll")).not_to_have_attribute("data-stale", "L0.H0")
        section(page, "attention").locator(f"button.thumb[data-layer='{layer}'][data-head='{head}']").click()
        expect(page.get_by_test_id("selected-head")).to_have_text(f"L{layer}.H{head}")
        expect(trigrams.get_by_test_id("offline-note")).to_contain_text("needs a running kernel")
        note = trigrams.get_by_test_id("stale-note")
        expect(note).to_contain_text(f"No table of head L{layer}.H{head} here: it needs a running kernel")
        expect(note).to_contain_text("greyed below: head L0.H0's")
        shown = trigrams.locator(".scroll")
        expect(shown).to_have_attribute("data-stale", "L0.H0")
        assert greyed(shown)
        expect(trigrams.locator("caption")).to_contain_text("skip-trigrams of head L0.H0")  # labelled with its own head
        # back on a saved head: its own table, not greyed, no note
        section(page, "attention").locator("button.thumb[data-layer='0'][data-head='0']").click()
        expect(trigrams.get_by_test_id("stale-note")).to_have_count(0)
        expect(shown).not_to_have_attribute("data-stale", "L0.H0")
        assert not greyed(shown)


def test_every_head_view_greys_a_result_that_is_not_the_selected_head_s(browser, saved_page):
    """The eigenvalue detail too; the other head sections hold every head (attention, positional) or
    key their results by the selection (induction, neurons), so they have nothing stale to show."""
    explorer, path = saved_page
    missing = [h for h in HEADS if h not in saved_heads(explorer.eigen)]
    assert missing, "the eigenvalue details of every head fit the budget: lower it"
    layer, head = missing[-1]
    with saved_page_open(browser, path) as page:
        eigen = section(page, "eigen")
        section(page, "attention").locator(f"button.thumb[data-layer='{layer}'][data-head='{head}']").click()
        expect(page.get_by_test_id("selected-head")).to_have_text(f"L{layer}.H{head}")
        expect(eigen.get_by_test_id("stale-note")).to_contain_text(f"No spectrum of head L{layer}.H{head} here")
        stale = eigen.locator("[data-stale]")
        expect(stale).to_have_attribute("data-stale", "L0.H0")
        assert greyed(stale)
        expect(stale.locator(".title")).to_contain_text("head L0.H0:")


def test_a_pair_without_a_saved_composition_detail_greys_the_last_one(browser, saved_page):
    explorer, path = saved_page
    comp = explorer.composition
    rule = next(r for r in offline.rules(comp._offline) if r["on"] == ["selected_pair", "kind"])
    kept = {(tuple(pair), kind) for pair, kind in (json.loads(f"[{k}]") for k in rule["patches"])}
    pairs = [(0, h1, 1, h2) for h1 in range(3) for h2 in range(3)]
    missing = next(p for p in pairs if (p, comp.kind) not in kept)
    shown = next(p for p in pairs if (p, comp.kind) in kept)
    with saved_page_open(browser, path) as page:
        view = section(page, "composition")
        select = "([id, pair]) => window.pcwHost.models.get(id).set('selected_pair', pair)"  # as a cell's click does
        page.evaluate(select, [comp.model_id, list(shown)])
        title = view.get_by_test_id("detail").locator(".title")
        label = f"L{shown[0]}.H{shown[1]} → L{shown[2]}.H{shown[3]}"
        expect(title).to_contain_text(f"{comp.kind}-composition {label}")
        expect(view.get_by_test_id("stale-note")).to_have_count(0)
        page.evaluate(select, [comp.model_id, list(missing)])
        note = view.get_by_test_id("stale-note")
        expect(note).to_contain_text(f"No {comp.kind}-composition detail of L{missing[0]}.H{missing[1]} → "
                                     f"L{missing[2]}.H{missing[3]} here")
        stale = view.get_by_test_id("detail").locator("[data-stale]")
        expect(stale).to_have_attribute("data-stale", label)
        assert greyed(stale)
