"""Dataset examples in headless Chromium, from the real bundle, on a real sweep of the shipped 2-layer
model over 32 windows of 64 tokens of the Python stdlib corpus: a head clicked in the explorer shows
its examples (the rows the sweep kept, checked against ``Sweep.head_examples``); an example clicked
puts its window in the explorer's text and the views recompute on it; a saved page, opened with no
kernel and the network cut, shows another head's examples on a click, and so does the page exported from
a notebook holding the explorer. ``PCW_EXAMPLES_SCREENSHOT``: a
path to write a picture of the section to."""

import json
import os

import nbformat
import pytest

import pycircuits_widgets as pcw
from harness import explorer_section, saved_page_open, show_explorer
from pycircuits_widgets.corpus import Corpus
from pycircuits_widgets.models import load_pretrained
from pycircuits_widgets.widgets.core import offline
from pycircuits_widgets.widgets.core.save_plan import WEIGHTS
from pycircuits_widgets.widgets.sharing.notebook_export import WIDGET_STATE, export_notebook
from pycircuits_widgets.widgets.sharing.standalone import page_plan, widget_state

pytestmark = pytest.mark.browser

T, N, K = 64, 32, 6


@pytest.fixture(scope="module")
def model():
    return load_pretrained("attn-only-2l")


@pytest.fixture(scope="module")
def swept(model, tmp_path_factory):
    return pcw.sweep(model, Corpus.python_stdlib(), tmp_path_factory.mktemp("sweep") / "store", seq_len=T, k=K,
                     max_windows=N, progress=False)



def shown_windows(section):
    rows = section.locator("tr.example")
    return [(int(rows.nth(i).get_attribute("data-window")), int(rows.nth(i).get_attribute("data-position")))
            for i in range(rows.count())]


def kernel_windows(swept, layer, head, k=K, by="norm"):
    table = swept.head_examples(layer, head, by=by).iloc[:k]
    return list(zip(table["window"].tolist(), table["position"].tolist()))


def test_rank_by_a_role_shows_the_heads_examples_of_that_role(show, model, swept):
    view_ = pcw.DatasetExamples(swept, model, layer=1, head=6)
    try:
        view_.wait()
        view = show(view_)
        examples = view.page.locator(".pcw-examples")
        assert shown_windows(examples) == kernel_windows(swept, 1, 6)
        view.page.get_by_test_id("rank-by").select_option("induction")
        view.wait_until(lambda: view_.rank_by == "induction" and view_.wait(0.01) and not view_.busy,
                        what="the kernel ranking by induction")
        examples.locator("[data-testid=examples-caption]", has_text="earlier copies").wait_for()
        view.wait_until(lambda: shown_windows(examples) == kernel_windows(swept, 1, 6, by="induction"),
                        what="the head's examples by induction")
        assert examples.locator("thead th").nth(1).inner_text() == "induction"
    finally:
        view_.close()


def test_a_head_click_shows_its_examples_and_an_example_click_reads_it(show, model, swept):
    explorer = pcw.CircuitExplorer(model, "def f(x):\n    return x", sweep=swept)
    try:
        explorer.wait()
        view = show_explorer(show, explorer)
        examples = view.page.locator(".pcw-explorer section[data-view=examples]")
        assert shown_windows(examples) == kernel_windows(swept, 0, 0)
        view.page.locator(".pcw-explorer section[data-view=attention] button.thumb[data-layer='1'][data-head='5']").click()
        view.wait_until(lambda: (explorer.layer, explorer.head) == (1, 5) and explorer.wait(0.01) and not explorer.busy,
                        what="the kernel at head L1.H5")
        examples.locator("[data-testid=examples-caption]", has_text="L1.H5").wait_for()
        view.wait_until(lambda: shown_windows(examples) == kernel_windows(swept, 1, 5), what="the head's examples")
        # the attention shaded on the destination's row: the re-run's values reach the page
        examples.locator("[data-testid=legend]").wait_for()
        if path := os.environ.get("PCW_EXAMPLES_SCREENSHOT"):
            examples.screenshot(path=path)
        # click the third example: its window becomes the explorer's text, its destination the position
        window, position = kernel_windows(swept, 1, 5)[2]
        loss_before = explorer.mean_loss
        examples.locator("[data-testid=open-example]").nth(2).click()
        view.wait_until(lambda: explorer.token_ids[-1] == swept.windows[window, -1].item() and explorer.wait(0.01)
                        and not explorer.busy, what="the explorer reading the example")
        start = T - len(explorer.token_ids)
        assert explorer.token_ids == swept.windows[window, start:].tolist()
        assert explorer.position == position - start and explorer.mean_loss != loss_before
        # every text view recomputed on it, in the page too
        loss = view.page.locator(".pcw-explorer section[data-view=loss] .pcw-colored-tokens .token")
        view.wait_until(lambda: loss.count() == len(explorer.token_ids) - 1, what="the loss view on the new text")
        assert explorer.attention.text == explorer.text
        assert view.page.locator("[data-testid=selected-head]").inner_text() == "L1.H5"
    finally:
        explorer.close()


