"""SkipTrigramTable, CompositionMatrix and EigenvaluePlot from the real bundle in headless Chromium."""

import pytest

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import circuit_query, composition_detail
from runner_loop import manual_kernel_loop  # noqa: F401 (fixture)
from test_circuit_widgets import XSS, tiny_model

pytestmark = pytest.mark.browser

STRINGS = [XSS if i == 3 else (f"·w{i}" if i % 5 == 0 else f"t{i}") for i in range(256)]


@pytest.fixture(scope="module")
def m1():
    return tiny_model(1, strings=STRINGS)


@pytest.fixture(scope="module")
def m2():
    return tiny_model(2, seed=1)


def set_from_browser(view, widget, name, value):
    view.page.evaluate(
        "([id, name, v]) => { const m = window.pcwHost.models.get(id); m.set(name, v); m.save_changes(); }",
        [widget.model_id, name, value],
    )


def test_table_renders_sorts_pages_and_picker_recomputes(show, m1):
    w = pcw.SkipTrigramTable(m1, head=1, k=30)
    view = show(w)
    rows = view.page.locator("tr.trigram")
    assert rows.count() == 20
    scores = [float(x) for x in view.page.locator("td[data-col=score]").all_inner_texts()]
    assert scores == sorted(scores, reverse=True)
    view.page.get_by_test_id("sort-qk").click()
    assert w.sort_by == "qk"
    qks = [float(x) for x in view.page.locator("td[data-col=qk]").all_inner_texts()]
    assert qks == sorted(qks, reverse=True)
    view.page.get_by_test_id("next").click()
    assert w.page == 1 and rows.count() == 10
    view.page.get_by_test_id("head-picker").select_option("3")
    assert w.head == 3
    view.wait_until(lambda: view.page.locator("caption").inner_text().startswith("Top 30 skip-trigrams of head L0.H3"),
                    what="table of head L0.H3")
    assert not w.busy and view.js_model(w, "busy") is False


def test_search_round_trip_matches_circuit_query(show, m1):
    w = pcw.SkipTrigramTable(m1, head=2, k=10)
    view = show(w)
    view.page.get_by_test_id("search").fill(" w40")
    view.page.get_by_test_id("search").press("Enter")
    view.wait_until(lambda: view.page.get_by_test_id("related").count() == 1, what="query result")
    assert w.token == 40
    for mode in ("attends_to", "attended_by", "copies_to"):
        shown = view.page.get_by_test_id(f"list-{mode}").locator(".pcw-tok").all_inner_texts()
        assert shown == [s for _, s, _ in circuit_query(m1, 0, 2, 40, mode, k=10)]
    # clicking a token in a list selects it and the kernel answers for it
    view.page.get_by_test_id("list-copies_to").locator(".pcw-tok").first.click()
    first = circuit_query(m1, 0, 2, 40, "copies_to", k=1)[0][0]
    view.wait_until(lambda: w.related.get("token") == first, what="query of the clicked token")


def test_python_side_change_rerenders_and_xss_token_is_text(show, m1):
    w = pcw.SkipTrigramTable(m1, head=0, k=10)
    view = show(w)
    w.token = 3  # the hostile string
    w.wait()
    view.wait_until(lambda: view.page.get_by_test_id("related").count() == 1, what="related panel")
    assert XSS.replace(" ", "·") in view.page.get_by_test_id("related").inner_text()
    w.query = "<img"
    w.wait()
    view.wait_until(lambda: view.page.get_by_test_id("matches").count() == 1, what="matches")
    assert view.page.get_by_test_id("matches").inner_text().startswith("<img")
    assert view.page.locator(".pcw-skip-trigrams img").count() == 0
    assert view.page.evaluate("window.__pwned") is None


