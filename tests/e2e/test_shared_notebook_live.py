"""A notebook shared with its widget state, in a real JupyterLab 4: the front-end bundle
is sent and saved once per notebook (one hidden carrier widget), every view's ``_esm``
is a small stub that renders with it (the views below are all stubs: the explorer, its
children, a child shown on its own, and separate views)."""

import json

import pytest

from live_lab import open_notebook, run_all_cells, write_notebook

from pycircuits_widgets.widgets.bundle import bundle_code, carrier_esm, stub_esm

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
N_TOKENS_VIEWS = 3
CELLS = [
    "import pycircuits_widgets as pcw\nmodel = pcw.load_pretrained('attn-only-2l')",
    "ex = pcw.CircuitExplorer(model, 'def f(x):\\n    return f(x)\\n')\nassert ex.wait()\nex",
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
    assert [s.get("_css") for s in states if s.get("_esm") == carrier_esm()] == [css]  # the bundle once (gzipped)
    views = [s for s in states if "_view" in s]
    assert len(views) == 1 + 5 + N_TOKENS_VIEWS  # the explorer, its 5 views (the table shown twice), 3 tokens
    assert all(s["_esm"] == stub_esm() and "_css" not in s for s in views)
    assert path.stat().st_size < len(carrier_esm()) + len(css) + 200_000 and len(carrier_esm()) < len(js) / 2
