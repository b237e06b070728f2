"""Legible at real size, from the real bundle in headless Chromium: eigenvalue-plot labels
that never overlap (16, 144 and 1200 heads), composition axes labelled by head, long
whitespace tokens shown counted with the exact string in their title.

Oracles: the page's own geometry (every label's bounding box as drawn) and the widgets'
Python state and token strings."""

import itertools
import re

import pytest
import torch

import pycircuits_widgets as pcw
from harness import token_as_shown
from random_models import custom_model

pytestmark = pytest.mark.browser

SHAPES = {16: (2, 8), 144: (12, 12), 1200: (30, 40)}


@pytest.fixture(scope="module")
def shipped():
    return pcw.load_pretrained("attn-only-2l")  # 2 x 8 heads: the L1.H5 hidden under a label


def model_of(n_heads, shipped):
    if n_heads == 16:
        return shipped
    L, H = SHAPES[n_heads]
    return custom_model(n_layers=L, n_heads=H, d_model=16, d_head=2, d_vocab=40, dtype=torch.float32)


def boxes(locator):
    return [locator.nth(i).bounding_box() for i in range(locator.count())]


def glyph_boxes(locator):
    """Where each text element's glyphs are drawn (its halo, a stroke, left out)."""
    return locator.evaluate_all("els => els.map((e) => { const r = e.getBoundingClientRect();"
                                " return {x: r.x, y: r.y, width: r.width, height: r.height}; })")


def intersect(a, b, slack=0.5):
    return (a["x"] + slack < b["x"] + b["width"] and b["x"] + slack < a["x"] + a["width"]
            and a["y"] + slack < b["y"] + b["height"] and b["y"] + slack < a["y"] + a["height"])


def assert_no_two_labels_overlap(page):
    labels = page.get_by_test_id("head-labels").locator("text.label")
    placed = glyph_boxes(labels)
    clash = [(labels.nth(i).text_content(), labels.nth(j).text_content())
             for (i, a), (j, b) in itertools.combinations(enumerate(placed), 2) if intersect(a, b)]
    assert not clash, (clash, [(labels.nth(i).text_content(), b) for i, b in enumerate(placed)])
    svg = page.get_by_test_id("scatter").bounding_box()
    for b in placed:  # inside the plot
        assert svg["x"] <= b["x"] and b["x"] + b["width"] <= svg["x"] + svg["width"] + 0.5
    return labels


@pytest.mark.parametrize("n_heads", [16, 144, 1200])
def test_eigen_labels_never_overlap_and_the_selected_head_is_always_labelled(show, shipped, n_heads):
    model = model_of(n_heads, shipped)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    w = pcw.EigenvaluePlot(model, scores={}, layer=L - 1, head=H // 2)
    assert w.wait(120)
    view = show(w)
    page = view.page
    view.wait_until(lambda: page.locator("g.head").count() == L * H, what="every head drawn")
    labels = assert_no_two_labels_overlap(page)
    shown = labels.all_text_contents()
    assert f"L{L - 1}.H{H // 2}" in shown
    assert len(shown) >= (L * H // 2 if n_heads == 16 else 6)  # the extremes at least
    # a head without a label: selecting it labels it, and still no label overlaps another
    unlabelled = next(f"L{l}.H{h}" for l in range(L) for h in range(H) if f"L{l}.H{h}" not in shown)
    page.locator(f'g.head[data-label="{unlabelled}"]').focus()
    page.locator(f'g.head[data-label="{unlabelled}"]').press("Enter")
    assert f"L{w.layer}.H{w.head}" == unlabelled
    view.wait_until(lambda: unlabelled in labels.all_text_contents(), what="selected head labelled")
    assert page.locator(f'text.label.selected[data-for="{unlabelled}"]').is_visible()
    assert_no_two_labels_overlap(page)
    # every other head: its label on hover, its name in the tooltip
    other = next(f"L{l}.H{h}" for l in range(L) for h in range(H)
                 if f"L{l}.H{h}" not in labels.all_text_contents())
    point = page.locator(f'g.head[data-label="{other}"]')
    assert point.locator("title").text_content().startswith(f"head {other}\n")
    point.dispatch_event("mouseenter")
    assert page.locator(f'text.label.hover[data-for="{other}"]').text_content() == other
    point.dispatch_event("mouseleave")
    assert page.locator("text.label.hover").count() == 0


def test_composition_axes_name_heads_at_every_zoom_with_layer_starts_marked(show, shipped):
    L, H = SHAPES[144]
    w = pcw.CompositionMatrix(model_of(144, shipped), lazy=False)
    view = show(w)
    page = view.page
    page.get_by_test_id("mode-heads").click()
    heatmap = page.get_by_test_id("heatmap-correct")
    cell = heatmap.bounding_box()["height"] / ((L - 1) * H)
    for axis, layers in (("row", range(L - 1)), ("col", range(1, L))):
        spans = page.get_by_test_id(f"{axis}-labels-heads").locator("span")
        texts = spans.all_inner_texts()
        assert texts and all(re.fullmatch(r"L\d+\.H\d+", t) for t in texts), texts
        assert spans.locator("xpath=self::*[contains(@class, 'layer-start')]").all_inner_texts() == \
            [f"L{l}.H0" for l in layers]  # every layer boundary named
        assert not [pair for pair in itertools.combinations(boxes(spans), 2) if intersect(*pair)]
    # each label sits on its own row: L3.H4 is row 3 * H + 4 of the heatmap
    label = page.get_by_test_id("row-labels-heads").locator("span", has_text=re.compile(r"^L3\.H4$")).bounding_box()
    top = heatmap.bounding_box()["y"]
    assert abs(label["y"] + label["height"] / 2 - (top + (3 * H + 4.5) * cell)) <= 1.5
    # hover names the exact head pair
    heatmap.hover(position={"x": (4 * H + 7.5) * cell, "y": (3 * H + 4.5) * cell})
    assert page.get_by_test_id("readout").inner_text().startswith("L3.H4 → L5.H7: ")
    # the zoomed layer pair (layer summary): every head of both layers named
    page.get_by_test_id("mode-layers").click()
    page.get_by_test_id("summary-correct").click(position={"x": 3, "y": 3})  # L0 -> L1
    assert page.get_by_test_id("row-labels-block").locator("span").all_inner_texts() == [f"L0.H{h}" for h in range(H)]
    assert page.get_by_test_id("col-labels-block").locator("span").all_inner_texts() == [f"L1.H{h}" for h in range(H)]


def test_long_whitespace_tokens_show_counted_with_the_exact_string_in_the_title(show, shipped):
    run = "\n" + " " * 23  # the shipped tokenizer's token 703
    (token,) = shipped.to_tokens(run).tolist()
    exact = shipped.token_strings[token]
    assert exact == "↵" + "·" * 23
    colored = pcw.ColoredTokens(["def", run, " x"], [1.0, 2.0, 3.0])
    table = pcw.SkipTrigramTable(shipped, token=token)
    view = show(colored, table)
    page = view.page
    strip = page.locator(".pcw-colored-tokens .token")
    assert strip.all_inner_texts() == ["def", "↵·×23", "·x"] == [token_as_shown(s) for s in ("def", exact, "·x")]
    assert exact in strip.nth(1).get_attribute("title")
    chip = page.get_by_test_id("related").locator(f".pcw-tok[data-token-id='{token}']").first
    assert chip.inner_text() == "↵·×23"
    assert chip.get_attribute("title") == f"token {token}: {exact}"
