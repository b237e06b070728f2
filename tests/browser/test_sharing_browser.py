"""Shared pages in headless Chromium with the network cut: hostile saved state runs
nothing, non-finite numbers render, placeholders for other widget libraries.

The notebooks here are built without a kernel: outputs and saved widget state come from
live widgets exactly as a saved notebook holds them (``_repr_mimebundle_`` and
ipywidgets' public ``embed.dependency_state``), then edited as an attacker would."""

import json
import re

import nbformat
import pytest

import pycircuits_widgets as pcw
from harness import open_offline, page_room, token_as_shown
from pycircuits_widgets.analysis.eigen import eigenvalues
from pycircuits_widgets.widgets.core import offline
from pycircuits_widgets.widgets.core.bundle import bundle_code, carrier_esm
from pycircuits_widgets.widgets.core.offline import NEEDS_KERNEL, NONFINITE
from pycircuits_widgets.widgets.core.save_plan import CHOSEN
from pycircuits_widgets.widgets.sharing import standalone
from pycircuits_widgets.widgets.sharing.notebook_export import WIDGET_STATE, WIDGET_VIEW, export_notebook
from pycircuits_widgets.widgets.sharing.standalone import widget_state

pytestmark = pytest.mark.browser

EVIL_JS = "globalThis.__pwned = 'module'; export default { render() { globalThis.__pwned = 'render'; } };"


def notebook_of(widgets) -> nbformat.NotebookNode:
    """A notebook with one cell per widget, saved with widget state."""
    nb = nbformat.v4.new_notebook()
    for w in widgets:
        data, _ = w._repr_mimebundle_()
        nb.cells.append(nbformat.v4.new_code_cell("w", outputs=[nbformat.v4.new_output("display_data", data=data)]))
    nb.metadata["widgets"] = {WIDGET_STATE: {"version_major": 2, "version_minor": 0, "state": widget_state(widgets)}}
    return nb


def page_entries(html: str) -> list[dict]:
    def refuse(name):
        raise AssertionError(f"bare {name} in the page's JSON")

    found = re.search(r'<script type="application/json" id="pcw-state">(.*?)</script>', html, re.DOTALL)
    return json.loads(found.group(1), parse_constant=refuse)["widgets"]


def test_hostile_saved_esm_and_css_never_run_and_other_libraries_show_a_placeholder(page, tmp_path):
    ours = pcw.ColoredTokens(["safe", " view"], [1.0, 2.0])
    nb = notebook_of([ours])
    state = nb.metadata.widgets[WIDGET_STATE]["state"]
    for model in state.values():  # every saved model claims to run the attacker's code
        model["state"]["_esm"] = EVIL_JS
        model["state"]["_css"] = "body { display: none !important; }"
    # another anywidget library's model, shown in its own cell
    state["foreign"] = {"model_name": "AnyModel", "model_module": "anywidget", "model_module_version": "~0.11.*",
                        "state": {"_anywidget_id": "evil.Widget", "_esm": EVIL_JS, "_view_name": "AnyView"}}
    nb.cells.append(nbformat.v4.new_code_cell("evil", outputs=[nbformat.v4.new_output(
        "display_data", data={WIDGET_VIEW: {"model_id": "foreign", "version_major": 2, "version_minor": 1},
                              "text/plain": "EvilWidget()"})]))
    src = tmp_path / "hostile.ipynb"
    nbformat.write(nb, str(src))
    out = export_notebook(src)
    html = out.read_text(encoding="utf-8")
    assert "__pwned" not in html and "display: none !important; }" not in html

    attempted, errors = open_offline(page, out)
    view = page.locator(".pcw-colored-tokens")
    assert view.locator(".token").all_inner_texts() == ["safe", "·view"] and view.is_visible()
    placeholder = page.locator(".pcw-placeholder")
    assert placeholder.count() == 1 and "EvilWidget()" in placeholder.inner_text()
    assert "anywidget.AnyModel widget not shown" in placeholder.inner_text()
    assert page.evaluate("globalThis.__pwned") is None
    assert attempted == [] and errors == []


