"""``close()`` closes what a view opened: its runner (jobs stop, the scheduler drops them), its
child views (an explorer's sections, each with its runner and kernel-less answers job) and its
layout widget; a section closed on its own is dropped by its explorer. Counted over create-and-close
cycles under a stand-in kernel loop (``runner_loop``): the registered widgets come back to where
they started, and the threads computing are the scheduler's few, however many views came and went.
Deterministic: a runner is joined (its own completion signal), never waited for by time."""

import threading
import warnings

import ipywidgets
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.core import scheduler
from random_models import paper_model
from runner_loop import WAIT, Blocker, giving_way, manual_kernel_loop  # noqa: F401 (fixture)

TEXT = "t1 t2 t3 t1 t2 t3 t7 t1"
CYCLES = 15


def registered() -> set:
    """The ids of every open widget of this kernel (ipywidgets' registry)."""
    with warnings.catch_warnings():  # ``Widget.widgets`` is the public, deprecated, view of it
        warnings.simplefilter("ignore", DeprecationWarning)
        return set(ipywidgets.Widget.widgets)


def worker_threads() -> set:
    """The live threads computing views' work: the scheduler's (a progress bar's monitor thread is
    tqdm's, not counted)."""
    return {thread for thread in threading.enumerate() if thread.name.startswith(scheduler.THREAD_PREFIX)}


def runners(explorer) -> list:
    return [explorer._runner] + [view._runner for view in explorer.views().values()]


def test_closing_explorers_leaves_no_widget_runner_or_thread(manual_kernel_loop):
    model = paper_model(n_layers=2, n_heads=3, dtype=torch.float32, seed=5)
    first = pcw.CircuitExplorer(model, TEXT)  # the kernel's one bundle carrier, made by the first view, stays
    opened = runners(first)
    first.close()
    assert all(r.join(WAIT) for r in opened)
    widgets = registered()
    for cycle in range(CYCLES):
        ex = pcw.CircuitExplorer(model, TEXT)
        assert len(registered() - widgets) == 2 * (1 + len(ex.views()))  # each view and its Layout
        opened = runners(ex)
        held = Blocker(ex.trigrams._runner)  # a section mid-request, and the fill parked behind it
        ex.head = (cycle % 2) + 1  # a click: the other sections recompute on their runners
        assert ex.start_background() and giving_way(ex._runner)
        ex.close()
        held.release.set()  # the held chunk ends; nothing after it runs
        assert all(r.join(WAIT) for r in opened)
        assert ex.views() == {} and all(r.submit("late", lambda: iter([{}])) is False for r in opened)
    assert registered() == widgets
    assert len(worker_threads()) <= scheduler.worker_count()  # no thread per view: the scheduler's few


def test_a_section_closed_alone_is_dropped_by_its_explorer(manual_kernel_loop):
    model = paper_model(n_layers=2, n_heads=3, dtype=torch.float32, seed=5)
    ex = pcw.CircuitExplorer(model, TEXT)
    trigrams = ex.trigrams
    trigrams.close()
    assert trigrams._runner.join(WAIT) and trigrams.comm is None
    assert ex.trigrams is None and "trigrams" not in ex.views()
    assert ex.notices["trigrams"] == "The skip-trigrams view was closed."
    ex.head = 2  # the explorer goes on linking its other sections
    assert ex.wait(WAIT) and ex.attention.head == 2
    ex.close()
    assert all(r.join(WAIT) for r in runners(ex))


def test_closing_a_single_view_closes_its_layout_and_runner(manual_kernel_loop):
    pcw.ColoredTokens(tokens=["a"], values=[0.0]).close()  # the kernel's carrier, made by the first view, stays
    before = registered()
    view = pcw.ColoredTokens(tokens=["a", "b"], values=[0.5, -1.0])
    assert registered() - before == {view.model_id, view.layout.model_id}
    view.close()
    assert registered() == before and view._runner.join(WAIT)
    view.close()  # twice: nothing left to close
    assert registered() == before
