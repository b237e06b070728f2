"""The explorer's causal checks in headless Chromium, from the real bundle: the ablate toggle on the
selected head (the loss section's diverging loss change, the "ablated" header of the attention and
induction sections, back to the clean run), the composition section switched to the matrix measured
on the text, and a saved page that keeps the measured matrix and each head's ablation loss change."""

import numpy as np
import pytest

import pycircuits_widgets as pcw
from harness import explorer_section, saved_page_open, show_explorer
from pycircuits_widgets.demo import SAMPLE_TEXT

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def model():
    return pcw.load_pretrained("attn-only-2l")



def test_ablate_a_head_see_the_loss_change_and_toggle_back(show, model, tmp_path):
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT, layer=1, head=6)
    explorer.wait()
    view = show_explorer(show, explorer)
    page = view.page
    loss = explorer_section(page, "loss")
    clean_values = [float(v) for v in loss.locator(".token").evaluate_all("(ts) => ts.map((t) => t.dataset.value)")]
    assert page.locator("[data-testid=ablate-mean]").is_disabled()
    assert "needs a sweep" in page.locator("[data-testid=mean-note]").inner_text()

    page.locator("[data-testid=ablate-zero]").click()
    view.wait_until(lambda: explorer.causal.ablated == "ablated: L1.H6 (zero)" and not explorer.busy, what="the ablated run")
    view.wait_until(lambda: page.locator("[data-testid=ablated]").count() == 1, what="the explorer's ablated badge")
    assert page.locator("[data-testid=ablated]").inner_text() == "ablated: L1.H6 (zero)"
    for name in ("attention", "induction"):
        assert explorer_section(page, name).locator("[data-testid=run-label]").inner_text().startswith(
            "ablated: L1.H6 (zero)"), name
    legend = loss.locator("[data-testid=legend]")
    assert "loss change" in legend.inner_text() and "0 (white) at the centre, symmetric" in legend.inner_text()
    ticks = [float(t) for t in legend.locator(".tick").all_inner_texts()]
    assert ticks[0] == -ticks[1] < 0  # symmetric about 0
    shown = np.array([float(v) for v in loss.locator(".token").evaluate_all("(ts) => ts.map((t) => t.dataset.value)")])
    oracle = pcw.ablate(model, SAMPLE_TEXT, heads=[(1, 6)])
    np.testing.assert_array_equal(shown, (oracle.loss - oracle.clean_loss)[0].float().numpy())
    page.screenshot(path=str(tmp_path / "ablated.png"))

    page.locator("[data-testid=ablate-off]").click()
    view.wait_until(lambda: explorer.causal.ablated == "" and page.locator("[data-testid=ablated]").count() == 0,
                    what="the clean run again")
    assert explorer_section(page, "attention").locator("[data-testid=run-label]").count() == 0
    again = [float(v) for v in loss.locator(".token").evaluate_all("(ts) => ts.map((t) => t.dataset.value)")]
    assert again == clean_values
    assert loss.locator("[data-testid=legend-label]").inner_text() == "loss (nats)"


def test_the_composition_matrix_measured_on_the_text(show, model):
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT, layer=1, head=6)
    explorer.wait()
    view = show_explorer(show, explorer)
    page = view.page
    comp = explorer_section(page, "composition")
    comp.locator("[data-testid=source-measured]").click()
    view.wait_until(lambda: "K" in explorer.composition.measured, what="the measured K-composition")
    view.wait_until(lambda: comp.locator("[data-testid=measured-not-computed]").count() == 0, what="the page's table")
    assert comp.locator("[data-testid=panel-measured]").is_visible()
    assert "measured on this text" in comp.locator("[data-testid=measured-note]").inner_text()
    comp.locator("[data-testid=heatmap-measured]").click(position={"x": 5, "y": 5})  # L0.H0 -> L1.H0
    view.wait_until(lambda: explorer.composition.detail.get("h1") == [0, 0] and not explorer.busy, what="the detail")
    view.wait_until(lambda: comp.locator("[data-testid=detail-measured]").count() == 1, what="the pair's two numbers")
    measured = pcw.measured_composition(model, SAMPLE_TEXT, "K")[0, 0, 1, 0].item()
    assert float(comp.locator("[data-testid=detail-measured]").inner_text()) == pytest.approx(measured, rel=1e-3)
    detail = explorer.composition.detail
    assert float(comp.locator("[data-testid=detail-weights]").inner_text()) == pytest.approx(
        detail["score"] - detail["baseline"], rel=1e-3, abs=1e-4)


def test_a_saved_page_keeps_the_measured_matrix_and_the_head_loss_table(browser, model, tmp_path):
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT, layer=1, head=6)
    path = explorer.save_html(tmp_path / "explorer.html")
    with saved_page_open(browser, path) as page:
        table = page.locator("[data-testid=head-loss]")
        assert "zero-ablating each head" in table.inner_text()
        cell = table.locator("[data-testid=head-loss-0-4]")
        assert float(cell.get_attribute("data-value")) == pytest.approx(float(explorer.causal.head_loss_change[0, 4]))
        assert page.locator("[data-testid=ablate-zero]").is_disabled()
        assert page.locator("[data-testid=ablation-needs-kernel]").is_visible()
        comp = explorer_section(page, "composition")
        comp.locator("[data-testid=source-measured]").click()
        assert comp.locator("[data-testid=heatmap-measured]").is_visible()
        assert comp.locator("[data-testid=measured-not-computed]").count() == 0
        comp.locator("[data-testid=kind-V]").click()
        assert comp.locator("[data-testid=measured-not-computed]").count() == 0
        comp.screenshot(path=str(tmp_path / "saved-composition.png"))