def test_non_finite_numbers_travel_in_strict_json_and_the_page_renders(page, tmp_path):
    w = pcw.ColoredTokens(["a", " b", " c"], [1.0, 2.0, 3.0], vmin=float("nan"), vmax=float("inf"))
    path = w.save_html(tmp_path / "nan.html")
    (entry,) = page_entries(path.read_text(encoding="utf-8"))  # strict JSON: parses with no bare NaN
    assert entry["state"]["vmin"] == {NONFINITE: "NaN"} and entry["state"]["vmax"] == {NONFINITE: "Infinity"}

    attempted, errors = open_offline(page, path)
    view = page.locator(".pcw-colored-tokens")
    assert view.is_visible() and view.locator(".token").all_inner_texts() == ["a", "·b", "·c"]
    read = page.evaluate("(id) => { const m = window.pcwHost.models.get(id); return [Number.isNaN(m.get('vmin')), "
                         "m.get('vmax') === Infinity]; }", w.model_id)
    assert read == [True, True]
    assert attempted == [] and errors == []


def test_export_of_a_notebook_whose_state_holds_bare_nan_renders(page, tmp_path):
    w = pcw.ColoredTokens(["x", " y"], [0.0, 1.0], vmax=float("-inf"))
    src = tmp_path / "nan.ipynb"
    nbformat.write(notebook_of([w]), str(src))  # Python's json writes a bare -Infinity here
    assert "-Infinity" in src.read_text(encoding="utf-8")
    out = export_notebook(src)
    assert page_entries(out.read_text(encoding="utf-8"))[0]["state"]["vmax"] == {NONFINITE: "-Infinity"}
    attempted, errors = open_offline(page, out)
    assert page.locator(".pcw-colored-tokens .token").count() == 2
    assert attempted == [] and errors == []


# The widget.css rule the test reads back (ColoredTokens' tokens): a span's defaults otherwise.
TOKEN_STYLE = "(el) => { const s = getComputedStyle(el); return [s.borderTopLeftRadius, s.whiteSpace, s.cursor]; }"
STYLED = ["2px", "pre-wrap", "pointer"]


def test_a_saved_page_styles_its_views_from_the_packed_css_once_and_inside_a_shadow_root(page, tmp_path):
    """The bundle's CSS travels gzipped with its javascript: the page holds it in no <style>, its
    boot adds it once however many views it shows, and the carrier's loader (a saved notebook's
    front end) adds it inside the shadow root a host renders views in."""
    widgets = [pcw.ColoredTokens(["a", " b"], [1.0, 2.0]), pcw.ColoredTokens(["c"], [3.0])]
    path = standalone.save_html(widgets, tmp_path / "two.html")
    text = path.read_text(encoding="utf-8")
    assert bundle_code()[1][:200] not in text and "<style>" + bundle_code()[1][:50] not in text
    attempted, errors = open_offline(page, path)
    tokens = page.locator(".pcw-colored-tokens .token")
    assert tokens.count() == 3
    assert page.evaluate("() => [...document.querySelectorAll('style[data-pcw-styles]')].map((s) => "
                         "s.parentNode === document.head && s.textContent)") == [bundle_code()[1]]
    assert [tokens.nth(i).evaluate(TOKEN_STYLE) for i in range(3)] == [STYLED] * 3
    # the styles are the packed CSS's: without it, a span's defaults
    page.evaluate("() => document.querySelector('style[data-pcw-styles]').disabled = true")
    assert tokens.first.evaluate(TOKEN_STYLE) == ["0px", "normal", "auto"]
    page.evaluate("() => document.querySelector('style[data-pcw-styles]').disabled = false")

    # the carrier's loader, rendering both views in one shadow root (as a host that shows
    # widgets inside shadow DOM does): the CSS once in that root, the document's untouched
    shadow = page.evaluate("""async ([esm, ids]) => {
      const url = URL.createObjectURL(new Blob([esm], { type: "text/javascript" }));
      const definition = (await import(url)).default;
      const root = document.body.appendChild(document.createElement("div")).attachShadow({ mode: "open" });
      for (const id of ids) {
        const el = root.appendChild(document.createElement("div"));
        definition.render({ model: window.pcwHost.models.get(id), el });
      }
      const tokens = [...root.querySelectorAll(".pcw-colored-tokens .token")];
      return { styles: [...root.children].filter((c) => c.localName === "style").map((s) => s.textContent),
               tokens: tokens.map(TOKEN_STYLE),
               inDocument: document.querySelectorAll("style[data-pcw-styles]").length };
    }""".replace("TOKEN_STYLE", TOKEN_STYLE), [carrier_esm(), [w.model_id for w in widgets]])
    assert shadow == {"styles": [bundle_code()[1]], "tokens": [STYLED] * 3, "inDocument": 1}
    assert attempted == [] and errors == []


