"""AttentionPatterns rendered from the real bundle in headless Chromium."""

import numpy as np
import pytest

import pycircuits_widgets as pcw
from attention_data import causal_softmax, toks

pytestmark = pytest.mark.browser

XSS = '<img src=x onerror="window.__pwned = 1">'
BLUE_LUT_END = (8, 48, 107)  # colour of weight 1 (js/src/lib/color.js BLUES)


def detail_geometry(page):
    el = page.get_by_test_id("detail")
    return {k: int(el.get_attribute(f"data-{k}")) for k in ("res", "cell", "margin")}


def hover_cell(page, dest, src):
    g = detail_geometry(page)
    inside = (g["cell"] - 1) / 2 + 0.25  # near the cell centre; safe from rounding when cell = 1 px
    x = g["margin"] + src * g["cell"] + inside
    y = g["margin"] + dest * g["cell"] + inside
    page.get_by_test_id("detail-overlay").hover(position={"x": x, "y": y})
    return x, y


def pixel(page, x, y):
    return tuple(page.evaluate(
        "([x, y]) => Array.from(document.querySelector('[data-testid=detail]').getContext('2d')"
        ".getImageData(x, y, 1, 1).data.slice(0, 3))", [x, y]))


def painted(view, timeout=15000):
    view.page.wait_for_selector(".pcw-attention[data-painted]", timeout=timeout)


def test_grid_has_one_labelled_thumbnail_per_head_and_detail_draws_mask_not_zeros(show):
    A = np.zeros((2, 3, 6, 6), np.float32)
    A[..., 0] = 1.0  # every destination attends to the first token only
    view = show(pcw.AttentionPatterns(tokens=toks(6), patterns=A))
    painted(view)
    labels = view.page.locator(".thumb .label").all_inner_texts()
    assert labels == ["L0.H0", "L0.H1", "L0.H2", "L1.H0", "L1.H1", "L1.H2"]
    g = detail_geometry(view.page)
    at = lambda d, s: pixel(view.page, g["margin"] + (s + 0.5) * g["cell"], g["margin"] + (d + 0.5) * g["cell"])
    assert at(4, 0) == BLUE_LUT_END  # weight 1
    zero, masked = at(4, 2), at(2, 4)  # a zero weight and a masked (src > dest) cell
    assert zero != masked and min(zero) > 240 and max(masked) < 230


THUMB_PIXEL = """([layer, head, x, y]) => {
  const img = document.querySelector(`.thumb[data-layer="${layer}"][data-head="${head}"] img`);
  const c = document.createElement("canvas");
  c.width = img.naturalWidth; c.height = img.naturalHeight;
  const g = c.getContext("2d");
  g.drawImage(img, 0, 0);
  return Array.from(g.getImageData(x, y, 1, 1).data.slice(0, 3));
}"""


def test_each_thumbnail_shows_its_own_heads_pattern(show):
    n, L, H = 6, 2, 3
    A = np.zeros((L, H, n, n), np.float32)
    for l in range(L):
        for h in range(H):
            for d in range(n):
                A[l, h, d, min(d, l * H + h)] = 1.0  # head (l, h) attends to token l*H+h once it can
    view = show(pcw.AttentionPatterns(tokens=toks(n), patterns=A))
    painted(view)
    px = 80 / n  # a thumbnail is 80 px for n cells
    at = lambda l, h, d, s: tuple(view.page.evaluate(THUMB_PIXEL, [l, h, int((s + 0.5) * px), int((d + 0.5) * px)]))
    for l in range(L):
        for h in range(H):
            j = l * H + h
            assert at(l, h, n - 1, j) == BLUE_LUT_END, (l, h)  # the last row's weight-1 cell
            other = (j + 1) % n
            assert min(at(l, h, n - 1, other)) > 240, (l, h)  # weight 0 there: white


