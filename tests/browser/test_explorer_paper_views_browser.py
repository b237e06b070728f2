"""The paper views inside a saved explorer page (``save_html``, shipped attn-only-2l) in
headless Chromium with no kernel: the pair selection links them in the browser alone (a
composition cell, a virtual head or a path term selects a pair; a reading head brings its
strongest K-composition writer; a head term selects that head everywhere), and the composition
heatmap highlights the selected head. Waits are Playwright's auto-waiting assertions."""

import pytest
from playwright.sync_api import expect

import pycircuits_widgets as pcw
from harness import explorer_section as section
from harness import js_state, saved_page_open
from pycircuits_widgets.analysis.bigrams import bigram_top

pytestmark = pytest.mark.browser

TEXT = "def f(x):\n    return x + 1\n\ndef g(x):\n    return f(x) + 1\n"


@pytest.fixture(scope="module")
def saved_page(tmp_path_factory):
    explorer = pcw.CircuitExplorer(pcw.load_pretrained("attn-only-2l"), TEXT)
    path = tmp_path_factory.mktemp("saved") / "explorer.html"
    explorer.save_html(path)  # a small model: the paper views are computed into the page
    return explorer, path


@pytest.fixture
def offline(browser, saved_page):
    explorer, path = saved_page
    with saved_page_open(browser, path) as page:
        yield page, explorer


# the composition heatmap's highlighted row and column, read from its pixels: a band's edge is
# drawn in the palette's text colour (--pcw-text: whatever a translucent one covers, the pixel is
# within its transparency of it), which no diverging-scale score colour comes near
HIGHLIGHT = """(canvas) => {
  const [rows, cols] = [Number(canvas.dataset.rows), Number(canvas.dataset.cols)];
  const probe = document.createElement("canvas").getContext("2d", { willReadFrequently: true });
  probe.fillStyle = getComputedStyle(canvas).getPropertyValue("--pcw-text").trim();
  probe.fillRect(0, 0, 1, 1);
  const ink = probe.getImageData(0, 0, 1, 1).data;
  const slack = (1 - ink[3] / 255) * 255 + 8;
  const ctx = canvas.getContext("2d");
  const dpr = canvas.width / canvas.clientWidth;
  const cell = canvas.clientWidth / cols;
  const isInk = (x, y) => {
    const p = ctx.getImageData(Math.floor(x * dpr), Math.floor(y * dpr), 1, 1).data;
    return [0, 1, 2].every((i) => Math.abs(p[i] - ink[i]) <= slack);
  };
  // a column's left edge (and a row's top edge) sampled in every cell along it
  const col = [...Array(cols).keys()].filter((c) => [...Array(rows).keys()].filter((r) => isInk(c * cell + 1, (r + 0.5) * cell)).length > rows / 2);
  const row = [...Array(rows).keys()].filter((r) => [...Array(cols).keys()].filter((c) => isInk((c + 0.5) * cell, r * cell + 1)).length > cols / 2);
  return { row, col, marker: [canvas.dataset.headRow, canvas.dataset.headCol] };
}"""


def highlight(page):
    canvas = section(page, "composition").get_by_test_id("heatmap-correct")
    return canvas.evaluate(HIGHLIGHT)


def expect_pair_everywhere(page, explorer, pair):
    l1, h1, l2, h2 = pair
    expect(page.get_by_test_id("selected-head")).to_have_text(f"L{l2}.H{h2}")
    induction = section(page, "induction")
    expect(induction.get_by_test_id("h1-picker")).to_have_value(f"{l1},{h1}")
    expect(induction.get_by_test_id("h2-picker")).to_have_value(f"{l2},{h2}")
    key = ",".join(map(str, pair))
    expect(induction.get_by_test_id("verdict")).to_have_text(explorer.induction.pairs[key]["sentence"])
    for name in ("composition", "paths", "induction", "virtual"):
        assert js_state(page, getattr(explorer, name), ["selected_pair", "layer", "head"]) == [pair, l2, h2], name
    assert js_state(page, explorer, ["selected_pair", "layer", "head"]) == [pair, l2, h2]


def test_paper_sections_show_what_was_computed_at_save_time(offline):
    page, explorer = offline
    for name in ("paths", "induction", "positional", "virtual", "bigrams"):
        expect(section(page, name).get_by_test_id("on-demand")).to_have_count(0)
    expect(section(page, "paths").locator("tr.term")).to_have_count(16)
    expect(section(page, "virtual").locator("tr.vh")).to_have_count(len(explorer.virtual.heads))