@pytest.fixture(scope="module")
def shipped_explorer_page(tmp_path_factory):
    model = pcw.load_pretrained("attn-only-2l")
    e = pcw.CircuitExplorer(model, "def fibonacci(n):\n    return fibonacci(n - 1) + fibonacci(n - 2)\n")
    assert e.wait()
    return model, e, e.save_html(tmp_path_factory.mktemp("offline") / "explorer.html")


def click_through_three_heads(page, model, e):
    """In an open kernel-less page of explorer ``e``: pick three other heads; each time the
    skip-trigram table and the eigenvalue detail show that head's, checked against the
    analysis functions."""
    table = page.locator(".pcw-explorer section[data-view=trigrams]")
    eigen = page.locator(".pcw-explorer section[data-view=eigen]")
    k = e.trigrams.k  # the saved page's tables are as long as the kernel's
    assert table.locator("caption").inner_text().startswith(f"Top {k} skip-trigrams of head L{e.layer}.H{e.head}")
    for layer, head in [(0, 3), (1, 6), (1, 2)]:
        assert (layer, head) != (e.layer, e.head)
        table.get_by_test_id("layer-picker").select_option(str(layer))
        table.get_by_test_id("head-picker").select_option(str(head))
        caption = table.locator("caption")
        assert caption.inner_text().startswith(f"Top {k} skip-trigrams of head L{layer}.H{head}")
        rows = table.locator("tr.trigram")
        tokens = [rows.nth(i).locator(".pcw-tok") for i in range(5)]
        direct = pcw.skip_trigrams(model, layer, head, k=5, approximate=True)
        exact = [tuple(visible(s) for s in (t.source_str, t.destination_str, t.out_str)) for t in direct]
        assert [tuple(t.all_inner_texts()) for t in tokens] == [tuple(map(token_as_shown, row)) for row in exact]
        titles = [tuple(t.nth(j).get_attribute("title") for j in range(3)) for t in tokens]
        assert all(title.endswith(f": {s}") for row, ts in zip(exact, titles) for s, title in zip(row, ts))

        point = eigen.locator(f"[data-testid=scatter] g.head[data-label='L{layer}.H{head}'], "
                              f"[data-testid=scatter] g.head[data-label='{layer}.{head}']").first
        point.focus()  # points overlap: select with the keyboard, as the view allows
        point.press("Enter")
        detail = eigen.get_by_test_id("detail")
        assert re.search(rf"head (L{layer}\.H{head}|{layer}\.{head}):", detail.inner_text())
        first = detail.locator("[data-testid=spectrum-OV] circle.eig title").first.text_content()
        parsed = re.search(r"λ1 = (-?[\d.e+-]+?) ?[+−] ?([\d.e+-]+)i", first)
        assert parsed, first
        re_, im_ = (float(x) for x in parsed.groups())
        want = eigenvalues(model, "OV")[layer, head][0]
        # saved answers hold float16 (relative error under 2^-11); the kernel's own are float32
        assert re_ == pytest.approx(float(want.real), rel=1e-3, abs=1e-3)
        assert abs(im_) == pytest.approx(abs(float(want.imag)), rel=1e-3, abs=1e-3)
        assert eigen.get_by_test_id("copies").locator(".copy").count() == e.eigen.n_copies
    assert page.locator("[data-testid=error]").all_inner_texts() == []


def test_saved_explorer_page_clicks_through_three_heads_offline(page, shipped_explorer_page):
    model, e, path = shipped_explorer_page
    assert path.stat().st_size < 1_000_000
    attempted, errors = open_offline(page, path)
    click_through_three_heads(page, model, e)
    assert attempted == [] and errors == []


def test_exported_saved_notebook_clicks_through_three_heads_offline(page, tmp_path, shipped_explorer_page):
    model, e, _ = shipped_explorer_page
    src = tmp_path / "saved.ipynb"
    nbformat.write(notebook_of([e]), str(src))  # the widget state a notebook saves, answers included
    attempted, errors = open_offline(page, export_notebook(src))
    click_through_three_heads(page, model, e)
    assert attempted == [] and errors == []


