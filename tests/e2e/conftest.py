"""Fixtures for end-to-end tests against real notebook servers (see live_lab.py and
live_hosts.py).

* ``jupyter_lab`` / ``jupyter_notebook``: one JupyterLab 4 / Notebook 7 server for the
  whole session, on 127.0.0.1, each with its own root dir.
* ``jupyter_app``: the quick-start tests run once in each of them.
* ``live_page``: a fresh Chromium page (tests/conftest.py's ``browser``) that fails the
  test on page errors (but for the host's own ``known_page_errors``). ``lab_page``: the same, with the JupyterLab server's kernels shut
  down after the test.
"""

import pytest
from live_lab import JupyterLab, JupyterNotebook


@pytest.fixture(scope="session")
def jupyter_lab(tmp_path_factory):
    with JupyterLab(tmp_path_factory.mktemp("jupyter")) as lab:
        yield lab


@pytest.fixture(scope="session")
def jupyter_notebook(tmp_path_factory):
    with JupyterNotebook(tmp_path_factory.mktemp("notebook")) as server:
        yield server


@pytest.fixture(params=["jupyter_lab", "jupyter_notebook"], ids=["lab4", "notebook7"])
def jupyter_app(request):
    server = request.getfixturevalue(request.param)
    yield server
    server.shutdown_kernels()


@pytest.fixture
def live_page(browser, request):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    known = getattr(request.node.funcargs.get("jupyter_app"), "known_page_errors", ())
    errors = [e for e in errors if e not in known]
    assert not errors, f"page errors: {errors}"


@pytest.fixture
def lab_page(live_page, jupyter_lab):
    yield live_page
    jupyter_lab.shutdown_kernels()
