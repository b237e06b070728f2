"""``pycircuits_widgets.progress``: a bar only for a wait past its delay, on the console in a
script, in the cell under a Jupyter kernel, and nothing of it left in a saved notebook."""

import os
import pathlib
import threading

import nbformat
import pytest
from nbclient import NotebookClient

import pycircuits_widgets as pcw
from pycircuits_widgets import progress as progress_module
from pycircuits_widgets.analysis import eigenvalues
from pycircuits_widgets.progress import progress, quiet, steps
from pycircuits_widgets.widgets.core import runner
from random_models import custom_model
from runner_loop import BareView, ManualLoop

REPO = pathlib.Path(__file__).resolve().parents[1]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def test_a_wait_past_the_delay_draws_a_console_bar(capsys):
    with progress("reading", total=3, unit="step", delay=0) as bar:
        bar.note("first step")
        bar.update(3)  # (within a redraw's interval: drawn with the next note)
        bar.note("last step")
    err = capsys.readouterr().err
    assert "reading" in err and "first step" in err and "3/3" in err and "last step" in err


def test_a_wait_under_the_delay_draws_nothing(capsys):
    assert list(steps(range(4), "quick")) == [0, 1, 2, 3]  # default delay: a second
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("switch", [("PCW_PROGRESS", "0"), ("TQDM_DISABLE", "1")])
def test_bars_can_be_turned_off(capsys, monkeypatch, switch):
    monkeypatch.setenv(*switch)
    with progress("reading", total=2, delay=0) as bar:
        bar.update(2)
    assert capsys.readouterr().err == ""


def test_a_quiet_thread_draws_no_bar_and_the_waiting_thread_draws_its_updates(capsys):
    """A view's worker runs under ``quiet()``: a bar it makes or updates is not drawn from it (it would
    land in the latest cell); the thread that waits draws the count at its next update."""
    def worker(bar):
        with quiet():
            with progress("worker's own", total=1, delay=0) as own:
                own.update()
            bar.update(2)

    with progress("waited on", total=3, unit="step", delay=0) as bar:
        thread = threading.Thread(target=worker, args=(bar,))
        thread.start()
        thread.join()
        assert capsys.readouterr().err == ""
        bar.update()
    err = capsys.readouterr().err
    assert "waited on" in err and "3/3" in err and "worker's own" not in err


def test_a_views_worker_draws_no_bar(capsys):
    """``Runner`` runs its jobs under ``quiet()``: a bar made in a job draws nothing, while the same bar
    on this (the kernel's) thread is drawn."""
    def job():
        with progress("in a view's job", total=1, delay=0) as bar:
            bar.update()
        yield {}

    run = runner.Runner(BareView(), loop=ManualLoop())
    run.submit("probe", job)
    assert run.wait(30)
    assert capsys.readouterr().err == ""
    for _ in job():
        pass
    assert "in a view's job" in capsys.readouterr().err


def test_the_slow_analysis_calls_count_their_work_on_a_bar(capsys, monkeypatch):
    """With no delay, each of the analysis calls that can take seconds at real size draws its bar:
    composition scores over a window (both window routes, the Gram route) and each offset alone,
    the QK spectra over a window and the skip-trigram screen."""
    monkeypatch.setattr(progress_module, "DELAY", 0.0)
    model = custom_model(n_layers=3, n_heads=2, d_model=24, d_head=8, d_vocab=600, positional="rotary",
                         rotary_dim=8, n_ctx=64)
    pcw.composition_scores(model, "K", offsets=range(40))
    pcw.composition_scores(model, "K", offsets=range(40), norm="erratum_right")
    pcw.composition_scores(model, "Q", offsets=[0])
    eigenvalues(model, "QK", offset=range(4))
    pcw.skip_trigrams(model, 1, 0, approximate=True, offset=range(3))
    err = capsys.readouterr().err
    for bar in ("composition_scores: K over 40 offsets", "composition_scores: K erratum_right over 40 offsets",
                "composition_scores: Q correct", "composition_scores: Gram tiles", "eigenvalues: QK over 4 offsets",
                "skip-trigram screen"):
        assert bar in err, bar


CELL = """
from pycircuits_widgets.progress import progress
with progress("in the cell", total=3, unit="step", delay=0) as bar:
    for _ in range(3):
        bar.update()
print("done")
"""


def test_a_bar_in_a_cell_leaves_no_widget_in_the_saved_notebook(tmp_path, monkeypatch):
    """In a kernel the bar is drawn in the cell's output; once done that output is blank, and
    no widget of it is in the saved widget state (nbclient keeps even closed widgets' state)."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CELL)])
    NotebookClient(nb, kernel_name="python3", timeout=120, store_widget_state=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    assert [o.text for o in outputs if o.output_type == "stream"] == ["done\n"]
    shown = [o for o in outputs if o.output_type == "display_data"]
    assert len(shown) == 1 and dict(shown[0].data) == {"text/plain": ""}  # shown, then blanked in place
    assert not any(WIDGET_VIEW in o.get("data", {}) for o in outputs)
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    assert state == {}


WORKER_CELLS = ["""
from pycircuits_widgets.progress import progress
from pycircuits_widgets.widgets.core.runner import Runner
from runner_loop import BareView

def job():
    with progress("from the view's worker", total=3, delay=0) as bar:
        for _ in range(3):
            bar.update()
    yield {}

run = Runner(BareView())
assert run._loop is not None  # under the kernel: a worker thread computes
started = run.submit("probe", job)
""", """
assert run.wait(60)
print("done")
"""]


def test_in_a_kernel_a_views_worker_puts_no_bar_in_any_cell(tmp_path, monkeypatch):
    """Under a real kernel a Runner's worker draws its bar nowhere (ipykernel would send it to the
    latest cell); the cell that waits has only its own output."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests")]))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in WORKER_CELLS])
    NotebookClient(nb, kernel_name="python3", timeout=120,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert nb.cells[0].outputs == []
    assert [(o.output_type, o.get("text")) for o in nb.cells[1].outputs] == [("stream", "done\n")]
