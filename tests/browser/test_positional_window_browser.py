"""The positional chart follows the head (issue 43): the shipped model's induction head, on a text repeating
with a period of 24 tokens, shows the offsets where its attention is (past the old fixed 16), reports
period - 1 as its peak, draws its attention on its own scale, and widens to every offset on request."""

import pytest

import pycircuits_widgets as pcw

pytestmark = pytest.mark.browser

SEGMENT = " apple river stone cloud table music paper light"  # 24 tokens for the shipped tokenizer
TEXT = SEGMENT * 2


def test_the_induction_head_s_chart_covers_its_offset_and_widens(show):
    model = pcw.load_pretrained("attn-only-2l")
    period = len(model.to_tokens(SEGMENT))
    head = int(pcw.head_scores(model)["induction"][1].argmax())
    w = pcw.PositionalQK(model, TEXT, layer=1, head=head)
    page = show(w).page
    last = int(w.window[1, head])
    assert last > period - 1
    summary = page.get_by_test_id("summary")
    assert page.get_by_test_id("measured-peak").inner_text() == str(period - 1)
    assert f"measured attention at offset {period - 1}" in summary.inner_text()
    assert page.get_by_test_id("measured-edge").count() == 0  # a peak inside the window, not its edge
    assert page.get_by_test_id("window-last").inner_text() == str(last)
    assert page.locator("rect.measured").count() == last + 1
    # the bars on their own scale: the right axis ends at the head's largest mean attention shown
    top = float(w.measured[1, head, : last + 1].max())
    assert float(page.get_by_test_id("attention-max").text_content()) == pytest.approx(top, rel=1e-2)
    page.get_by_test_id("widen").click()
    every = w.measured.shape[2]
    assert page.locator("rect.measured").count() == every
    assert page.get_by_test_id("window-last").inner_text() == str(every - 1)
    page.get_by_test_id("widen").click()
    assert page.locator("rect.measured").count() == last + 1