def test_hover_reads_out_dest_src_and_the_exact_weight_from_the_kernel(show):
    A = causal_softmax(2, 2, 9, seed=1)
    w = pcw.AttentionPatterns(tokens=toks(9), patterns=A, layer=1, head=1)
    view = show(w)
    painted(view)
    hover_cell(view.page, 7, 3)
    out = view.page.get_by_test_id("readout")
    view.wait_until(lambda: out.get_attribute("data-exact") == "1", what="exact value from the kernel")
    assert (out.get_attribute("data-dest"), out.get_attribute("data-src")) == ("7", "3")
    assert float(out.get_attribute("data-weight")) == float(A[1, 1, 7, 3])
    text = out.inner_text()
    assert text.startswith("head L1.H1: 7 ·t7 ← 3 ·t3: ") and "(exact)" in text
    assert abs(float(text.split(": ")[-1].split(" ")[0]) - A[1, 1, 7, 3]) < 1e-5
    hover_cell(view.page, 2, 5)
    assert "masked" in out.inner_text()


def test_clicks_set_layer_head_and_cell_in_python(show):
    w = pcw.AttentionPatterns(tokens=toks(8), patterns=causal_softmax(2, 3, 8))
    view = show(w)
    painted(view)
    view.page.locator('.thumb[data-layer="1"][data-head="2"]').click()
    assert (w.layer, w.head) == (1, 2)
    assert view.page.locator(".thumb.selected .label").inner_text() == "L1.H2"
    x, y = hover_cell(view.page, 6, 4)
    view.page.get_by_test_id("detail-overlay").click(position={"x": x, "y": y})
    assert (w.dest_position, w.src_position) == (6, 4)
    view.page.keyboard.press("ArrowLeft")
    assert (w.dest_position, w.src_position) == (6, 3)


def test_python_side_changes_update_the_view(show):
    w = pcw.AttentionPatterns(tokens=toks(5), patterns=causal_softmax(2, 2, 5))
    view = show(w)
    painted(view)
    w.layer, w.head = 1, 0
    assert view.page.locator(".thumb.selected .label").inner_text() == "L1.H0"
    w.position = 3
    assert view.page.locator(".token.pinned").inner_text() == "·t3"
    w.set_patterns(["a", "b", "c"], causal_softmax(1, 4, 3, seed=5))
    assert view.page.locator(".token").all_inner_texts() == ["a", "b", "c"]
    assert view.page.locator(".thumb").count() == 4
    assert view.page.locator(".thumb.selected .label").inner_text() == "L0.H0"


def test_token_view_shades_by_the_positions_row_or_column(show):
    A = causal_softmax(1, 2, 7, seed=2)
    w = pcw.AttentionPatterns(tokens=toks(7), patterns=A, head=1)
    view = show(w)
    painted(view)
    tokens = view.page.locator(".token")
    tokens.nth(5).click()
    assert w.position == 5
    view.page.mouse.move(0, 0)  # hover off: the pinned token is the focus

    def weights():
        return [float(v) if v else None for v in tokens.evaluate_all("els => els.map(e => e.dataset.weight)")]

    row = np.rint(A[0, 1, 5] * 255) / 255  # as destination: what token 5 pays to each source
    assert weights()[:6] == pytest.approx(row[:6].tolist()) and weights()[6] is None  # 6 is masked
    view.page.get_by_label("attention received").check()
    assert w.token_mode == "source"
    col = np.rint(A[0, 1, :, 5] * 255) / 255  # as source: what each destination pays to token 5
    assert weights()[:5] == [None] * 5 and weights()[5:] == pytest.approx(col[5:].tolist())
    dark, light = np.argmax(col[5:]) + 5, np.argmin(col[5:]) + 5
    styles = tokens.evaluate_all("els => els.map(e => e.style.backgroundColor)")
    if dark != 5 and light != 5 and col[dark] > col[light]:
        lum = lambda s: sum(int(c) for c in s[4:-1].split(","))
        assert lum(styles[dark]) < lum(styles[light])


def test_long_context_twelve_heads_1024_tokens_renders_and_fetches_the_selected_head(show):
    n = 1024
    A = causal_softmax(1, 12, n, seed=3)
    w = pcw.AttentionPatterns(tokens=toks(n), patterns=A)
    assert w.full == {}  # 6.3 MB (the causal halves) is over the 4 MiB budget: detail comes per head
    view = show(w)
    painted(view, timeout=30000)
    assert view.page.get_by_test_id("detail").get_attribute("data-res") == str(n)
    view.page.locator('.thumb[data-layer="0"][data-head="7"]').click()
    assert w.head == 7 and w._detail["head"] == 7
    view.wait_until(lambda: view.page.get_by_test_id("detail").get_attribute("data-res") == str(n),
                    what="full resolution of head L0.H7")
    hover_cell(view.page, 900, 100)
    out = view.page.get_by_test_id("readout")
    view.wait_until(lambda: out.get_attribute("data-exact") == "1", what="exact value")
    assert (out.get_attribute("data-dest"), out.get_attribute("data-src")) == ("900", "100")
    assert float(out.get_attribute("data-weight")) == float(A[0, 7, 900, 100])