def test_out_of_range_head_from_browser_shows_error_and_keeps_state(show, m1):
    w = pcw.SkipTrigramTable(m1, head=1, k=10)
    view = show(w)
    set_from_browser(view, w, "head", 9)
    view.wait_until(lambda: view.page.get_by_test_id("error").count() == 1, what="error panel")
    assert "head must be in 0..3" in view.page.get_by_test_id("error").inner_text()
    assert w.head == 1 and view.js_model(w, "head") == 1
    assert view.page.locator("tr.trigram").count() == 10


def test_composition_click_sets_pair_and_detail_panel_shows_kernel_result(show, m2):
    w = pcw.CompositionMatrix(m2)
    view = show(w)
    canvas = view.page.get_by_test_id("heatmap-correct")
    box = canvas.bounding_box()
    cell = box["width"] / 4
    canvas.click(position={"x": 2.5 * cell, "y": 1.5 * cell})  # row h1 = 0.1, column h2 = 1.2
    assert w.selected_pair == [0, 1, 1, 2]
    w.wait()
    view.wait_until(lambda: view.page.get_by_test_id("singular-values").count() == 1, what="detail")
    ref = composition_detail(m2, "K", (0, 1), (1, 2))
    shown = view.page.get_by_test_id("detail-positivity").get_attribute("title")
    assert float(shown) == pytest.approx(ref.positivity, rel=1e-6)
    assert view.page.get_by_test_id("singular-values").locator(".sv").count() == len(ref.singular_values)
    canvas.hover(position={"x": 0.5 * cell, "y": 3.5 * cell})
    assert view.page.get_by_test_id("readout").inner_text().startswith("L0.H3 → L1.H0: K-composition − baseline =")


def test_composition_toggles_work_without_kernel_and_erratum_is_labelled(show, m2):
    w = pcw.CompositionMatrix(m2)
    view = show(w)
    view.page.get_by_test_id("kind-Q").click()
    view.page.get_by_test_id("erratum").check()
    assert (w.kind, w.show_erratum) == ("Q", True)
    assert "cyclic-permutation" in view.page.get_by_test_id("panel-erratum").inner_text()
    view.page.get_by_test_id("heatmap-correct").focus()
    view.page.keyboard.press("ArrowDown")
    view.page.keyboard.press("ArrowRight")
    readout = view.page.get_by_test_id("readout").inner_text()
    assert readout.startswith("L0.H1 → L1.H1: Q-composition − baseline =") and "erratum (cyclic norm) =" in readout
    view.page.keyboard.press("Enter")
    assert w.selected_pair == [0, 1, 1, 1]
    w.kind = "V"  # Python side
    assert view.page.get_by_test_id("kind-V").get_attribute("aria-pressed") == "true"


def test_eigen_click_selects_head_and_shows_its_spectrum(show, m2):
    w = pcw.EigenvaluePlot(m2)
    view = show(w)
    assert view.page.locator("g.head").count() == 8
    view.page.locator('g.head[data-label="L1.H3"] circle').click()
    assert (w.layer, w.head) == (1, 3)
    w.wait()
    view.wait_until(lambda: "head L1.H3" in view.page.get_by_test_id("detail").inner_text()
                    and view.page.get_by_test_id("copies").locator(".pcw-tok").count() == 12, what="spectrum")
    assert view.page.get_by_test_id("spectrum-OV").locator("circle").count() == 8
    view.page.get_by_test_id("color-by").select_option("induction")
    assert w.color_by == "induction"
    assert view.page.get_by_test_id("embedding-corpus").is_disabled()  # no sweep: said on the button
    assert "needs a sweep" in view.page.get_by_test_id("embedding-corpus").get_attribute("title")
    view.page.get_by_test_id("embedding-mlp0").click()  # the heads of layer 1 read through W_E + block 0
    view.wait_until(lambda: w.embedding == "mlp0" and w.wait(0.01) and not w.busy, what="the kernel reading block 0")
    view.page.get_by_test_id("read-through").filter(has_text="W_E + block 0").wait_for()
    want = pcw.eigenvalue_positivity(m2, "OV", embedding="mlp0")
    view.wait_until(lambda: abs(float(view.page.locator('g.head[data-label="L1.H3"]').get_attribute("data-ov"))
                                - float(want[1, 3])) < 1e-6, what="the scatter read through block 0")
    w.layer, w.head = 0, 0  # Python side
    assert view.page.locator("g.head.selected").get_attribute("data-label") == "L0.H0"
    set_from_browser(view, w, "layer", 5)
    view.wait_until(lambda: view.page.get_by_test_id("error").count() == 1, what="error panel")
    assert w.layer == 0


