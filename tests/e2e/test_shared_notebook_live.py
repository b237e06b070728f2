"""A notebook shared with its widget state, in a real JupyterLab 4: the front-end bundle
is sent and saved once per notebook (one hidden carrier widget), every view's ``_esm``
is a small stub that renders with it (the views below are all stubs: the explorer, its
children, a child shown on its own, and separate views)."""

import json

import pytest
from live_lab import kernel_eval, open_notebook, run_all_cells, write_notebook

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.core.bundle import bundle_code, carrier_esm, stub_esm

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
N_TOKENS_VIEWS = 3
CELLS = [
    "import pycircuits_widgets as pcw\nmodel = pcw.load_pretrained('attn-only-2l')",
    "ex = pcw.CircuitExplorer(model, 'def f(x):\\n    return f(x)\\n')\nassert ex.wait(None)  # the kernel-less answers are computed in the background too\nex",
    "ex.trigrams  # a child view of the explorer, shown on its own too",
    f"for i in range({N_TOKENS_VIEWS}):\n    display(pcw.ColoredTokens([f't{{i}}', ' u'], [float(i), 1.0]))",
]


def views_rendered(page):
    """Wait until every view of the notebook shows its content."""
    out = page.locator(".jp-OutputArea-output")
    out.locator(".pcw-explorer [data-testid=selected-head]").first.wait_for()
    # one table inside the explorer, one shown on its own; the explorer's loss view + three
    page.wait_for_function("() => document.querySelectorAll('.jp-OutputArea-output tr.trigram').length > 0 && "
                           "document.querySelectorAll('.jp-OutputArea-output .pcw-skip-trigrams').length === 2 && "
                           f"document.querySelectorAll('.jp-OutputArea-output .pcw-colored-tokens .token').length === "
                           f"{2 * N_TOKENS_VIEWS} + document.querySelectorAll('.pcw-explorer .pcw-colored-tokens .token').length")
    assert out.locator(".pcw-colored-tokens").count() == N_TOKENS_VIEWS + 1
    # the bundle's CSS, packed in the carrier's _esm: added to the document once, styling the
    # views (a token's rounded corners are widget.css's; a span has none)
    assert page.evaluate("() => document.querySelectorAll('style[data-pcw-styles]').length") == 1
    assert out.locator(".pcw-colored-tokens .token").first.evaluate("(el) => getComputedStyle(el).borderTopLeftRadius") == "2px"


def test_views_render_from_stubs_and_the_saved_notebook_holds_the_bundle_once(lab_page, jupyter_lab):
    path = write_notebook(jupyter_lab.root, "shared.ipynb", CELLS)
    open_notebook(lab_page, jupyter_lab, "shared.ipynb")
    run_all_cells(lab_page)
    views_rendered(lab_page)
    lab_page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    lab_page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty")

    saved = json.loads(path.read_text(encoding="utf-8"))["metadata"]["widgets"][WIDGET_STATE]["state"]
    js, css = bundle_code()
    states = [m["state"] for m in saved.values()]
    assert [s.get("_css") for s in states if s.get("_esm") == carrier_esm()] == [None]  # the bundle once (gzipped, CSS too)
    views = [s for s in states if "_view" in s]
    explorer = next(s for s in views if s["_view"] == "CircuitExplorer")
    children = [saved[v.removeprefix("IPY_MODEL_")]["state"] for v in explorer.values()
                if isinstance(v, str) and v.startswith("IPY_MODEL_")]
    children = [c for c in children if "_view" in c]  # not its layout
    assert len(children) >= 5  # the explorer, its views (the table shown twice), 3 tokens
    assert len(views) == 1 + len(children) + N_TOKENS_VIEWS
    assert all(s["_esm"] == stub_esm() and "_css" not in s for s in views)
    # beside the bundle: the data of the views (the explorer has 10 since the paper views joined it)
    # and their kernel-less answers (widgets/core/offline.py)
    answers = sum(len(b["data"]) for m in saved.values() for b in m.get("buffers", []) if b["path"][0] == "_offline")
    assert path.stat().st_size < len(carrier_esm()) + answers + 250_000 and len(carrier_esm()) < len(js + css) / 2


def click_head(section, layer: int, head: int):
    section.get_by_test_id("layer-picker").select_option(str(layer))
    section.get_by_test_id("head-picker").select_option(str(head))


def test_reopened_saved_notebook_shows_every_view_and_answers_clicks_with_no_kernel_attached(
        browser, jupyter_lab):
    """A saved notebook reopened twice (the failure seen was one run in two): every view and
    explorer child renders from saved state with no console error, although the kernel that
    starts never ran the cells (the saved views have no kernel connection); a click on another
    head shows that head's table from the saved answers, also after the kernel is shut down."""
    name = "reopened.ipynb"
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    write_notebook(jupyter_lab.root, name, CELLS)
    open_notebook(page, jupyter_lab, name)
    run_all_cells(page)
    views_rendered(page)
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty")
    layer, head = kernel_eval(page, "(ex.layer, ex.head)")
    context.close()
    jupyter_lab.shutdown_kernels()
    model = pcw.load_pretrained("attn-only-2l")
    try:
        for attempt in range(2):
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            page = context.new_page()
            errors = []
            page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
            page.on("console", lambda m, errors=errors: m.type == "error" and errors.append(m.text))
            open_notebook(page, jupyter_lab, name)  # a kernel starts; nothing runs in it
            views_rendered(page)
            assert page.locator(".pcw-child-error").count() == 0
            sections = page.locator(".jp-OutputArea-output .pcw-explorer section[data-view]")
            assert sections.count() >= 5 and all(sections.nth(i).inner_text().strip() for i in range(sections.count()))
            table = page.locator(".jp-OutputArea-output .pcw-explorer section[data-view=trigrams]")
            for other in [(0, 3), (1, 2)]:
                assert other != (layer, head)
                click_head(table, *other)
                caption = table.locator("caption")
                caption.filter(has_text=f"head L{other[0]}.H{other[1]},").wait_for()
                first = table.locator("tr.trigram").first.locator(".pcw-tok").all_inner_texts()
                (top,) = pcw.skip_trigrams(model, *other, k=1, approximate=True)
                assert first == [visible(s) for s in (top.source_str, top.destination_str, top.out_str)]
                page.evaluate("async () => { const p = window.jupyterapp.shell.currentWidget; "
                              "await p.sessionContext.shutdown(); }")  # the second head with no kernel at all
            assert table.get_by_test_id("error").count() == 0
            context.close()
            jupyter_lab.shutdown_kernels()
            assert not errors, f"run {attempt + 1}: {errors}"
    finally:
        jupyter_lab.shutdown_kernels()


def visible(s: str) -> str:
    """A token as the views print it (spaces as "·", newlines as "↵")."""
    return s.replace(" ", "·").replace("\n", "↵")
