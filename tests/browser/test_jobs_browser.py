"""A running on-demand section in real Chromium, wired to its real Python view under a stand-in
kernel loop (``runner_loop``): it offers "cancel" while its job runs, the click stops the job in
the kernel before its next piece, the section says "cancelled" and "restart" computes it; a page
saved while a section computes says "not computed". Deterministic: the job is held by a click
running on another view (``Blocker``), never by time."""

import pytest

import pycircuits_widgets as pcw
from harness import saved_page_open
from random_models import paper_model
from runner_loop import WAIT, Blocker, giving_way, manual_kernel_loop  # noqa: F401 (fixture)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def m2():
    return paper_model(n_layers=2, n_heads=3, d_vocab=40, n_ctx=16, seed=2)


def test_cancel_stops_a_running_section_and_restart_computes_it(show, m2, manual_kernel_loop):
    w = pcw.InductionMechanism(m2, active=False)
    other = pcw.SkipTrigramTable(m2)
    assert other.wait(WAIT)
    view = show(w)
    held = Blocker(other._runner)  # a click running: the section's job waits before its first piece
    view.page.get_by_test_id("compute").click()
    assert w.active and giving_way(w._runner)
    view.wait_until(lambda: view.page.get_by_test_id("cancel").count() == 1, what="the cancel button")
    view.page.get_by_test_id("cancel").click()
    assert not w.active and w.progress == {"state": "cancelled"}
    held.release.set()
    assert w.wait(WAIT) and w.pairs == {}  # no piece was computed
    view.wait_until(lambda: view.page.get_by_test_id("cancelled").count() == 1, what="the cancelled line")
    assert "induction mechanism was cancelled" in view.page.get_by_test_id("cancelled").inner_text()
    assert view.page.get_by_test_id("compute").count() == 0
    view.page.get_by_test_id("restart").click()
    assert w.active and w.wait(WAIT) and w.pairs
    view.wait_until(lambda: view.page.get_by_test_id("cancelled").count() == 0
                    and view.page.get_by_test_id("h1-picker").count() == 1, what="the computed section")


def test_a_page_saved_while_a_section_computes_says_not_computed(browser, m2, tmp_path, manual_kernel_loop):
    w = pcw.InductionMechanism(m2, active=False)
    other = pcw.SkipTrigramTable(m2)
    assert other.wait(WAIT)
    held = Blocker(other._runner)
    w.active = True
    assert giving_way(w._runner)
    path = w.save_html(tmp_path / "page.html", budget=0)
    held.release.set()
    assert w.wait(WAIT) and w.pairs  # the save stopped nothing here
    with saved_page_open(browser, path) as page:
        line = page.get_by_test_id("not-computed")
        assert line.count() == 1 and "was still computing" in line.inner_text()
        assert page.get_by_test_id("busy").count() == 0 and page.get_by_test_id("compute").count() == 0