def test_a_page_over_the_answers_budget_says_which_selections_need_a_kernel(page, tmp_path):
    model = pcw.load_pretrained("attn-only-2l")
    table = pcw.SkipTrigramTable(model, layer=1, head=6, k=40)  # each saved table 40 rows
    # room for the saved head's table and a few more (save_plan.CHOSEN: the selected head's)
    path = table.save_html(tmp_path / "small.html", max_bytes=page_room([table], CHOSEN, more=10_000))
    kept = [tuple(json.loads(f"[{k}]")) for k in offline.rules(table._offline)[0]["patches"]]
    assert kept[0] == (1, 6) and len(kept) < 16
    attempted, errors = open_offline(page, path)
    view = page.locator(".pcw-skip-trigrams")
    missing = next((l, h) for l in range(2) for h in range(8) if (l, h) not in kept)
    view.get_by_test_id("layer-picker").select_option(str(missing[0]))
    view.get_by_test_id("head-picker").select_option(str(missing[1]))
    # a limit of the page, not a fault: a neutral note, no error panel
    assert view.get_by_test_id("offline-note").inner_text() == offline.over_budget("This head's skip-trigram table")
    assert view.get_by_test_id("error").count() == 0
    assert view.get_by_test_id("stale-note").is_visible()  # the table shown is captioned with its own head
    assert attempted == [] and errors == []


def test_offline_token_search_and_text_box_say_they_need_a_kernel(page, shipped_explorer_page):
    _, _, path = shipped_explorer_page
    attempted, errors = open_offline(page, path)
    table = page.locator(".pcw-explorer section[data-view=trigrams]")
    assert table.get_by_test_id("search").is_disabled()
    assert table.get_by_test_id("needs-kernel").inner_text() == NEEDS_KERNEL["query"]
    attention = page.locator(".pcw-explorer .pcw-attention")
    assert attention.get_by_test_id("text").is_disabled() and attention.get_by_test_id("run").is_disabled()
    assert attention.get_by_test_id("needs-kernel").inner_text() == NEEDS_KERNEL["text"]
    assert attempted == [] and errors == []
    table.get_by_test_id("layer-picker").select_option("0")  # the head's answer resets the token (-1):
    assert table.get_by_test_id("error").count() == 0  # never read as a token query needing a kernel


def test_offline_limits_are_neutral_notes_and_the_table_keeps_its_size(page, shipped_explorer_page):
    """Clicking a token of the saved page's skip-trigram table (its query reads the whole
    vocabulary) says so in a neutral note, not the error panel; another head's saved table
    has as many rows as the kernel's; its answer clears the note."""
    _, e, path = shipped_explorer_page
    attempted, errors = open_offline(page, path)
    table = page.locator(".pcw-explorer section[data-view=trigrams]")
    caption = table.locator("caption")
    top = f"Top {e.trigrams.k} skip-trigrams of head "
    assert caption.inner_text().startswith(top + f"L{e.layer}.H{e.head}")
    table.locator("tr.trigram .pcw-tok").first.click()
    note = table.get_by_test_id("offline-note")
    assert note.inner_text() == NEEDS_KERNEL["token"]
    assert note.get_attribute("role") == "note" and page.locator("[data-testid=error], [role=alert]").count() == 0
    red = "rgb(211, 47, 47)"  # the error panel's colour (var(--jp-error-color1) on this page)
    assert red not in note.evaluate("n => [getComputedStyle(n).borderLeftColor, getComputedStyle(n).color].join()")
    other = (e.head + 3) % e.model.cfg.n_heads
    table.get_by_test_id("head-picker").select_option(str(other))
    assert caption.inner_text().startswith(top + f"L{e.layer}.H{other}")
    assert table.locator("tr.trigram").count() == min(e.trigrams.k, e.trigrams.page_size)
    assert table.get_by_test_id("offline-note").count() == 0
    assert attempted == [] and errors == []


def visible(s: str) -> str:
    """A token as the views print it (spaces as "·", newlines as "↵")."""
    return s.replace(" ", "·").replace("\n", "↵")


def test_the_demo_s_explorer_page_and_its_export_show_its_picture_without_javascript(browser, tmp_path,
                                                                                    shipped_explorer_page):
    """The demo page is ``CircuitExplorer.save_html`` (pycircuits_widgets.demo): with JavaScript
    off, it and the notebook export show the explorer's Python-drawn picture of its saved head."""
    _, e, path = shipped_explorer_page
    src = tmp_path / "saved.ipynb"
    nbformat.write(notebook_of([e]), str(src))
    context = browser.new_context(java_script_enabled=False)
    page = context.new_page()
    page.route(re.compile(r"^(?!file:|data:|blob:)"), lambda route: route.abort())
    for shown in [path, export_notebook(src)]:
        page.goto(shown.as_uri())
        picture = page.locator(".pcw-fallback").first
        assert picture.is_visible()
        assert f"Circuit explorer: attn-only-2l, head L{e.layer}.H{e.head}" in picture.inner_text()
        for figure in ["tokens", "attention-grid", "skip-trigrams"]:
            assert picture.locator(f"[data-pcw-figure={figure}]").first.is_visible(), figure
    context.close()
