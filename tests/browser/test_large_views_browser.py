"""The views at real-model sizes in headless Chromium, from the real bundle: composition
labels and layer summary with drill-down, the attention grid following the selection and
filtered by layer, token strips that wrap, canvases that redraw when the host theme changes,
the explorer's layout from 400 to 1280 px, rotary models' eigenvalue view.

Oracles: the page's own geometry (bounding boxes, scroll sizes), canvas pixels read back,
the widgets' Python state."""

import itertools

import pytest
import torch

import pycircuits_widgets as pcw
from harness import show_explorer
from random_models import custom_model, paper_model

pytestmark = pytest.mark.browser

RED = "rgb(255, 0, 0)"


@pytest.fixture(scope="module")
def deep():
    """12 layers x 12 heads (144 heads: opens on the layer summary), tiny widths."""
    return custom_model(n_layers=12, n_heads=12, d_model=24, d_head=2, d_vocab=40, dtype=torch.float32)


def red_pixels(page, selector):
    """How many pixels of the canvas are pure-ish red (r > 200, g and b < 60)."""
    return page.evaluate(
        """(sel) => {
          const c = document.querySelector(sel);
          const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
          let n = 0;
          for (let i = 0; i < d.length; i += 4) if (d[i] > 200 && d[i + 1] < 60 && d[i + 2] < 60 && d[i + 3] > 200) n++;
          return n;
        }""",
        selector,
    )


def boxes(locator):
    return [b for b in (locator.nth(i).bounding_box() for i in range(locator.count())) if b]


def test_composition_labels_layers_on_both_axes_and_leaves_the_undefined_half_blank(show):
    m3 = paper_model(n_layers=3, n_heads=4, d_model=32, d_head=8, dtype=torch.float32)
    w = pcw.CompositionMatrix(m3)
    view = show(w)
    page = view.page
    # every head labelled (room for each), each layer's first head marked as its boundary
    rows = page.get_by_test_id("row-labels-heads")
    cols = page.get_by_test_id("col-labels-heads")
    assert rows.locator("span").all_inner_texts() == [f"L{l}.H{h}" for l in (0, 1) for h in range(4)]
    assert cols.locator("span").all_inner_texts() == [f"L{l}.H{h}" for l in (1, 2) for h in range(4)]
    assert rows.locator("span.layer-start").all_inner_texts() == ["L0.H0", "L1.H0"]
    assert cols.locator("span.layer-start").all_inner_texts() == ["L1.H0", "L2.H0"]
    canvas = page.get_by_test_id("heatmap-correct")
    cell = canvas.bounding_box()["width"] / 8
    # row 4 = L1.H0, column 0 = L1.H0: same layer, undefined -> not drawn (transparent)
    alpha = page.evaluate(
        f"""([x, y]) => {{
          const c = document.querySelector("[data-testid=heatmap-correct]");
          const k = c.width / c.getBoundingClientRect().width;
          return [c.getContext("2d").getImageData(x * k, y * k, 1, 1).data[3],
                  c.getContext("2d").getImageData(x * k, (y - 4 * {cell:f}) * k, 1, 1).data[3]];
        }}""",
        [0.5 * cell, 4.5 * cell],
    )
    assert alpha == [0, 255]  # undefined L1 -> L1 blank; defined L0 -> L1 painted
    canvas.hover(position={"x": 6.5 * cell, "y": 4.5 * cell})
    assert page.get_by_test_id("readout").inner_text().startswith("L1.H0 → L2.H2: K-composition")


def test_composition_of_a_deep_model_opens_on_layers_and_zooms_into_a_layer_pair(show, deep):
    w = pcw.CompositionMatrix(deep, lazy=False)
    view = show(w)
    page = view.page
    rows = page.get_by_test_id("row-labels-layers").locator("span").all_inner_texts()
    cols = page.get_by_test_id("col-labels-layers").locator("span").all_inner_texts()
    assert rows == [f"L{l}" for l in range(11)] and cols == [f"L{l}" for l in range(1, 12)]
    summary = page.get_by_test_id("summary-correct")
    cell = summary.bounding_box()["width"] / 11
    summary.click(position={"x": 4.5 * cell, "y": 2.5 * cell})  # L2 -> L5
    assert page.locator("[data-grid=block] .sub").inner_text() == "heads of L2 → L5"
    heads = page.get_by_test_id("heatmap-correct")
    hcell = heads.bounding_box()["width"] / 12
    assert page.get_by_test_id("row-labels-block").locator("span").first.inner_text() == "L2.H0"
    heads.hover(position={"x": 7.5 * hcell, "y": 3.5 * hcell})
    assert page.get_by_test_id("readout").inner_text().startswith("L2.H3 → L5.H7: K-composition")
    heads.click(position={"x": 7.5 * hcell, "y": 3.5 * hcell})
    assert w.selected_pair == [2, 3, 5, 7]
    # every head pair at once: layer labels readable, none overlapping
    page.get_by_test_id("mode-heads").click()
    spans = boxes(page.get_by_test_id("col-labels-heads").locator("span"))
    assert len(spans) >= 4
    assert all(a["x"] + a["width"] <= b["x"] + 0.5 for a, b in itertools.pairwise(spans))


