"""Issue 27 in headless Chromium, network cut: a shared page runs no script of the notebook's,
no saved buffer path reaches a prototype, no saved payload inflates past its bound, tokens show
every character, and with JavaScript off every view shows its picture of the saved state."""

import base64
import json
import re
import zlib

import nbformat
import pytest
import torch

import pycircuits_widgets as pcw
from harness import open_offline
from pycircuits_widgets.widgets.core.payload import MAX_INFLATED
from pycircuits_widgets.widgets.sharing.notebook_export import WIDGET_STATE, export_notebook
from pycircuits_widgets.widgets.sharing.standalone import widget_state
from random_models import paper_model

pytestmark = pytest.mark.browser

PAGE_STATE = re.compile(r'(<script type="application/json" id="pcw-state">)(.*?)(</script>)', re.DOTALL)


def notebook_of(widgets, extra_cells=()) -> nbformat.NotebookNode:
    """One cell per widget (its display data as a notebook saves it), then ``extra_cells``,
    saved with widget state."""
    nb = nbformat.v4.new_notebook()
    for w in widgets:
        data, _ = w._repr_mimebundle_()
        nb.cells.append(nbformat.v4.new_code_cell("w", outputs=[nbformat.v4.new_output("display_data", data=data)]))
    nb.cells += list(extra_cells)
    nb.metadata["widgets"] = {WIDGET_STATE: {"version_major": 2, "version_minor": 0, "state": widget_state(widgets)}}
    return nb


def edit_page(path, edit) -> None:
    """Rewrite the saved page's state JSON (``edit(entries)``), as an attacker editing the file would."""
    text = path.read_text(encoding="utf-8")
    found = PAGE_STATE.search(text)
    state = json.loads(found.group(2))
    edit(state["widgets"])
    body = json.dumps(state).replace("<", "\\u003c")
    path.write_text(text[: found.start(2)] + body + text[found.end(2):], encoding="utf-8")


def entry_of(entries, widget):
    return next(e for e in entries if e["model_id"] == widget.model_id)


# -- #1: the export runs no script of the notebook's ---------------------------------------
PWN = "window.__pwned = (window.__pwned || []).concat"


def hostile_outputs():
    html = (f'<b>bold survives</b><script>{PWN}("html-script")</script>'
            f'<img src="x" onerror="{PWN}(\'img-onerror\')"><a href="javascript:{PWN}(\'href\')">link</a>'
            f'<iframe srcdoc="<script>parent.{PWN}(\'iframe\')</script>"></iframe>')
    svg = f'<svg xmlns="http://www.w3.org/2000/svg"><script>{PWN}("svg")</script><rect width="4" height="4"/></svg>'
    return [
        nbformat.v4.new_output("display_data", data={"text/html": html, "text/plain": "html"}),
        nbformat.v4.new_output("display_data", data={"application/javascript": f'{PWN}("javascript")',
                                                     "text/plain": "js"}),
        nbformat.v4.new_output("display_data", data={"text/markdown": f'md <img src=x onerror="{PWN}(\'md-out\')">'}),
        nbformat.v4.new_output("display_data", data={"image/svg+xml": svg}),
        nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo="},
                               metadata={"image/png": {"width": f'1 onerror="{PWN}(\'width\')"'}}),
    ]


def test_an_exported_notebook_runs_no_script_of_its_own(page, tmp_path):
    ours = pcw.ColoredTokens(["safe", " view"], [1.0, 2.0])
    gone = pcw.ColoredTokens(["gone"], [1.0])  # shown, then its state not saved
    data, _ = gone._repr_mimebundle_()
    data["text/html"] = f'<p>old picture</p><script>{PWN}("unsaved-widget")</script><img src=x onerror="{PWN}(\'u\')">'
    nb = notebook_of([ours], [
        nbformat.v4.new_code_cell("evil", outputs=hostile_outputs()),
        nbformat.v4.new_markdown_cell(f'# Title\n\nraw <img src=x onerror="{PWN}(\'markdown\')"> '
                                      f'<script>{PWN}("markdown-script")</script> *kept*'),
        nbformat.v4.new_raw_cell(f'<script>{PWN}("raw")</script>', metadata={"raw_mimetype": "text/html"}),
        nbformat.v4.new_code_cell("gone", outputs=[nbformat.v4.new_output("display_data", data=data)]),
    ])
    src = tmp_path / "hostile.ipynb"
    nbformat.write(nb, str(src))
    with pytest.warns(UserWarning, match="1 widget output"):
        out = export_notebook(src)
    html = out.read_text(encoding="utf-8")
    assert "onerror" not in html and "javascript:" not in html and "<iframe" not in html  # made inert, not only blocked
    assert len(re.findall(r"<script\b", html)) == 3  # the state (JSON), the bundle (text), the boot module

    attempted, errors = open_offline(page, out)
    assert page.evaluate("window.__pwned") is None
    scripts = page.evaluate("[...document.scripts].map((s) => s.type || s.className)")
    assert scripts == ["application/json", "text/plain", "module"]
    handlers = page.evaluate("[...document.querySelectorAll('*')].flatMap((e) => [...e.attributes])"
                             ".filter((a) => a.name.startsWith('on')).length")
    assert handlers == 0
    assert page.locator("b", has_text="bold survives").is_visible() and page.locator("em", has_text="kept").is_visible()
    assert "old picture" in page.locator(".pcw-placeholder").inner_text()
    assert page.locator(".pcw-colored-tokens .token").all_inner_texts() == ["safe", "·view"]
    assert attempted == [] and errors == []