def test_a_saved_page_shows_another_heads_examples_without_a_kernel(browser, model, swept, tmp_path):
    explorer = pcw.CircuitExplorer(model, "def f(x):\n    return x", sweep=swept)
    try:
        path = explorer.save_html(tmp_path / "examples.html")
    finally:
        explorer.close()
    with saved_page_open(browser, path) as page:
        examples = explorer_section(page, "examples")
        assert shown_windows(examples) == kernel_windows(swept, 0, 0)
        # the attention of the saved rows is there: the legend and shaded tokens
        examples.locator("[data-testid=legend]").wait_for()
        explorer_section(page, "attention").locator("button.thumb[data-layer='1'][data-head='2']").click()
        examples.locator("[data-testid=examples-caption]", has_text="L1.H2").wait_for()
        assert shown_windows(examples) == kernel_windows(swept, 1, 2)
        explorer_section(page, "attention").locator("button.thumb[data-layer='0'][data-head='0']").click()
        examples.get_by_test_id("rank-by").select_option("previous_token")  # the saved head in every ranking
        examples.locator("[data-testid=examples-caption]", has_text="the token before it").wait_for()
        assert shown_windows(examples) == kernel_windows(swept, 0, 0, by="previous_token")
        button = examples.locator("[data-testid=open-example]").first
        assert button.is_disabled() and "needs a running kernel" in button.get_attribute("title")


def test_an_exported_notebook_keeps_the_examples(browser, model, swept, tmp_path):
    explorer = pcw.CircuitExplorer(model, "def f(x):\n    return x", sweep=swept, layer=1, head=4)
    try:
        explorer.save_html(tmp_path / "first.html")  # every view's kernel-less answers made current, as a kernel does
        nb = nbformat.v4.new_notebook()
        data, _ = explorer._repr_mimebundle_()
        nb.cells.append(nbformat.v4.new_code_cell("e", outputs=[nbformat.v4.new_output("display_data", data=data)]))
        nb.metadata["widgets"] = {WIDGET_STATE: {"version_major": 2, "version_minor": 0,
                                                 "state": widget_state([explorer])}}
        src = tmp_path / "examples.ipynb"
        nbformat.write(nb, str(src))
    finally:
        explorer.close()
    assert 'data-pcw-figure="dataset-examples"' in data["text/html"]  # the no-JavaScript picture has them
    with saved_page_open(browser, export_notebook(src)) as page:
        examples = explorer_section(page, "examples")
        assert shown_windows(examples) == kernel_windows(swept, 1, 4)
        explorer_section(page, "attention").locator("button.thumb[data-layer='0'][data-head='3']").click()
        examples.locator("[data-testid=examples-caption]", has_text="L0.H3").wait_for()
        assert shown_windows(examples) == kernel_windows(swept, 0, 3)


def test_a_saved_page_greys_the_examples_of_a_head_it_has_none_for(browser, model, swept, tmp_path):
    """Never another head's examples under the selected head's label (issue 43): a head the saved page
    holds no answer for (its byte budget spent) greys the last examples shown and names whose they are."""
    explorer = pcw.CircuitExplorer(model, "def f(x):\n    return x", sweep=swept)
    try:
        explorer.compute()  # (what the save does first for a small model: the plan's base then holds it)
        whole = page_plan([explorer], None, 10 ** 9)
        weights = sum(item.bytes_estimate for item in whole.items if item.value_rank == WEIGHTS)
        examples = next(item for item in whole.items if item.section == "examples")
        # a page with room for the weight-only views and a third of the heads' examples
        path = explorer.save_html(tmp_path / "examples.html",
                                  max_bytes=whole.base_bytes + weights + examples.bytes_estimate // 3)
        rules = offline.rules(explorer.examples._offline)
    finally:
        explorer.close()
    rule = next(r for r in rules if r["on"] == ["layer", "head", "rank_by"])
    kept = {tuple(json.loads(f"[{k}]"))[:2] for k in rule["patches"]}
    cfg = model.cfg
    missing = [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads) if (l, h) not in kept]
    assert (0, 0) in kept and missing, kept
    layer, head = missing[-1]
    with saved_page_open(browser, path) as page:
        examples = explorer_section(page, "examples")
        explorer_section(page, "attention").locator(f"button.thumb[data-layer='{layer}'][data-head='{head}']").click()
        note = examples.locator("[data-testid=stale-note]")
        note.wait_for()
        assert f"No examples of the selected head L{layer}.H{head} here" in note.inner_text()
        table = examples.locator("[data-testid=examples]")
        assert table.get_attribute("data-stale") == "head L0.H0"
        assert table.evaluate("n => Number(getComputedStyle(n).opacity) < 1")