def test_eigen_scatter_waits_for_spectra_computed_in_the_background(show, m2, monkeypatch, manual_kernel_loop):
    """A model over EAGER_HEADS heads under a kernel: the view first says it is computing (no
    points, no "QK not defined" axis), then draws every head when the runner's result arrives."""
    monkeypatch.setattr(pcw.EigenvaluePlot, "EAGER_HEADS", 4)
    w = pcw.EigenvaluePlot(m2, scores={})
    view = show(w)
    assert view.page.get_by_test_id("scatter-pending").count() == 1
    assert view.page.locator("g.head").count() == 0
    assert "QK not defined" not in view.page.get_by_test_id("scatter").text_content()
    assert w.wait(30)
    view.wait_until(lambda: view.page.locator("g.head").count() == 8, what="every head drawn")
    assert view.page.get_by_test_id("scatter-pending").count() == 0


@pytest.mark.parametrize("make", ["table", "composition", "eigen"])
def test_standalone_export_renders_without_kernel(page, tmp_path, m1, m2, make):
    w = {"table": lambda: pcw.SkipTrigramTable(m1, k=10, token=3),
         "composition": lambda: pcw.CompositionMatrix(m2, selected_pair=[0, 0, 1, 0]),
         "eigen": lambda: pcw.EigenvaluePlot(m2, scores={})}[make]()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    path = w.save_html(tmp_path / "view.html")
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-pcw-ready]")
    selector = {"table": "tr.trigram", "composition": "[data-testid=singular-values] .sv", "eigen": "g.head"}[make]
    assert page.locator(selector).count() > 0
    if make == "composition":  # a kernel-less toggle still redraws
        page.get_by_test_id("erratum").check()
        assert page.get_by_test_id("panel-erratum").count() == 1
    assert page.evaluate("window.__pwned") is None and not errors


def test_composition_of_a_rotary_model_states_the_offsets_q_and_k_are_read_at(show):
    from random_models import custom_model
    w = pcw.CompositionMatrix(custom_model(positional="rotary", dtype=__import__("torch").float32), offsets=range(0, 6))
    view = show(w)
    note = view.page.get_by_test_id("offset-note").inner_text()
    assert "at the strongest of query - key offsets 0..5" in note and "offsets=" not in note  # no Python advice
    view.page.get_by_test_id("kind-V").click()
    view.wait_until(lambda: view.page.get_by_test_id("offset-note").count() == 0, what="V has no offset")


def test_a_deeper_head_is_read_through_the_embedding_chosen_in_the_view(show):
    model = pcw.load_pretrained("attn-only-2l")
    w = pcw.SkipTrigramTable(model, layer=1, head=6, k=10)
    view = show(w)
    assert view.page.get_by_test_id("embedding-corpus").is_disabled()  # no sweep: the reason in its title
    assert "needs a sweep" in view.page.get_by_test_id("embedding-corpus").get_attribute("title")
    view.page.get_by_test_id("embedding-mlp0").click()
    assert w.embedding == "mlp0"
    w.wait()
    view.wait_until(lambda: view.page.get_by_test_id("read-through").count() == 1, what="the read-through note")
    assert view.page.get_by_test_id("read-through").inner_text().startswith("Head L1.H6 read through W_E + block 0")