def test_the_page_policy_blocks_a_script_that_got_past_the_sanitiser(page, tmp_path):
    """The Content-Security-Policy is the second wall: a script and an event handler put in
    the page (standing in for any that got past the sanitiser) do not run, and its own views
    still mount."""
    w = pcw.ColoredTokens(["a", " b"], [1.0, 2.0])
    path = w.save_html(tmp_path / "page.html")
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("<body>", f'<body><script>{PWN}("inline")</script>'
                                 f'<img src="x" onerror="{PWN}(\'handler\')">'), encoding="utf-8")
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-pcw-ready]", timeout=15000)
    assert page.evaluate("window.__pwned") is None
    assert page.locator(".pcw-colored-tokens .token").all_inner_texts() == ["a", "·b"]


# -- #2: no saved buffer path reaches a prototype -------------------------------------------
@pytest.mark.parametrize("path", [["__proto__", "polluted"], ["__proto__", "encoding"],
                                  ["constructor", "prototype", "polluted"]])
def test_a_saved_buffer_path_through_a_prototype_breaks_only_its_own_view(page, tmp_path, path):
    bad, good = pcw.ColoredTokens(["bad"], [1.0]), pcw.ColoredTokens(["good", " one"], [1.0, 2.0])
    src = tmp_path / "proto.ipynb"
    nb = notebook_of([bad, good])
    nb.metadata.widgets[WIDGET_STATE]["state"][bad.model_id]["buffers"].append({"path": path, "data": "AAAA"})
    nbformat.write(nb, str(src))
    attempted, errors = open_offline(page, export_notebook(src))
    assert page.evaluate("[({}).polluted, ({}).encoding, Object.prototype.hasOwnProperty('polluted')]") == [None, None,
                                                                                                           False]
    assert page.locator(".pcw-colored-tokens .token").all_inner_texts() == ["good", "·one"]  # the other view works
    shown = page.locator("#pcw-0").inner_text()
    assert f"saved buffer path {json.dumps(path, separators=(',', ':'))} refused" in shown
    assert attempted == [] and len(errors) == 1 and "refused" in errors[0]


# -- #3: no saved payload inflates past its bound -------------------------------------------
LARGEST = """
window.__largest = 0;
const Real = Uint8Array;
window.Uint8Array = new Proxy(Real, { construct(target, args, newTarget) {
  const made = Reflect.construct(target, args, newTarget);
  window.__largest = Math.max(window.__largest, made.byteLength);
  return made;
} });
"""


