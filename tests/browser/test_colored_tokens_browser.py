"""ColoredTokens rendered from the real bundle in headless Chromium."""

import itertools
import re

import numpy as np
import pytest

import pycircuits_widgets as pcw

pytestmark = pytest.mark.browser

XSS = '<img src=x onerror="window.__pwned = 1">'


def rgb(style):
    return tuple(int(v) for v in re.findall(r"\d+", style)[:3])


def lightness(c):
    return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]


def test_renders_one_element_per_token_with_visible_whitespace(show):
    tokens = ["def", " f", "(x", "):\n", "\t", "return", " x"]
    w = pcw.ColoredTokens(tokens, np.linspace(0, 1, len(tokens)))
    view = show(w)
    spans = view.page.locator(".token")
    assert spans.count() == len(tokens)
    assert spans.all_inner_texts() == ["def", "·f", "(x", "):↵", "→", "return", "·x"]


def test_sequential_colours_get_darker_as_value_grows(show):
    values = [0.3, 2.5, 0.0, 1.1, 4.0, 1.7]
    w = pcw.ColoredTokens([f"t{i}" for i in range(len(values))], values, label="loss")
    view = show(w)
    styles = view.page.locator(".token").evaluate_all("els => els.map(e => e.style.backgroundColor)")
    light = [lightness(rgb(s)) for s in styles]
    order = np.argsort(values)
    assert all(light[a] > light[b] for a, b in itertools.pairwise(order))


def test_diverging_scale_is_white_at_zero_and_monotone_in_redness(show):
    values = [-2.0, -0.5, 0.0, 0.5, 2.0]
    w = pcw.ColoredTokens([str(v) for v in values], values)
    view = show(w)
    cols = [rgb(s) for s in view.page.locator(".token").evaluate_all("els => els.map(e => e.style.backgroundColor)")]
    redness = [r - b for r, g, b in cols]
    assert redness == sorted(redness) and redness[0] < 0 < redness[-1]
    assert abs(redness[2]) < 5  # neutral at 0


def test_click_sets_position_in_python_and_keyboard_moves_it(show):
    w = pcw.ColoredTokens(["a", "b", "c", "d"], [1, 2, 3, 4])
    view = show(w)
    view.page.locator(".token").nth(2).click()
    assert w.position == 2
    view.page.keyboard.press("ArrowRight")
    assert w.position == 3
    view.page.keyboard.press("Escape")
    assert w.position == -1


def test_hover_reads_out_token_and_exact_value(show):
    w = pcw.ColoredTokens(["x", " y"], [0.125, 3.5], label="loss")
    view = show(w)
    view.page.locator(".token").nth(1).hover()
    assert view.page.get_by_test_id("readout").inner_text() == "·y position 1, loss = 3.5"


def test_python_side_change_updates_view(show):
    w = pcw.ColoredTokens(["a", "b"], [1, 2])
    view = show(w)
    w.set_values(["p", "q", "r"], [3, 2, 1])
    assert view.page.locator(".token").all_inner_texts() == ["p", "q", "r"]
    w.position = 1
    assert view.page.locator(".token.selected").inner_text() == "q"


def test_invalid_selection_from_browser_shows_error_and_keeps_last_good_state(show):
    w = pcw.ColoredTokens(["a", "b", "c"], [1, 2, 3], position=1)
    view = show(w)
    view.page.evaluate(
        "(id) => { const m = window.pcwHost.models.get(id); m.set('position', 99); m.save_changes(); }",
        w.model_id,
    )
    view.wait_until(lambda: view.page.get_by_test_id("error").count() == 1, what="error panel")
    assert "position" in view.page.get_by_test_id("error").inner_text()
    assert w.position == 1
    assert view.js_model(w, "position") == 1
    assert view.page.locator(".token.selected").inner_text() == "b"


def test_html_token_is_shown_literally_and_runs_nothing(show):
    w = pcw.ColoredTokens(["safe", XSS, "</script><script>window.__pwned=2</script>"], [0, 1, 2])
    view = show(w)
    texts = view.page.locator(".token").all_inner_texts()
    assert texts[1] == XSS.replace(" ", "·")
    assert view.page.locator(".pcw-colored-tokens img").count() == 0
    assert view.page.evaluate("window.__pwned") is None


def test_values_travel_as_binary_float32_buffer():
    w = pcw.ColoredTokens(["a", "b", "c"], [0.5, 1.5, -2.0])
    from ipywidgets.widgets.widget import _remove_buffers

    state, paths, buffers = _remove_buffers(w.get_state())
    assert ["values", "view"] in paths
    assert len(bytes(buffers[paths.index(["values", "view"])])) == 3 * 4
    assert state["values"]["dtype"] == "float32"
