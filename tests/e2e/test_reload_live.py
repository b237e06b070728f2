"""A page reloaded against a running kernel stays in sync (issue 43: once, after a reload, head and
token clicks showed in the header but never reached the kernel): in a real JupyterLab 4, the
explorer's notebook is saved, the page reloaded, and a head and a token clicked on the restored
views reach the kernel's explorer; with the kernel gone, the page restored from the saved widget state says
so and answers from the answers saved with it."""

import pytest
from live_lab import open_notebook, run_all_cells, wait_for_kernel, write_notebook
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

CELLS = [
    "import pycircuits_widgets as pcw\nmodel = pcw.load_pretrained('attn-only-2l')",
    "ex = pcw.CircuitExplorer(model, 'def f(x):\\n    return f(x)\\n')\nex",
]
_PANEL_IDLE = """async () => {
  const shell = window.jupyterapp.shell;
  while (!shell.currentWidget?.sessionContext?.session?.kernel) await new Promise((r) => setTimeout(r, 20));
  const kernel = shell.currentWidget.sessionContext.session.kernel;
  while (kernel.status !== "idle") await new Promise((r) => setTimeout(r, 20));
}"""


def thumb(page, layer, head):
    return page.locator(f".pcw-explorer section[data-view=attention] button.thumb[data-layer='{layer}'][data-head='{head}']")


def save(page):
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty")


def test_a_reloaded_page_sends_its_clicks_to_the_running_kernel(lab_page, jupyter_lab):
    page = lab_page
    write_notebook(jupyter_lab.root, "reload.ipynb", CELLS)
    open_notebook(page, jupyter_lab, "reload.ipynb")
    run_all_cells(page)
    thumb(page, 1, 2).click()
    wait_for_kernel(page, "[ex.layer, ex.head]", [1, 2], timeout=30)
    save(page)  # the outputs (the explorer's view) come back with the file

    page.reload()
    page.evaluate(_PANEL_IDLE)
    expect(page.get_by_test_id("selected-head")).to_have_text("L1.H2", timeout=60_000)  # the kernel's state
    thumb(page, 0, 3).click()
    expect(page.get_by_test_id("selected-head")).to_have_text("L0.H3")
    wait_for_kernel(page, "[ex.layer, ex.head]", [0, 3], timeout=30)
    page.locator(".pcw-explorer section[data-view=attention] .token[data-index='4']").first.click()
    wait_for_kernel(page, "ex.position", 4, timeout=30)
    # the kernel's answer reaches the restored views: the table is the new head's, not greyed
    trigrams = page.locator(".pcw-explorer section[data-view=trigrams]")
    expect(trigrams.locator("caption")).to_contain_text("skip-trigrams of head L0.H3", timeout=30_000)
    expect(trigrams.get_by_test_id("stale-note")).to_have_count(0)


def test_a_reloaded_page_whose_kernel_is_gone_says_so(lab_page, jupyter_lab):
    page = lab_page
    write_notebook(jupyter_lab.root, "gone.ipynb", CELLS)
    open_notebook(page, jupyter_lab, "gone.ipynb")
    run_all_cells(page)
    expect(page.get_by_test_id("selected-head")).to_have_text("L0.H0")
    expect(page.get_by_test_id("no-kernel")).to_have_count(0)  # live: nothing to say
    # the kernel-less answers are filled in the background: saved before they are done, L1.H2's table
    # would (rightly) say it needs a kernel
    wait_for_kernel(page, "ex.wait(120)", True, timeout=150)
    save(page)
    jupyter_lab.shutdown_kernels()
    page.reload()
    page.evaluate(_PANEL_IDLE)  # JupyterLab starts a new kernel, which holds no explorer
    # the explorer comes back from the widget state saved with the notebook (no comm: the new kernel holds
    # none of its views); a click says it has no kernel and is answered from the answers saved with it
    expect(page.get_by_test_id("selected-head")).to_have_text("L0.H0", timeout=60_000)
    thumb(page, 1, 2).click()
    expect(page.get_by_test_id("no-kernel")).to_contain_text("No running kernel behind this explorer")
    expect(page.get_by_test_id("selected-head")).to_have_text("L1.H2")
    trigrams = page.locator(".pcw-explorer section[data-view=trigrams]")
    expect(trigrams.locator("caption")).to_contain_text("skip-trigrams of head L1.H2")