def bomb(gib: int = 1) -> bytes:
    """Raw deflate of ``gib`` GiB of spaces in about 1 MB (one 1 MiB block, repeated)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = packer.compress(b" " * (1 << 20)) + packer.flush(zlib.Z_FULL_FLUSH)
    return block * (gib << 10) + b"\x03\x00"  # an empty final block


@pytest.fixture(scope="module")
def m1():
    return paper_model(n_layers=1, n_heads=2, dtype=torch.float32)


@pytest.mark.parametrize("declared", ["honest", "small"])
def test_a_page_whose_saved_answers_inflate_to_a_gibibyte_does_not_balloon(page, tmp_path, m1, declared):
    st = pcw.SkipTrigramTable(m1, k=5)
    path = st.save_html(tmp_path / "bomb.html")
    payload = bomb()
    assert zlib.decompressobj(-15).decompress(payload, 1 << 16) == b" " * (1 << 16)

    def plant(entries):
        entry = entry_of(entries, st)
        i = entry["buffer_paths"].index(["_offline", "rules", "view"])
        entry["buffers"][i] = base64.b64encode(payload).decode("ascii")
        entry["state"]["_offline"]["rules"]["shape"] = [1 << 30] if declared == "honest" else [4096]

    edit_page(path, plant)
    assert path.stat().st_size < 2_000_000
    page.add_init_script(LARGEST)
    attempted, errors = open_offline(page, path)
    view = page.locator(".pcw-skip-trigrams")
    assert view.locator("tr.trigram").count() == 5  # the saved table still shows
    error = view.get_by_test_id("error").inner_text()
    assert error.startswith("This page's saved answers for other selections cannot be read (decodeArray: ")
    assert ("over the limit of 67108864 bytes; not inflated" if declared == "honest"
            else "inflates past the 4096 bytes its shape declares") in error
    largest = page.evaluate("window.__largest")
    assert 0 < largest <= 16 << 20 < MAX_INFLATED  # ballooned to 3.6 GB before
    assert attempted == [] and errors == []


def test_a_table_payload_that_inflates_past_its_shape_shows_an_error_instead_of_a_table(page, tmp_path, m1):
    st = pcw.SkipTrigramTable(m1, k=5)
    path = st.save_html(tmp_path / "bomb.html")

    def plant(entries):
        entry = entry_of(entries, st)
        i = entry["buffer_paths"].index(["trigrams", "src", "view"])
        entry["buffers"][i] = base64.b64encode(bomb()).decode("ascii")
        entry["state"]["trigrams"]["src"]["encoding"] = "deflate"

    edit_page(path, plant)
    page.add_init_script(LARGEST)
    attempted, errors = open_offline(page, path)
    assert "inflates past the 20 bytes its shape declares" in page.locator("#pcw-0").inner_text()
    assert page.evaluate("window.__largest") <= 16 << 20
    assert attempted == [] and len(errors) == 1 and "inflates past" in errors[0]


# -- #7: every character visible in the views -------------------------------------------------
def test_bidi_and_invisible_characters_in_saved_tokens_show_as_escapes(page, tmp_path):
    w = pcw.ColoredTokens(["x", "y", "z", " end"], [1.0, 2.0, 3.0, 4.0])
    path = w.save_html(tmp_path / "bidi.html")

    def plant(entries):  # a page written by something else than this package's Python
        entry_of(entries, w)["state"]["tokens"] = ["\u202e", "a\u200bb", "\u2066x", " end"]

    edit_page(path, plant)
    attempted, errors = open_offline(page, path)
    tokens = page.locator(".pcw-colored-tokens .token")
    assert tokens.all_inner_texts() == ["\\u202e", "a\\u200bb", "\\u2066x", "·end"]
    boxes = [tokens.nth(i).bounding_box()["x"] for i in range(4)]
    assert boxes == sorted(boxes)  # left to right: nothing mirrored
    assert attempted == [] and errors == []


# -- #10: the picture where JavaScript does not run -------------------------------------------
@pytest.fixture
def no_js_page(browser):
    context = browser.new_context(java_script_enabled=False, viewport={"width": 1200, "height": 900})
    page = context.new_page()
    page.set_default_timeout(10000)
    yield page
    context.close()


def caption_without_js(page, path) -> list[str]:
    page.route(re.compile(r"^(?!file:|data:|blob:)"), lambda route: route.abort())
    page.goto(path.as_uri())
    return page.locator("[data-pcw-figure=skip-trigrams]").evaluate_all(
        "(tables) => tables.map((t) => t.previousElementSibling.textContent)")


def test_save_html_and_export_show_the_saved_state_s_picture_without_javascript(no_js_page, page, tmp_path, m1):
    st = pcw.SkipTrigramTable(m1, k=5)
    nb = notebook_of([st])  # displayed at head 0: the output's own picture shows L0.H0
    assert "Top skip-trigrams of head L0.H0" in nb.cells[0].outputs[0].data["text/html"]
    st.head = 1  # then a reader picks head 1, and the page is saved
    saved = st.save_html(tmp_path / "page.html")
    assert caption_without_js(no_js_page, saved) == ["Top skip-trigrams of head L0.H1"]
    rows = no_js_page.locator("[data-pcw-figure=skip-trigrams] tr").count()
    assert rows == 6  # header and the table's 5 rows

    nb.metadata.widgets[WIDGET_STATE]["state"] = widget_state([st])  # the notebook saved now
    src = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(src))
    exported = export_notebook(src)
    assert caption_without_js(no_js_page, exported) == ["Top skip-trigrams of head L0.H1"]

    open_offline(page, exported)  # with JavaScript, the live view instead of the picture
    assert page.locator("[data-pcw-figure]").count() == 0 or not page.locator("[data-pcw-figure]").first.is_visible()
    assert page.locator(".pcw-skip-trigrams tr.trigram").count() == 5


def test_a_page_whose_bundle_is_a_gzip_bomb_stops_inflating_it(page, tmp_path):
    w = pcw.ColoredTokens(["a"], [1.0])
    path = w.save_html(tmp_path / "page.html")
    # gzip header, 1 GiB of deflated spaces, then a trailer whose checksum is never reached
    bomb_gz = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + bomb() + bytes(8)
    text = path.read_text(encoding="utf-8")
    packed = re.search(r'(<script type="text/plain" class="pcw-bundle"[^>]*>)(.*?)(</script>)', text, re.DOTALL)
    path.write_text(text[: packed.start(2)] + base64.b64encode(bomb_gz).decode("ascii") + text[packed.end(2):],
                    encoding="utf-8")
    with page.expect_event("pageerror", timeout=30000) as error:
        page.goto(path.as_uri())
    assert str(error.value) == "pycircuits_widgets: the page's bundle inflates past 16 MiB; not loaded"