def test_html_tokens_are_shown_as_text_and_run_nothing(show):
    tokens = ["safe", XSS, "</script><script>window.__pwned=2</script>"]
    view = show(pcw.AttentionPatterns(tokens=tokens, patterns=causal_softmax(1, 1, 3)))
    painted(view)
    assert view.page.locator(".token").all_inner_texts()[1] == XSS.replace(" ", "·")
    hover_cell(view.page, 1, 1)
    assert "<img" in view.page.get_by_test_id("readout").inner_text()
    # the only images are the grid's own thumbnails (drawn PNGs), none from a token
    images = view.page.locator(".pcw-attention img").evaluate_all(
        "els => els.map((e) => [e.dataset.testid, e.src.slice(0, 22)])")
    assert images == [["thumb-image", "data:image/png;base64,"]]
    assert view.page.evaluate("window.__pwned") is None


def test_bad_selection_from_browser_shows_error_and_keeps_state(show):
    w = pcw.AttentionPatterns(tokens=toks(4), patterns=causal_softmax(2, 2, 4), layer=1, head=1)
    view = show(w)
    painted(view)
    view.page.evaluate(
        "(id) => { const m = window.pcwHost.models.get(id); m.set('head', 5); m.save_changes(); }", w.model_id
    )
    view.wait_until(lambda: view.page.get_by_test_id("error").count() == 1, what="error panel")
    assert "head must be in 0..1, got 5" in view.page.get_by_test_id("error").inner_text()
    assert w.head == 1 and view.js_model(w, "head") == 1
    assert view.page.locator(".thumb.selected .label").inner_text() == "L1.H1"


def test_editing_the_text_box_reruns_the_model(show):
    from pycircuits_widgets.models import (
        CHECKPOINT_DIR,
        AttnOnlyTransformer,
        Tokenizer,
        attn_only_config,
        from_attn_only,
    )

    tok = Tokenizer.load(CHECKPOINT_DIR / "tokenizer.json")
    cfg = attn_only_config(1, n_heads=2, d_model=16, d_head=8, d_vocab=tok.vocab_size, n_ctx=32)
    model = from_attn_only(AttnOnlyTransformer(cfg, seed=0), tok)
    w = pcw.AttentionPatterns(model, "import os")
    view = show(w)
    painted(view)
    view.page.get_by_test_id("text").fill("x = 1")
    view.page.get_by_test_id("run").click()
    assert w.text == "x = 1"
    expected = [t for t in model.to_str_tokens("x = 1")]
    assert view.page.locator(".token").all_inner_texts() == expected


def test_export_works_offline_with_hover_and_says_what_needs_a_kernel(browser, tmp_path):
    n = 300  # pooled overview (factor 3); full detail over the tiny budget: only the selected head
    A = causal_softmax(1, 3, n, seed=4)
    w = pcw.AttentionPatterns(tokens=toks(n), patterns=A, full_budget=1000, head=2)
    path = w.save_html(tmp_path / "attention.html")
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    attempted = []

    def route(r):
        if r.request.url.startswith("file://"):
            return r.continue_()
        attempted.append(r.request.url)
        return r.abort()

    context.route("**/*", route)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_selector(".pcw-attention[data-painted]", timeout=15000)
    assert page.locator(".thumb").count() == 3
    hover_cell(page, 250, 40)
    out = page.get_by_test_id("readout")
    assert out.get_attribute("data-exact") == "0"  # no kernel: the uint8 value, marked approximate
    assert float(out.get_attribute("data-weight")) == pytest.approx(np.rint(A[0, 2, 250, 40] * 255) / 255)
    assert "≈" in out.inner_text() and "uint8" in out.inner_text()
    page.locator('.thumb[data-head="0"]').click()  # not saved at full resolution
    note = page.get_by_test_id("detail-note").inner_text()
    assert "max-pooled overview" in note and "kernel" in note and "head L0.H2 only" in note
    assert attempted == [] and errors == []
    context.close()
