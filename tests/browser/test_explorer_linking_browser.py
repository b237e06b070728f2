"""A saved explorer page (``save_html``) in headless Chromium with no kernel at all: a click
on a head or a token in any view moves every view to it, in the browser alone. Waits are
Playwright's auto-waiting assertions on the page, never sleeps."""

import pytest
import torch
from playwright.sync_api import expect

import pycircuits_widgets as pcw
from harness import explorer_section as section
from harness import js_state, saved_page_open
from random_models import paper_model

pytestmark = pytest.mark.browser

TEXT = "t1 t2 t3 t4 t1 t2 t3 t9"


@pytest.fixture(scope="module")
def saved_page(tmp_path_factory):
    explorer = pcw.CircuitExplorer(paper_model(n_layers=2, n_heads=3, dtype=torch.float32), TEXT)
    path = tmp_path_factory.mktemp("saved") / "explorer.html"
    explorer.save_html(path)
    return explorer, path


@pytest.fixture
def offline(browser, saved_page):
    explorer, path = saved_page
    with saved_page_open(browser, path) as page:
        yield page, explorer


def expect_head_everywhere(page, explorer, layer, head):
    label = f"L{layer}.H{head}"
    expect(page.get_by_test_id("selected-head")).to_have_text(label)
    thumb = section(page, "attention").locator("button.thumb.selected")
    expect(thumb).to_have_attribute("data-layer", str(layer))
    expect(thumb).to_have_attribute("data-head", str(head))
    expect(section(page, "attention").locator(".detail-head strong")).to_have_text(f"head {label}")
    expect(section(page, "eigen").locator("g.head[aria-pressed=true]")).to_have_attribute("data-label", label)
    expect(section(page, "trigrams").get_by_test_id("layer-picker")).to_have_value(str(layer))
    expect(section(page, "trigrams").get_by_test_id("head-picker")).to_have_value(str(head))
    for name in ("attention", "trigrams", "composition", "eigen"):
        assert js_state(page, getattr(explorer, name), ["layer", "head"]) == [layer, head], name
    assert js_state(page, explorer, ["layer", "head"]) == [layer, head]


def expect_token_everywhere(page, explorer, position, token, text):
    header = page.get_by_test_id("selection")
    expect(page.get_by_test_id("selected-token")).to_have_text(text)
    if position >= 0:
        expect(header).to_contain_text(f"at position {position}")
        expect(section(page, "attention").locator(".token.pinned")).to_have_attribute("data-index", str(position))
        expect(section(page, "loss").locator(".token.selected")).to_have_text(text)
    else:
        expect(section(page, "attention").locator(".token.pinned")).to_have_count(0)
        expect(section(page, "loss").locator(".token.selected")).to_have_count(0)
    assert js_state(page, explorer, ["position", "token"]) == [position, token]
    assert js_state(page, explorer.trigrams, ["token"]) == [token]
    assert js_state(page, explorer.attention, ["position"]) == [position]
    assert js_state(page, explorer.loss, ["position"]) == [position]


def test_head_clicked_in_the_attention_view_moves_every_view(offline):
    page, explorer = offline
    expect_head_everywhere(page, explorer, 0, 0)
    section(page, "attention").locator("button.thumb[data-layer='1'][data-head='2']").click()
    expect_head_everywhere(page, explorer, 1, 2)
    # no kernel: the page's precomputed answers give the new head's table and spectrum
    expect(section(page, "trigrams").locator("caption")).to_contain_text("skip-trigrams of head L1.H2")
    expect(section(page, "eigen").get_by_test_id("detail")).to_contain_text("head L1.H2:")
    expect(section(page, "trigrams").get_by_test_id("stale-note")).to_have_count(0)


def test_head_clicked_in_the_eigenvalue_plot_or_picked_in_the_table_moves_every_view(offline):
    page, explorer = offline
    section(page, "eigen").locator("g.head[data-label='L1.H1'] circle").click()
    expect_head_everywhere(page, explorer, 1, 1)
    section(page, "trigrams").get_by_test_id("head-picker").select_option("0")
    expect_head_everywhere(page, explorer, 1, 0)
    section(page, "eigen").locator("g.head[data-label='L0.H0'] circle").click()
    expect_head_everywhere(page, explorer, 0, 0)
    expect(section(page, "trigrams").locator("caption")).to_contain_text("skip-trigrams of head L0.H0")


def test_tokens_clicked_in_the_loss_attention_and_trigram_views_move_every_view(offline):
    page, explorer = offline
    section(page, "loss").locator(".token").nth(3).click()  # loss view starts at text position 1
    expect_token_everywhere(page, explorer, 4, 1, "t1")
    section(page, "attention").locator(".token[data-index='2']").click()
    expect_token_everywhere(page, explorer, 2, 3, "t3")
    first = section(page, "trigrams").locator("tr.trigram .pcw-tok").first
    token = int(first.get_attribute("data-token-id"))
    first.click()
    ids = explorer.token_ids
    position = max((i for i, t in enumerate(ids) if t == token), default=-1)
    expect_token_everywhere(page, explorer, position, token, f"t{token}" if position >= 0 else f"id {token}")
