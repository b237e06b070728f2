"""Fixtures for end-to-end tests against a real JupyterLab server (see live_lab.py).

* ``jupyter_lab``: one server for the whole session, on 127.0.0.1, with its own root dir.
* ``lab_page``: a fresh Chromium page (tests/conftest.py's ``browser``) that fails the
  test on page errors; the notebook's kernels are shut down after the test.
"""

import pytest

from live_lab import JupyterLab


@pytest.fixture(scope="session")
def jupyter_lab(tmp_path_factory):
    with JupyterLab(tmp_path_factory.mktemp("jupyter")) as lab:
        yield lab


@pytest.fixture
def lab_page(browser, jupyter_lab):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    jupyter_lab.shutdown_kernels()
    assert not errors, f"page errors: {errors}"
