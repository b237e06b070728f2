"""Figures (js/src/lib/figure.js, ``CircuitWidget.save_figure``) in real headless Chromium: every view
of the registry downloads its figure from its own "figure" menu on an offline saved page (the view
gallery's saved views, scripts/gallery.py), and the SVG parses and holds the labels the view shows,
its title and its selection, and none of the page's controls (and, for tools that draw no HTML in an
SVG, the same figure as a picture); the PNG decodes (by Chromium), is as
large as the SVG at 3 pixels per CSS pixel, says its dpi and is not blank. Then ``save_figure`` from
Python, in each format, of an explorer's section."""

import asyncio
import base64
import concurrent.futures
import importlib.util
import json
import pathlib
import re
import struct
import sys
import xml.etree.ElementTree as ET

import pytest

import pycircuits_widgets as pcw
from harness import saved_page_open
from pycircuits_widgets.widgets.views.registry import BY_NAME

pytestmark = pytest.mark.browser

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "js" / "test" / "fixtures" / "views"
SVG = "{http://www.w3.org/2000/svg}"
SCALE = 3
"""PNG pixels per CSS pixel (lib/figure.js FIGURE_SCALE)."""
DPI = 96 * SCALE

# Per view, elements whose text the figure must hold: its legend, axes, head labels, values.
LABELS = {
    "loss": ["[data-testid=legend-label]"],
    "causal": ["[data-testid=head-loss-0-1]", "[data-testid=ablate-zero]"],
    "circuit": ["[data-testid=rank-head_out]", "[data-testid=exact-head_out-0-2]"],
    "attention": ["[data-testid=legend-label]", "[data-testid=head-grid] .label"],
    "trigrams": ["[data-testid=trigram-table] th"],
    "examples": ["[data-testid=legend-label]", "[data-testid=score]"],
    "composition": ["[data-testid=legend-label]", "[data-testid=col-labels-heads] *", "[data-testid=detail-weights]"],
    "eigen": ["[data-testid=scatter] text"],
    "paths": ["[data-testid=ladder-loss]", "[data-testid=importance-value]"],
    "induction": ["[data-testid=value-qk]", "[data-testid=kcomp-score]"],
    "positional": ["[data-testid=positional-peak]", "[data-testid=attention-max]"],
    "neurons": ["[data-testid=mlp-layer]", "[data-testid=value]"],
    "virtual": ["[data-testid=norm]", "[data-testid=positivity]"],
    "bigrams": ["[data-testid=logit]"],
}

# A PNG decoded by Chromium: its size and how many distinct colours it has (at most 3 counted).
DECODE_JS = """async (b64) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const bitmap = await createImageBitmap(new Blob([bytes], { type: "image/png" }));
  const canvas = new OffscreenCanvas(bitmap.width, bitmap.height);
  const ctx = canvas.getContext("2d");
  ctx.drawImage(bitmap, 0, 0);
  const data = new Uint32Array(ctx.getImageData(0, 0, bitmap.width, bitmap.height).data.buffer);
  const colours = new Set();
  for (let i = 0; i < data.length && colours.size < 3; i++) colours.add(data[i]);
  return { width: bitmap.width, height: bitmap.height, colours: colours.size };
}"""


def squeezed(text: str) -> str:
    """Text without whitespace (a page's and an SVG's text break lines in different places)."""
    return re.sub(r"\s+", "", text)


def svg_root(data: bytes) -> ET.Element:
    root = ET.fromstring(data)
    assert root.tag == f"{SVG}svg", f"expected an <svg> document, got <{root.tag}>"
    return root


