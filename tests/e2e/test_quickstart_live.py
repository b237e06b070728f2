"""notebooks/01_quickstart.ipynb in a real JupyterLab 4 and in a real Jupyter Notebook 7,
with their kernels, driven in headless Chromium: run all cells, see the head the notebook
selected from Python, click a head in the explorer's attention view, and check that the
kernel's selection changed in every view, that the page sent one widget update for it (the
explorer's: the kernel moves the views), and that the recomputed skip-trigram table shown
in the page is the one a direct ``pcw.skip_trigrams`` call gives."""

import re
import shutil

import pytest
from live_lab import REPO, kernel_eval, kernel_exec, open_notebook, run_all_cells, wait_for_kernel

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

NOTEBOOK = "01_quickstart.ipynb"


def widget_updates(frames) -> int:
    """How many of the websocket frames the page sent are widget state updates (``comm_msg``
    with method ``update``; the page's JSON has no spaces, in text and binary frames alike)."""
    raw = [f.encode() if isinstance(f, str) else f for f in frames]
    return sum(b'"msg_type":"comm_msg"' in f and b'"method":"update"' in f for f in raw)


def test_click_on_a_head_in_the_quickstart_explorer_recomputes_in_the_kernel(live_page, jupyter_app):
    shutil.copy(REPO / "notebooks" / NOTEBOOK, jupyter_app.root / NOTEBOOK)
    sent = []
    live_page.on("websocket", lambda ws: ws.on("framesent", lambda frame: sent.append(frame)))
    open_notebook(live_page, jupyter_app, NOTEBOOK)
    run_all_cells(live_page)
    explorer = live_page.locator(".jp-OutputArea-output .pcw-explorer")
    thumbs = explorer.locator("section[data-view=attention] button.thumb")
    thumbs.first.wait_for()

    layer, head, n_heads = kernel_eval(live_page, "[explorer.layer, explorer.head, model.cfg.n_heads]")
    # the notebook selected the induction head from Python: the page shows it
    label = explorer.locator("[data-testid=selected-head]")
    live_page.wait_for_function("([el, want]) => el.textContent === want", arg=[label.element_handle(), f"L{layer}.H{head}"])
    target = (0, (head + 1) % n_heads) if layer == 0 else (0, 0)  # a head other than the selected one
    before = len(sent)
    thumbs.and_(live_page.locator(f"[data-layer='{target[0]}'][data-head='{target[1]}']")).click()

    wait_for_kernel(live_page, "[explorer.layer, explorer.head]", list(target))
    kernel_exec(live_page, "assert explorer.wait(30)")
    assert widget_updates(sent[before:]) == 1
    views = "[[v.layer, v.head] for v in (explorer.attention, explorer.trigrams, explorer.composition, explorer.eigen)]"
    assert kernel_eval(live_page, views) == [list(target)] * 4
    assert kernel_eval(live_page, "[explorer.trigrams.trigrams['layer'], explorer.trigrams.trigrams['head'], "
                                 "explorer.trigrams.trigrams['exact']]") == [*target, True]

    # the page shows the kernel's recomputed table, and it is the direct analysis result
    caption = explorer.locator("section[data-view=trigrams] caption")
    live_page.wait_for_function(
        "([el, want]) => el.textContent.includes(want) && !el.textContent.includes('partial')",
        arg=[caption.element_handle(), f"skip-trigrams of head L{target[0]}.H{target[1]}"],
    )
    rows = explorer.locator("section[data-view=trigrams] tr.trigram")
    shown = [tuple(rows.nth(i).locator(".pcw-tok").all_inner_texts()) for i in range(5)]
    direct = kernel_eval(live_page, f"[(t.source_str, t.destination_str, t.out_str) for t in "
                                   f"pcw.skip_trigrams(model, {target[0]}, {target[1]}, k=5, approximate=True)]")
    assert shown == [tuple(t) for t in direct]
    label = explorer.locator("[data-testid=selected-head]").inner_text()
    assert re.fullmatch(rf"L{target[0]}\.H{target[1]}", label)
