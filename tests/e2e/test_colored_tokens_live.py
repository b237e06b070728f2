"""A real JupyterLab server and kernel: a notebook with ColoredTokens is run in headless
Chromium, a click in the view reaches the kernel, and a kernel-side recompute comes back
to the view."""

import pytest
from live_lab import kernel_exec, open_notebook, run_all_cells, wait_for_kernel, write_notebook

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

CELLS = [
    ("import pycircuits_widgets as pcw\n"
    "w = pcw.ColoredTokens(['alpha', ' beta', ' gamma', ' delta'], [0.1, 0.7, 0.3, 0.9], label='loss')\n"
    "w"),
    # a kernel-side recompute: the selection renames the legend
    ("picked = []\n"
    "def recompute(change):\n"
    "    picked.append(change['new'])\n"
    "    w.label = f'picked {change[\"new\"]}'\n"
    "w.observe(recompute, 'position')"),
]


def test_click_in_view_changes_kernel_trait_and_recompute_comes_back(lab_page, jupyter_lab):
    write_notebook(jupyter_lab.root, "colored_tokens.ipynb", CELLS)
    open_notebook(lab_page, jupyter_lab, "colored_tokens.ipynb")
    run_all_cells(lab_page)
    view = lab_page.locator(".jp-OutputArea-output .pcw-colored-tokens")
    view.locator(".token").first.wait_for()
    assert view.locator(".token").all_inner_texts() == ["alpha", "·beta", "·gamma", "·delta"]
    assert lab_page.locator(".pcw-fallback").count() == 0  # JupyterLab ranks the live view first

    view.locator(".token").nth(2).click()
    wait_for_kernel(lab_page, "w.position", 2)
    assert wait_for_kernel(lab_page, "picked", [2]) == [2]
    lab_page.get_by_text("picked 2").first.wait_for()  # the kernel's recompute, shown

    kernel_exec(lab_page, "w.position = 3")
    lab_page.wait_for_function(
        "() => document.querySelector('.pcw-colored-tokens .token.selected')?.textContent === '·delta'"
    )