def png_facts(data: bytes) -> dict:
    """The PNG's header size and its pHYs dpi (None without one)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"not a PNG: starts with {data[:8]!r}"
    width, height = struct.unpack(">II", data[16:24])
    at = data.find(b"pHYs")
    dpi = None if at < 0 else round(struct.unpack(">I", data[at + 4:at + 8])[0] * 0.0254)
    return {"width": width, "height": height, "dpi": dpi}


def check_png(page, data: bytes, svg: ET.Element) -> None:
    facts = png_facts(data)
    assert facts["dpi"] == DPI
    decoded = page.evaluate(DECODE_JS, base64.b64encode(data).decode("ascii"))
    expected = (int(float(svg.get("width"))) * SCALE, int(float(svg.get("height"))) * SCALE)
    assert (decoded["width"], decoded["height"]) == (facts["width"], facts["height"]) == expected
    assert decoded["colours"] > 1, "the PNG is one colour: blank"


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> pathlib.Path:
    spec = importlib.util.spec_from_file_location("gallery", ROOT / "scripts" / "gallery.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("figures") / "gallery.html"
    out.write_text(module.gallery_html(), encoding="utf-8")
    return out


def download(page, scope, fmt: str) -> bytes:
    """The figure the view's own menu downloads in format ``fmt``."""
    scope.get_by_test_id("figure-menu").first.click()
    with page.expect_download() as info:
        scope.get_by_test_id(f"figure-{fmt}").first.click()
    assert info.value.suggested_filename.endswith(f".{fmt}")
    return pathlib.Path(info.value.path()).read_bytes()


def saved_state(name: str) -> dict:
    """The state the gallery's view ``name`` renders (its saved view, js/test/fixtures/views)."""
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))["widgets"][0]["state"]


@pytest.mark.parametrize("name", list(BY_NAME))
def test_every_view_downloads_its_figure_with_its_labels(browser, gallery, name):
    state = saved_state(name)
    with saved_page_open(browser, gallery) as page:
        cell = page.locator(f"h2[data-view={name}] + .pcw-cell")
        view = cell.locator(".pcw-view").first
        labels = [squeezed(t) for sel in LABELS[name] for t in view.locator(sel).all_text_contents()]
        assert [t for t in labels if t], f"the {name} view shows none of {LABELS[name]}: the test would read nothing"

        svg = svg_root(download(page, cell, "svg"))
        text = squeezed("".join(svg.itertext()))
        missing = [t for t in labels if t not in text]
        assert not missing, f"the {name} figure lacks labels its view shows: {missing[:5]}"
        # its title: the view's name in words ("EigenvaluePlot": "Eigenvalue plot")
        title = svg.find(f"{SVG}title").text.lower()
        words = [w.lower() for w in re.findall(r"[A-Z][a-z]+", state["_view"])]
        assert all(w in title for w in words), f"the figure's title {title!r} does not name {state['_view']}"
        # its selection, as the view's state holds it
        if isinstance(state.get("head"), int) and state["head"] >= 0:
            assert squeezed(f"head L{state['layer']}.H{state['head']}") in text
        # for tools that draw no HTML in an SVG: the same figure as a picture, after the HTML
        switch = svg.find(f"{SVG}switch")
        assert [child.tag for child in switch] == [f"{SVG}foreignObject", f"{SVG}image"]
        assert switch[1].get("href").startswith("data:image/png;base64,")
        # none of the page's chrome
        assert "⤓" not in text, "the figure holds its own download menu"
        assert "data-chrome" not in ET.tostring(svg, encoding="unicode")

        check_png(page, download(page, cell, "png"), svg)


TEXT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def explorer():
    e = pcw.CircuitExplorer(pcw.load_pretrained("attn-only-2l"), TEXT, layer=1, head=6)
    yield e
    e.close()


def test_an_explorer_section_saves_its_figure_as_svg_from_python(explorer, tmp_path):
    path = explorer.save_figure(tmp_path / "attention.svg", section="attention")
    svg = svg_root(path.read_bytes())
    text = squeezed("".join(svg.itertext()))
    # the section's title, the selection, every head's label and the legend
    for label in [BY_NAME["attention"].title, "head L1.H6", "attention",
                  *(f"L{layer}.H{head}" for layer in range(2) for head in range(8))]:
        assert squeezed(label) in text, f"the attention figure lacks {label!r}"
    assert "runmodel" not in text, "the figure holds the text box's 'run model' button"


