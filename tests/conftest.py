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
    """A real local Ray cluster (GCS, raylet and 2 single-CPU worker processes), started once per session;
    this checkout's package is shipped to its workers (``runtime_env`` ``py_modules``), as a user with a
    development checkout would. The raylet gives its dashboard agent a fixed 15 s to report its ports
    (ray-project/ray#65983), which a busy 2-core machine can miss: the start is tried three times."""
    import pathlib

    import ray

    package = str(pathlib.Path(__file__).resolve().parent.parent / "pycircuits_widgets")
    for attempt in range(3):
        try:
            ray.init(num_cpus=2, include_dashboard=False, logging_level="warning",
                     runtime_env={"py_modules": [package]})
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    yield ray
    ray.shutdown()
