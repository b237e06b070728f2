"""marimo (``marimo run``, a real server and kernel, headless Chromium): the circuit explorer
and a single view (the attention view) wrapped in ``mo.ui.anywidget``. Each renders; a
click on a head changes the Python-side value (a dependent cell, re-run by marimo, shows the
wrapped widget's traits and the UI element's value); a Python-side change (a cell, re-run
by a marimo button, sets the traits) redraws the view. For the explorer the click's recompute is
checked against a direct ``pcw.skip_trigrams`` call in this process, after the click and
after the Python-side change."""

import pytest
from live_hosts import Marimo, wait_for_trigram_rows

import pycircuits_widgets as pcw

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

MODEL = "attn-only-2l"
TEXT = "def f(x):\n    return x + 1\n\ndef f(x):\n    return x + 1\n"
CLICKED = (0, 3)  # a head clicked in the page
FROM_PYTHON = (1, 5)  # a head selected by a Python-side change

APP = f'''
import marimo

app = marimo.App()


@app.cell
def _():
    import marimo as mo
    import pycircuits_widgets as pcw

    model = pcw.load_pretrained({MODEL!r})
    return mo, model, pcw


@app.cell
def _(mo, model, pcw):
    explorer_widget = pcw.CircuitExplorer(model, {TEXT!r})
    attention_widget = pcw.AttentionPatterns(model, {TEXT!r})
    explorer = mo.ui.anywidget(explorer_widget)
    attention = mo.ui.anywidget(attention_widget)
    mo.vstack([explorer, attention])
    return attention, attention_widget, explorer, explorer_widget


@app.cell
def _(attention_widget, explorer_widget, mo):
    # a click inside the explorer lands in a child view; the kernel links it to the
    # explorer's traits: watch the traits themselves and re-run the cell below on change
    get_changes, set_changes = mo.state(0)
    for _w in (explorer_widget, attention_widget):
        _w.observe(lambda _change: set_changes(lambda n: n + 1), names=["layer", "head"])
    return (get_changes,)


@app.cell
def _(attention, attention_widget, explorer_widget, get_changes, mo):
    get_changes()
    mo.vstack([
        mo.md(f"python-side explorer L{{explorer_widget.layer}}.H{{explorer_widget.head}}"),
        mo.md(
            f"python-side attention L{{attention_widget.layer}}.H{{attention_widget.head}} "
            f"value L{{attention.value['layer']}}.H{{attention.value['head']}}"
        ),
    ])
    return


@app.cell
def _(mo):
    pick_explorer = mo.ui.button(value=0, on_click=lambda n: n + 1, label="explorer from Python")
    pick_attention = mo.ui.button(value=0, on_click=lambda n: n + 1, label="attention from Python")
    mo.hstack([pick_explorer, pick_attention])
    return pick_attention, pick_explorer


@app.cell
def _(explorer_widget, pick_explorer):
    # a Python-side change, made in a cell (marimo's way: the button re-runs this cell)
    if pick_explorer.value:
        explorer_widget.layer, explorer_widget.head = {FROM_PYTHON!r}
    return


@app.cell
def _(attention_widget, pick_attention):
    if pick_attention.value:
        attention_widget.layer, attention_widget.head = {FROM_PYTHON!r}
    return
'''


def head(layer, head_):
    return f"L{layer}.H{head_}"


def python_side(page, name, want, *, clicked=True):
    """Wait until marimo's dependent cell shows ``want`` as the widget's traits (and, for
    the single view after a click, as the ``mo.ui.anywidget`` value, which the page sets)."""
    value = f" value {want}" if name == "attention" and clicked else ""
    page.get_by_text(f"python-side {name} {want}{value}").wait_for()


def top_trigrams(layer, head_):
    """The oracle: the head's top skip-trigrams, computed here by a direct call."""
    model = pcw.load_pretrained(MODEL)
    return [(t.source_str, t.destination_str, t.out_str) for t in pcw.skip_trigrams(model, layer, head_, k=5, approximate=True)]


def thumb(view, layer, head_):
    return view.locator(f"button.thumb[data-layer='{layer}'][data-head='{head_}']")


def test_marimo_anywidget_click_reaches_python_and_python_redraws(live_page, tmp_path):
    page = live_page
    page.set_default_timeout(300_000)  # the first load runs every cell (model, explorer); slow under load
    with Marimo(tmp_path, APP) as marimo_app:
        page.goto(marimo_app.page_url)
        views = {
            "attention": page.locator(".pcw-attention").last,  # the explorer holds one too: the single view is last
            "explorer": page.locator(".pcw-explorer"),
        }
        for name, root in views.items():
            thumb(root, 0, 0).wait_for()
            # styled by the bundle's CSS (packed in the view's _esm), added once to the shadow
            # root marimo renders the view in: a thumbnail button is a flex column only by it
            styled = "(el) => [getComputedStyle(el).display, el.getRootNode().querySelectorAll('style[data-pcw-styles]').length]"
            assert thumb(root, 0, 0).evaluate(styled) == ["flex", 1]
            python_side(page, name, head(0, 0))  # the initial selection, as Python has it

            thumb(root, *CLICKED).click()
            python_side(page, name, head(*CLICKED))
            assert thumb(root, *CLICKED).get_attribute("aria-selected") == "true"
            if name == "explorer":  # the kernel recomputed the clicked head's table
                wait_for_trigram_rows(page, root.locator("section[data-view=trigrams]"), top_trigrams(*CLICKED))

            page.get_by_role("button", name=f"{name} from Python").click()
            page.wait_for_function("(el) => el.getAttribute('aria-selected') === 'true'",
                                   arg=thumb(root, *FROM_PYTHON).element_handle())
            assert thumb(root, *CLICKED).get_attribute("aria-selected") == "false"
            python_side(page, name, head(*FROM_PYTHON), clicked=False)
            if name == "explorer":
                wait_for_trigram_rows(page, root.locator("section[data-view=trigrams]"), top_trigrams(*FROM_PYTHON))
