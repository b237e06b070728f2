"""Labels, model names and page titles (text from the user or a checkpoint) in headless Chromium,
network cut: shown with the same escapes as token strings (a bidi override, a lone surrogate as
``\\u202e``, ``\\ud800``), markup as text that runs nothing, left to right; and the same in the
picture a page shows without JavaScript."""

import re

import pytest
import torch

import pycircuits_widgets as pcw
from harness import open_offline
from random_models import paper_model

pytestmark = pytest.mark.browser

PWN = "<img src=x onerror=window.__pwned=1><script>window.__pwned=1</script>"
HOSTILE = f"\u202eloss {PWN} lo\ud800ne"
SHOWN = f"\\u202eloss {PWN} lo\\ud800ne"


def left_to_right(locator) -> bool:
    """Each character of the element's text laid out left of the next (nothing mirrored)."""
    return locator.evaluate("""(el) => {
        const text = el.firstChild, range = document.createRange(), xs = [];
        for (let i = 0; i < text.length; i++) {
            range.setStart(text, i); range.setEnd(text, i + 1);
            xs.push(range.getBoundingClientRect().x);
        }
        return xs.every((x, i) => i === 0 || x >= xs[i - 1]);
    }""")


def test_a_hostile_label_and_title_show_inert_and_visible(page, no_js_page, tmp_path):
    w = pcw.ColoredTokens(["x", "y", "z"], [1.0, 2.0, 3.0], label=HOSTILE)
    path = w.save_html(tmp_path / "label.html", title=HOSTILE)
    attempted, errors = open_offline(page, path)
    label = page.locator(".pcw-colored-tokens [data-testid=legend-label]")
    assert label.inner_text() == SHOWN and left_to_right(label)
    assert page.locator(".pcw-colored-tokens .tokens").get_attribute("aria-label") == f"tokens coloured by {SHOWN}"
    assert page.title() == SHOWN
    assert page.evaluate("window.__pwned") is None and attempted == [] and errors == []

    no_js_page.route(re.compile(r"^(?!file:|data:|blob:)"), lambda route: route.abort())
    no_js_page.goto(path.as_uri())  # the picture the page shows where JavaScript does not run
    caption = no_js_page.locator("[data-pcw-figure=tokens]").evaluate("(d) => d.previousElementSibling.textContent")
    assert caption == f"{SHOWN} per token" and no_js_page.title() == SHOWN


def test_a_checkpoint_s_hostile_model_name_shows_inert_and_visible_in_the_explorer_header(page, tmp_path):
    model = paper_model(n_layers=1, n_heads=2, dtype=torch.float32)
    # as a config.json or a folder name could give it (no "/": the header shows a path's last part)
    model.cfg.name = "\u202egpt <img src=x onerror=window.__pwned=1><script>window.__pwned=1 \ud800"
    path = pcw.CircuitExplorer(model, "t1 t2 t3 t1").save_html(tmp_path / "explorer.html", offline=False)
    attempted, errors = open_offline(page, path)
    name = page.locator(".pcw-explorer [data-testid=model-name]")
    assert name.inner_text() == "\\u202egpt <img src=x onerror=window.__pwned=1><script>window.__pwned=1 \\ud800"
    assert left_to_right(name)
    assert page.locator(".pcw-explorer section h3").count() > 0
    assert page.evaluate("window.__pwned") is None and attempted == [] and errors == []


@pytest.fixture
def no_js_page(browser):
    context = browser.new_context(java_script_enabled=False, viewport={"width": 1200, "height": 900})
    page = context.new_page()
    page.set_default_timeout(10000)
    yield page
    context.close()
