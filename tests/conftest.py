import os

import pytest

from harness import CHROMIUM, CHROMIUM_ARGS, WidgetView

# A developer's shell may export anywidget's hot-reload switch (README, "Developing a view"):
# the tests (and the notebook servers they start) check the packed bundle, so it is off here;
# tests/e2e/test_dev_loop_live.py turns it on in its own kernel.
os.environ.pop("ANYWIDGET_HMR", None)


@pytest.fixture(scope="session")
def browser():
    """Debian's headless Chromium, driven by Playwright (no browser download)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    page.set_default_timeout(10000)
    yield page
    context.close()


@pytest.fixture
def show(page, tmp_path):
    """``show(*widgets) -> WidgetView``: render real widgets in the page, wired to Python.
    Fails the test if the page logged an error or opened a dialog."""
    views = []

    def _show(*widgets):
        view = WidgetView(page, list(widgets), tmp_path)
        views.append(view)
        return view

    yield _show
    for view in views:
        assert not view.errors, f"page errors: {view.errors}"


# A skipped test hides a missing install step (a browser, a package): count it as failure.
_skipped = []


def pytest_runtest_logreport(report):
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _skipped and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _skipped:
        terminalreporter.write_line(
            f"FAILED: {len(_skipped)} test(s) were skipped; every test must run: {_skipped[:5]}", red=True
        )


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster (GCS, raylet and 2 single-CPU worker processes), started once per session
    with this checkout's package shipped to its workers, as the sweep's own local start does
    (``ray_engine.start_local_cluster``, which retries a start a busy machine made Ray give up on)."""
    import ray

    from pycircuits_widgets.corpus.ray_engine import start_local_cluster

    start_local_cluster(num_cpus=2)
    yield ray
    ray.shutdown()
