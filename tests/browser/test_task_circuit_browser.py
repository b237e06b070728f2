"""The task section in headless Chromium, from the real bundle: the heatmaps hold the kernel's numbers,
a head's cell and a scatter point select the head, the direction switch recomputes, and a saved page
(no kernel) keeps the results."""

import numpy as np
import pytest

import pycircuits_widgets as pcw
from harness import explorer_section, saved_page_open
from pycircuits_widgets.widgets.views.task_circuit import SITES
from test_task_circuit import induction_task

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def model():
    return pcw.load_pretrained("attn-only-2l")


def cell_values(page, testid: str, shape) -> np.ndarray:
    return np.array([[float(page.get_by_test_id(f"{testid}-{r}-{c}").get_attribute("data-value"))
                      for c in range(shape[1])] for r in range(shape[0])], dtype=np.float32)


def test_the_heatmaps_show_the_kernels_numbers_and_select_heads(show, model):
    task = induction_task(model)
    w = pcw.TaskCircuit(model, task)
    view = show(w)
    page = view.page
    for site in SITES:
        for kind, table in (("exact", w.exact[site]), ("estimate", w.estimate[site])):
            np.testing.assert_array_equal(cell_values(page, f"{kind}-{site}", table.shape), table)
    assert float(page.get_by_test_id("rank-head_out").inner_text()) == pytest.approx(
        w.agreement["head_out"]["rank_correlation"], abs=5e-4)
    page.get_by_test_id("exact-head_out-1-6").click()
    assert (w.layer, w.head) == (1, 6)
    assert page.get_by_test_id("scatter").locator("circle").count() == model.cfg.n_layers * model.cfg.n_heads
    page.locator("circle[data-head='0,4']").dispatch_event("click")  # (points may overlap: no pointer position)
    assert (w.layer, w.head) == (0, 4)
    tokens = page.get_by_test_id("exact-resid_pre-grid").locator("thead th")
    assert tokens.count() == task.n_pos + 1  # the tokens of the first clean prompt label the columns
    page.get_by_test_id("direction-noise").click()
    assert w.direction == "noise"
    w.wait()
    view.wait_until(lambda: float(page.get_by_test_id("exact-head_out-1-6").get_attribute("data-value"))
                    == float(w.exact["head_out"][1, 6]), what="the noising table")


def test_a_saved_explorer_page_keeps_the_task_section(browser, model, tmp_path):
    task = induction_task(model)
    explorer = pcw.CircuitExplorer(model, task.tokens_clean[0], task=task)
    path = explorer.save_html(tmp_path / "task.html")
    with saved_page_open(browser, path) as page:
        section = explorer_section(page, "circuit")
        table = explorer.circuit.exact["head_out"]
        np.testing.assert_array_equal(cell_values(section, "exact-head_out", table.shape), table)
        section.get_by_test_id("exact-head_out-1-5").click()  # no kernel: the selection moves in the page
        assert "L1.H5" in page.get_by_test_id("selected-head").inner_text()
        section.screenshot(path=str(tmp_path / "saved-task.png"))


def test_the_circuit_graph_selects_heads_and_shows_an_edges_composition(show, model):
    w = pcw.TaskCircuit(model, induction_task(model))
    view = show(w)
    page = view.page
    graph = page.get_by_test_id("circuit")
    assert graph.locator("g.node").count() == len(w.circuit["nodes"])
    assert graph.locator("line.edge").count() == len(w.circuit["edges"])
    assert float(page.get_by_test_id("faithfulness").inner_text()) == pytest.approx(
        w.circuit["faithfulness"]["score"], abs=5e-4)
    head = next(n for n in w.circuit["nodes"] if n["layer"] >= 0)
    graph.locator(f"g.node[data-node='{head['name']}']").dispatch_event("click")
    assert (w.layer, w.head) == (head["layer"], head["head"])
    edge = next(e for e in w.circuit["edges"] if "measured" in e)
    graph.locator(f"line[data-edge='{edge['from']}>{edge['to']}:{edge['via']}']").dispatch_event("click")
    detail = page.get_by_test_id("edge-detail").inner_text()
    assert detail.startswith(f"{edge['from']} → {edge['to']} ({edge['via']})") and "measured on the clean prompts" in detail
