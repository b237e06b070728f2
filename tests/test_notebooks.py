"""The notebooks in notebooks/ run, offline, in a real kernel (nbclient), so they cannot rot;
01_quickstart saved with widget state stays small and exports to an offline page where the
explorer and all its views show in Chromium with networking off.

The notebooks are committed without outputs (diffs stay readable, outputs never go stale);
the shareable, state-saved quickstart is produced from them (here, and by the README's
``jupyter nbconvert`` command)."""

import pathlib
import re
import subprocess
import sys
import time

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
NAMES = [p.name for p in NOTEBOOKS]
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
MAX_SAVED_BYTES = 5 * 2**20


def execute(path: pathlib.Path, workdir: pathlib.Path, monkeypatch, **options) -> nbformat.NotebookNode:
    """Run a copy of the notebook in ``workdir`` with the python3 kernel of this venv."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the kernel imports this checkout
    nb = nbformat.read(str(path), as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(workdir)}},
                            **options)
    start = time.perf_counter()
    client.execute()
    print(f"{path.name}: executed in {time.perf_counter() - start:.1f} s")
    return nb


def test_notebooks_are_the_expected_set_and_committed_without_outputs():
    assert NAMES == ["01_quickstart.ipynb", "02_zero_and_one_layer.ipynb", "03_two_layer_induction.ipynb",
                     "04_bring_your_own_model.ipynb", "05_task_circuits.ipynb"]
    for path in NOTEBOOKS:
        nb = nbformat.read(str(path), as_version=4)
        nbformat.validate(nb)
        assert nb.metadata["kernelspec"]["name"] == "python3"
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(not c.outputs and c.execution_count is None for c in code), path.name
        assert WIDGET_STATE not in nb.metadata.get("widgets", {}), path.name


def test_python3_kernel_is_this_venvs_python():
    km = KernelManager(kernel_name="python3")
    assert km.format_kernel_cmd()[0] == sys.executable


@pytest.mark.parametrize("name", [n for n in NAMES if n != "01_quickstart.ipynb"])
def test_notebook_runs_offline_without_errors(name, tmp_path, monkeypatch):
    nb = execute(REPO / "notebooks" / name, tmp_path, monkeypatch)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs), name


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """01_quickstart executed and saved with widget state, as a user shares it."""
    workdir = tmp_path_factory.mktemp("quickstart")
    with pytest.MonkeyPatch.context() as mp:
        nb = execute(REPO / "notebooks" / "01_quickstart.ipynb", workdir, mp, store_widget_state=True)
    path = workdir / "01_quickstart.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_quickstart_saved_with_widget_state_is_small_and_holds_the_explorer(quickstart):
    assert quickstart.stat().st_size < MAX_SAVED_BYTES
    nb = nbformat.read(str(quickstart), as_version=4)
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    explorers = [m for m in state.values() if m["state"].get("_view") == "CircuitExplorer"]
    assert len(explorers) == 1
    explorer = explorers[0]["state"]
    for name in ("loss", "attention", "trigrams", "composition", "eigen"):
        assert explorer[name].removeprefix("IPY_MODEL_") in state, name
    # the selection set from Python in the notebook is what was saved
    assert state[explorer["trigrams"].removeprefix("IPY_MODEL_")]["state"]["head"] == explorer["head"]
    assert (quickstart.parent / "quickstart_explorer.html").stat().st_size > 0


@pytest.mark.browser
def test_exported_quickstart_shows_every_view_offline(quickstart, browser):
    out = quickstart.with_suffix(".html")
    subprocess.run([sys.executable, "-m", "pycircuits_widgets", "export", str(quickstart), "-o", str(out)],
                   check=True, cwd=REPO, capture_output=True)
    context = browser.new_context(offline=True, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors, requests = [], []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: r.url.startswith(("file:", "blob:", "data:")) or requests.append(r.url))
    page.goto(out.as_uri())
    page.wait_for_selector("body[data-pcw-ready]", timeout=20000)
    explorer = page.locator(".pcw-explorer")
    explorer.wait_for()
    for selector in (".pcw-colored-tokens .token", "[data-testid=trigram-table] tr.trigram",
                     "canvas[data-testid=detail]", "[data-testid^=heatmap-]", "[data-testid=scatter] g.head"):
        assert explorer.locator(selector).first.is_visible(), selector
    layer, head = re.fullmatch(r"L(\d+)\.H(\d+)", explorer.locator("[data-testid=selected-head]").inner_text()).groups()
    caption = explorer.locator("[data-testid=trigram-table] caption").inner_text()
    assert caption.startswith(f"Top 100 skip-trigrams of head L{layer}.H{head}"), caption
    assert not errors and not requests
    context.close()