def test_attention_grid_scrolls_the_selected_head_into_view_and_filters_by_layer(show, deep):
    w = pcw.AttentionPatterns(deep, "t1 t2 t3 t4")
    view = show(w)
    page = view.page
    grid = page.get_by_test_id("head-grid")
    w.layer, w.head = 11, 11  # from Python (or another view): the grid follows
    view.flush()
    thumb = page.locator('.thumb[data-layer="11"][data-head="11"]')
    view.wait_until(lambda: thumb.get_attribute("aria-selected") == "true", what="selected thumbnail")

    def inside(g, t):
        return g["y"] <= t["y"] and t["y"] + t["height"] <= g["y"] + g["height"] + 1

    view.wait_until(lambda: inside(grid.bounding_box(), thumb.bounding_box()), what="the grid scrolled to it")
    assert page.evaluate("document.scrollingElement.scrollTop") == 0  # the grid scrolled, not the page
    page.get_by_test_id("layer-filter").select_option("3")
    layers = page.locator("button.thumb").evaluate_all("els => els.map((e) => e.dataset.layer)")
    assert layers == ["3"] * 12


LONG = " ".join(f"t{i % 40}" for i in range(400))


def test_token_strips_wrap_inside_their_box(show, page):
    page.set_viewport_size({"width": 818, "height": 900})
    tokens = [f" word{i}" for i in range(600)]
    loss = pcw.ColoredTokens(tokens, torch.rand(600))
    attention = pcw.AttentionPatterns(custom_model(d_vocab=40, n_ctx=512, dtype=torch.float32), LONG)
    view = show(loss, attention)
    for selector in (".pcw-colored-tokens .tokens", ".pcw-attention .tokens"):
        strip = view.page.locator(selector)
        width = strip.evaluate("el => [el.scrollWidth, el.clientWidth]")
        assert width[0] <= width[1], selector
        right = strip.bounding_box()["x"] + strip.bounding_box()["width"]
        last = strip.locator(".token").last.bounding_box()
        assert last["x"] + last["width"] <= right + 1, selector


def test_canvases_redraw_when_the_host_theme_changes(show):
    m3 = paper_model(n_layers=3, n_heads=4, d_model=32, d_head=8, dtype=torch.float32)
    comp = pcw.CompositionMatrix(m3)
    attention = pcw.AttentionPatterns(m3, "t1 t2 t3 t4 t5")
    view = show(comp, attention)
    page = view.page
    heat, detail = "[data-testid=heatmap-correct]", ".pcw-attention canvas.detail"
    assert red_pixels(page, heat) == 0 and red_pixels(page, detail) == 0
    # what JupyterLab does on a theme switch: new CSS variables on <body>, nothing else
    page.evaluate("""(red) => {
        document.body.style.setProperty("--jp-border-color1", red);
        document.body.style.setProperty("--jp-ui-font-color2", red);
    }""", RED)
    view.wait_until(lambda: red_pixels(page, heat) > 0 and red_pixels(page, detail) > 0, what="canvases redrawn")


@pytest.mark.parametrize("width", [400, 1280])
def test_explorer_has_no_sideways_scroll_and_no_hidden_table_column(show, page, width):
    page.set_viewport_size({"width": width, "height": 900})
    model = paper_model(n_layers=2, n_heads=3, n_ctx=64, dtype=torch.float32)
    explorer = pcw.CircuitExplorer(model, "t1 t2 t3 t4 t1 t2 t3 t4 " * 6)
    explorer.wait()
    show_explorer(show, explorer)
    page.locator(".pcw-explorer section[data-view=trigrams] tr.trigram").first.wait_for()
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    overflow = page.locator(".pcw-explorer section").evaluate_all(
        "els => els.filter((e) => e.scrollWidth > e.clientWidth + 1).map((e) => e.dataset.view)")
    assert overflow == []
    if width >= 1280:  # the skip-trigram table shows all its columns without scrolling
        table = page.locator("section[data-view=trigrams] [data-testid=trigram-table]")
        section = page.locator("section[data-view=trigrams]").bounding_box()
        box = table.bounding_box()
        assert box["x"] + box["width"] <= section["x"] + section["width"]


def test_explorer_header_shows_the_short_model_name(show):
    model = custom_model(name="/home/me/models/SmolLM-135M/", dtype=torch.float32)
    explorer = pcw.CircuitExplorer(model, "t1 t2 t3")
    view = show(explorer)
    assert view.page.get_by_test_id("model-name").inner_text() == "SmolLM-135M"


def test_rotary_eigenvalue_plot_shows_qk_at_each_heads_strongest_offset(show):
    rotary = custom_model(n_layers=3, n_heads=3, positional="rotary", rotary_dim=6, dtype=torch.float32)
    w = pcw.EigenvaluePlot(rotary, scores={}, offsets=range(0, 4))
    view = show(w)
    page = view.page
    assert "at the strongest of query - key offsets 0..3" in page.get_by_test_id("offset-note").inner_text()
    assert page.locator("g.head").count() == 9
    assert "QK not defined" not in page.get_by_test_id("scatter").text_content()
    page.locator('g.head[data-label="L2.H1"] circle').click()
    w.wait()
    view.wait_until(lambda: page.get_by_test_id("spectrum-QK").count() == 1
                    and "head L2.H1" in page.get_by_test_id("detail").inner_text(), what="QK spectrum")
    assert f"at offset {w.detail['qk_offset']}" in page.get_by_test_id("detail").inner_text()
    # labels stay inside the plot
    svg = page.get_by_test_id("scatter").bounding_box()
    for b in boxes(page.get_by_test_id("head-labels").locator("text.label")):
        assert svg["x"] <= b["x"] and b["x"] + b["width"] <= svg["x"] + svg["width"] + 0.5
