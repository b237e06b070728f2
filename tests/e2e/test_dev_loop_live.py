"""The development loop (README, "Developing a view") in a real JupyterLab 4 and kernel,
driven in headless Chromium: with anywidget's hot reload on (``ANYWIDGET_HMR=1``) a view
is shown, the bundle's files are rewritten on disk as ``npm run dev`` (``vite build
--watch``) rewrites them, and the page shows the new code and the new CSS in the same view,
re-mounted with its current state and still wired to the same kernel: no kernel restart, no
reinstall.

The kernel imports a copy of the package in a temporary directory, so the checkout's own
bundle is never touched (other tests may be reading it)."""

import shutil

import pytest
from live_lab import REPO, kernel_eval, kernel_exec, open_notebook, run_all_cells, wait_for_kernel, write_notebook

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

# a class the view's root element gets only from the rewritten bundle, and a rule only in its CSS
CLASS = '"pcw-colored-tokens"'
REBUILT = '"pcw-colored-tokens pcw-rebuilt"'
RULE = "\n.pcw-rebuilt { outline: 3px solid rgb(1, 2, 3); }\n"


def _package_copy(dest):
    shutil.copytree(REPO / "pycircuits_widgets", dest / "pycircuits_widgets",
                    ignore=shutil.ignore_patterns("__pycache__", "checkpoints"))
    return dest / "pycircuits_widgets" / "static"


def test_a_rebuilt_bundle_remounts_the_shown_view_without_a_kernel_restart(lab_page, jupyter_lab, tmp_path):
    static = _package_copy(tmp_path)
    write_notebook(jupyter_lab.root, "dev_loop.ipynb", [
        ("import os, sys\n"
        "os.environ['ANYWIDGET_HMR'] = '1'  # as `ANYWIDGET_HMR=1 jupyter lab` sets it\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import pycircuits_widgets as pcw\n"
        "from pycircuits_widgets.widgets.core import bundle"),
        ("w = pcw.ColoredTokens(['alpha', ' beta', ' gamma', ' delta'], [0.1, 0.7, 0.3, 0.9], label='loss')\n"
        "w"),
    ])  # fmt: skip
    open_notebook(lab_page, jupyter_lab, "dev_loop.ipynb")
    run_all_cells(lab_page)
    assert kernel_eval(lab_page, f"[pcw.__file__.startswith({str(tmp_path)!r}), bundle.dev_mode(), w._esm == bundle.stub_esm(bundle.DEV_KEY)]") == [True, True, True]  # fmt: skip
    lab_page.locator(".jp-OutputArea-output .pcw-colored-tokens .token").first.wait_for()
    kernel_exec(lab_page, "w.position = 2")  # state the re-mounted view must show
    selected = "document.querySelector('.pcw-colored-tokens.pcw-rebuilt .token.selected')?.textContent === '·gamma'"
    assert not lab_page.evaluate(f"() => {selected}")

    js = static / "widget.js"
    code = js.read_text(encoding="utf-8")
    assert code.count(CLASS) == 1, "the view's class name is no longer one literal in the bundle"
    # in place, as vite writes (npm run dev keeps the files: --emptyOutDir=false)
    js.write_text(code.replace(CLASS, REBUILT), encoding="utf-8")
    with open(static / "widget.css", "a", encoding="utf-8") as css:
        css.write(RULE)

    lab_page.wait_for_function(f"() => {selected}")  # the new code, the view's current state
    view = lab_page.locator(".jp-OutputArea-output .pcw-colored-tokens.pcw-rebuilt")
    lab_page.wait_for_function("(el) => getComputedStyle(el).outlineColor === 'rgb(1, 2, 3)'", arg=view.element_handle())
    assert lab_page.locator(".pcw-colored-tokens").count() == 1  # re-mounted in place, not added
    view.locator(".token").nth(3).click()  # the re-mounted view still talks to the same kernel
    wait_for_kernel(lab_page, "w.position", 3)