def test_a_narrower_page_makes_a_narrower_figure_of_the_same_view(explorer, tmp_path):
    wide = svg_root(explorer.save_figure(tmp_path / "wide.svg", section="attention").read_bytes())
    narrow = svg_root(explorer.save_figure(tmp_path / "narrow.svg", section="attention", width=600).read_bytes())
    assert int(narrow.get("width")) <= 600 < int(wide.get("width"))
    assert int(narrow.get("height")) > int(wide.get("height")), "the head grid should wrap into more rows"
    text = squeezed("".join(narrow.itertext()))
    assert all(f"L{layer}.H{head}" in text for layer in range(2) for head in range(8))


def test_an_explorer_section_saves_its_figure_as_png_from_python(explorer, tmp_path, page):
    path = explorer.save_figure(tmp_path / "eigen.png", section="eigen")
    svg = svg_root(explorer.save_figure(tmp_path / "eigen.svg", section="eigen").read_bytes())
    assert BY_NAME["eigen"].title in svg.find(f"{SVG}title").text
    check_png(page, path.read_bytes(), svg)


def test_save_figure_works_where_an_event_loop_runs(explorer, tmp_path):
    """A notebook's kernel runs an event loop in the thread a cell runs in, where Playwright's sync API
    refuses to start: save_figure draws in a thread of its own."""

    async def in_a_cell():
        return explorer.save_figure(tmp_path / "loss.svg", section="loss")

    # the cell's thread: one of its own (this test's may hold the session's sync Playwright, which runs a loop)
    with concurrent.futures.ThreadPoolExecutor(1) as kernel:
        svg = svg_root(kernel.submit(asyncio.run, in_a_cell()).result().read_bytes())
    assert squeezed(BY_NAME["loss"].title) in squeezed(svg.find(f"{SVG}title").text)


def test_save_figure_without_playwright_names_what_to_install(explorer, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)  # its import fails, as where it is not installed
    with pytest.raises(ModuleNotFoundError, match="pip install playwright.*chromium"):
        explorer.save_figure(tmp_path / "loss.svg", section="loss")
    assert not list(tmp_path.iterdir())


def test_save_figure_names_what_was_wrong(explorer, tmp_path):
    with pytest.raises(ValueError, match=r"\.svg or \.png"):
        explorer.save_figure(tmp_path / "figure.pdf", section="eigen")
    with pytest.raises(ValueError, match="this explorer shows loss, .*attention"):
        explorer.save_figure(tmp_path / "figure.svg", section="attentoin")
    with pytest.raises(ValueError, match="width is the page's width in CSS pixels"):
        explorer.save_figure(tmp_path / "figure.svg", section="eigen", width=50)
    with pytest.raises(TypeError, match="EigenvaluePlot has no sections"):
        explorer.eigen.save_figure(tmp_path / "figure.svg", section="eigen")
    assert not list(tmp_path.iterdir()), "a refused figure wrote a file"


def test_an_explorer_section_downloads_its_figure_on_the_saved_page(browser, explorer, tmp_path):
    page_file = explorer.save_html(tmp_path / "explorer.html", offline=False)  # the answers to other clicks: not needed
    with saved_page_open(browser, page_file) as page:
        # a menu per section, none for the explorer as a whole
        assert page.locator(".pcw-explorer > .pcw-figure-menu").count() == 0
        assert page.locator(".pcw-explorer section .pcw-figure-menu").count() == len(explorer.views())
        section = page.locator(".pcw-explorer section[data-view=composition]")
        svg = svg_root(download(page, section, "svg"))
        text = squeezed("".join(svg.itertext()))
        assert squeezed(BY_NAME["composition"].title) in squeezed(svg.find(f"{SVG}title").text)
        assert squeezed("head L1.H6") in text
        # the section's view alone: not the explorer's header around it
        assert "Circuitexplorer" not in text
