"""The view gallery (scripts/gallery.py): one offline page with every view of the registry, each
mounted in real Chromium without an error."""

import os
import pathlib
import subprocess
import sys

import pytest
from playwright.sync_api import expect

from harness import saved_page_open
from pycircuits_widgets.widgets.views.registry import BY_NAME

pytestmark = pytest.mark.browser

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gallery(tmp_path_factory):
    out = tmp_path_factory.mktemp("gallery") / "gallery.html"
    # this checkout's package (and its bundle), not an installed one: a script's sys.path starts at scripts/
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gallery.py"), str(out)], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=900)
    return out


def test_every_view_is_in_the_gallery_mounted_without_error(browser, gallery):
    with saved_page_open(browser, gallery) as page:
        headings = page.locator("h2[data-view]")
        assert sorted(headings.evaluate_all("hs => hs.map((h) => h.dataset.view)")) == sorted(BY_NAME)
        for name in BY_NAME:
            # the cell after the view's heading holds that view's mounted root
            cell = page.locator(f"h2[data-view={name}] + .pcw-cell")
            expect(cell.locator(".pcw-view").first).to_be_visible()
        assert page.locator("[role=alert]").count() == 0