def test_a_composition_cell_selects_the_pair_in_every_view_and_the_heatmap_highlights_its_head(offline):
    page, explorer = offline
    canvas = section(page, "composition").get_by_test_id("heatmap-correct")
    assert highlight(page)["row"] == [0] and highlight(page)["col"] == []  # L0.H0: its row (it writes)
    box = canvas.bounding_box()
    cell = box["width"] / 8
    canvas.click(position={"x": 5.5 * cell, "y": 3.5 * cell})  # row L0.H3 (writes), column L1.H5 (reads)
    expect_pair_everywhere(page, explorer, [0, 3, 1, 5])
    expect(canvas).to_have_attribute("data-head-col", "5")
    assert highlight(page) == {"row": [], "col": [5], "marker": ["", "5"]}  # L1.H5 reads: its column
    expect(section(page, "virtual").locator("tr.vh.selected")).to_have_count(
        sum(r["pair"] == [0, 3, 1, 5] for r in explorer.virtual.heads))


def test_a_reading_head_brings_its_strongest_writer_and_a_layer0_head_keeps_the_pair(offline):
    page, explorer = offline
    for head in (6, 2):
        section(page, "attention").locator(f"button.thumb[data-layer='1'][data-head='{head}']").click()
        writer = explorer.strongest_writer(1, head)  # the kernel's rule on the same K table
        expect_pair_everywhere(page, explorer, [*writer, 1, head])
        expect(section(page, "composition").get_by_test_id("heatmap-correct")).to_have_attribute("data-head-col", str(head))
        assert highlight(page)["col"] == [head]
    section(page, "attention").locator("button.thumb[data-layer='0'][data-head='4']").click()
    expect(page.get_by_test_id("selected-head")).to_have_text("L0.H4")
    assert js_state(page, explorer.induction, ["selected_pair"]) == [[*explorer.strongest_writer(1, 2), 1, 2]]
    expect(section(page, "composition").get_by_test_id("heatmap-correct")).to_have_attribute("data-head-row", "4")
    assert highlight(page)["row"] == [4] and highlight(page)["col"] == []
    # the pairs a head click reaches have their ranked tables in the page: no view says "needs a kernel"
    expect(page.get_by_test_id("error")).to_have_count(0)


def test_a_virtual_head_or_a_virtual_term_selects_its_pair(offline):
    page, explorer = offline
    row = section(page, "virtual").locator("tr.vh").nth(1)
    pair = [int(x) for x in row.get_attribute("data-pair").split(",")]
    row.locator("button.name").click()
    expect_pair_everywhere(page, explorer, pair)
    term = section(page, "paths").locator("tr.term button.name.virtual").first
    name = term.inner_text()
    term.click()
    (l1, h1), (l2, h2) = [(int(p.split(".H")[0][1:]), int(p.split(".H")[1])) for p in name.split(" → ")]
    expect_pair_everywhere(page, explorer, [l1, h1, l2, h2])


def test_a_head_term_selects_that_head_in_every_view(offline):
    page, explorer = offline
    term = section(page, "paths").locator("tr.term button.name:not(.virtual)").first
    label = term.inner_text()
    layer, head = int(label[1]), int(label.split(".H")[1])
    term.click()
    expect(page.get_by_test_id("selected-head")).to_have_text(label)
    thumb = section(page, "attention").locator("button.thumb.selected")
    expect(thumb).to_have_attribute("data-head", str(head))
    expect(section(page, "positional").get_by_test_id("summary")).to_contain_text(f"head {label}:")
    for name in ("attention", "trigrams", "composition", "eigen", "paths", "induction", "positional", "virtual"):
        assert js_state(page, getattr(explorer, name), ["layer", "head"]) == [layer, head], name


def test_a_token_clicked_in_the_loss_view_reaches_the_bigram_table(offline):
    page, explorer = offline
    token = section(page, "loss").locator(".token").nth(2)  # text position 3
    token.click()
    t = explorer.token_ids[3]
    expect(section(page, "bigrams").get_by_test_id("selected")).to_contain_text("after")
    assert js_state(page, explorer.bigrams, ["token"]) == [t]
    shown = section(page, "bigrams").get_by_test_id("next-tokens").locator(".pcw-tok").first.get_attribute("data-token-id")
    assert int(shown) == int(bigram_top(explorer.model, 10, [t])[1][0, 0])
