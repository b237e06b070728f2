"""The selection model and the runner: the issue's repros as regression tests, one job per
kind of result, results applied on the kernel thread, stale work stopped between chunks,
clean exit, a narrow browser surface with rollback. Kernel mode uses ``runner_loop``'s
stand-in IO loop (results are applied when the test thread calls ``wait()``); every wait is
on an event, never a sleep."""

import contextlib
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
import traitlets
from comm.base_comm import BaseComm

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.core import runner
from pycircuits_widgets.widgets.core.runner import Runner
from pycircuits_widgets.widgets.core.selection import head_label
from random_models import paper_model
from runner_loop import manual_kernel_loop  # noqa: F401 (fixture)

TEXT = "t1 t2 t3 t1 t2 t3 t7 t1"


@pytest.fixture(scope="module")
def m2():
    return paper_model(n_layers=2, n_heads=3, dtype=torch.float32)


@pytest.fixture(scope="module")
def shipped1():
    return pcw.load_pretrained("attn-only-1l")


@pytest.fixture(scope="module")
def shipped2():
    return pcw.load_pretrained("attn-only-2l")


def test_a_head_is_written_one_way():
    assert head_label(1, 6) == "L1.H6"


# -- the repros ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["script", "kernel"])
def test_token_query_never_drops_the_heads_table(shipped1, mode, request):
    if mode == "kernel":
        request.getfixturevalue("manual_kernel_loop")
    st = pcw.SkipTrigramTable(shipped1)
    st.head = 3
    st.token = 5
    assert st.wait()
    assert st.head == 3 and (st.trigrams["layer"], st.trigrams["head"]) == (0, 3)
    assert (st.related["token"], st.related["head"]) == (5, 3)
    assert not st.busy and st.error == ""


@pytest.mark.parametrize("mode", ["script", "kernel"])
def test_explorer_head_then_position_shows_that_heads_table(shipped2, mode, request):
    if mode == "kernel":
        request.getfixturevalue("manual_kernel_loop")
    ex = pcw.CircuitExplorer(shipped2, "def f(x):\n    return x + 1\n")
    ex.layer, ex.head = 1, 6
    ex.position = 3
    assert ex.wait()
    assert (ex.trigrams.trigrams["layer"], ex.trigrams.trigrams["head"]) == (1, 6)
    assert (ex.eigen.detail["layer"], ex.eigen.detail["head"]) == (1, 6)
    assert ex.trigrams.related["token"] == ex.token == ex.token_ids[3]
    assert not ex.busy and not any(v.busy for v in ex.views().values())


EXIT_SCRIPT = """
import time
import pycircuits_widgets as pcw
{setup}
ex = pcw.CircuitExplorer(pcw.load_pretrained("attn-only-2l"), "def f(x):\\n    return x\\n")
ex.layer, ex.head = 1, 6; time.sleep(0.03)
"""
KERNEL_SETUP = """
from pycircuits_widgets.widgets.core import runner
class Loop:  # a kernel's IO loop that is never run: work stays on the worker threads at exit
    def add_callback(self, *args): pass
runner._kernel_loop = lambda: Loop()
"""


@pytest.mark.parametrize("setup", ["", KERNEL_SETUP], ids=["script", "workers-running"])
def test_script_ending_during_a_recompute_exits_cleanly(setup):
    code = EXIT_SCRIPT.format(setup=textwrap.dedent(setup))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "terminate called" not in run.stderr


# -- the runner -----------------------------------------------------------------------------
class Gate:
    """A job that blocks inside its first chunk until released, recording its progress."""

    def __init__(self):
        self.started, self.release, self.closed = threading.Event(), threading.Event(), threading.Event()
        self.chunks = []

    def steps(self, value):
        def make():
            try:
                self.started.set()
                assert self.release.wait(30)
                self.chunks.append(1)
                yield {"page": value}
                self.chunks.append(2)
                yield {"page": value + 1}
            finally:
                self.closed.set()
        return make


def test_newer_request_of_a_kind_stops_the_running_one_between_chunks(m2, manual_kernel_loop):
    w = pcw.SkipTrigramTable(m2, k=5)
    gate = Gate()
    w._runner.submit("table", gate.steps(10))
    assert gate.started.wait(30)
    w._runner.submit("table", lambda: iter([{"page": 3}]))
    assert w.busy
    gate.release.set()
    assert w.wait(30)
    assert w.page == 3 and gate.closed.is_set()
    assert gate.chunks == [1]  # stale after its first chunk: never computed the second
    assert not w.busy


class SentState(BaseComm):
    """A widget's comm that records the state keys of each update ipywidgets sends the page."""

    kernel = "a kernel"  # ipywidgets sends only on a comm with a kernel

    def __init__(self):
        self.updates = []
        super().__init__(target_name="jupyter.widget")

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        if msg_type == "comm_msg" and data["method"] == "update":
            self.updates.append(set(data["state"]))


def test_a_result_and_busy_going_off_reach_the_page_as_one_message(m2, manual_kernel_loop):
    w = pcw.SkipTrigramTable(m2, k=5)
    assert w.wait(30)
    w.comm = comm = SentState()
    posted = manual_kernel_loop.posted
    w._runner.submit("table", lambda: iter([{"page": 3}, {"sort_by": "qk"}]))
    assert comm.updates == [{"busy"}]
    assert manual_kernel_loop.wait_posted(posted + 3)  # both results, then the job's end
    assert w.wait(30)
    assert comm.updates == [{"busy"}, {"page"}, {"sort_by", "busy"}]  # the last result and busy off: one render


class WatchedLock:
    """``runner.APPLY`` that tells when a second thread has had to wait for it."""

    def __init__(self):
        self._lock = threading.RLock()
        self.waited = threading.Event()

    def __enter__(self):
        if not self._lock.acquire(blocking=False):
            self.waited.set()
            self._lock.acquire()

    def __exit__(self, *exc):
        self._lock.release()


def browser_message(w, name, value):
    """``w`` applies a browser update of one trait, as ipywidgets' comm hands it over."""
    w._handle_msg({"content": {"data": {"method": "update", "state": {name: value}, "buffer_paths": []}},
                   "buffers": []})


def applied_result(w, name, value):
    w._runner.submit("table", lambda: iter([{name: value}]))
    assert w.wait(30)


def in_a_block(hold):
    """A cell's ``with w.hold_sync():`` (or ``hold_trait_notifications``) block setting one trait;
    ``w._pause`` (the test's) runs first inside the block."""
    def change(w, name, value):
        with getattr(w, hold)():
            w._pause()
            setattr(w, name, value)
    return change


# (what changes first, on one thread; what changes meanwhile, on another)
CHANGERS = {"a result": applied_result, "a browser message": browser_message, "a cell": setattr,
            "a cell's hold_sync block": in_a_block("hold_sync"),
            "a cell's hold_trait_notifications block": in_a_block("hold_trait_notifications")}


@pytest.mark.parametrize("first, second", [("a result", "a browser message"), ("a browser message", "a result"),
                                           ("a browser message", "a cell"),
                                           ("a cell's hold_sync block", "a browser message"),
                                           ("a cell's hold_trait_notifications block", "a browser message")])
def test_changes_from_two_threads_never_interleave(m2, manual_kernel_loop, monkeypatch, first, second):
    """JupyterLab sends widget messages to a kernel subshell, which ipykernel serves on a thread of
    its own, while results are applied and cells run on the main thread: one change with its
    observers (or a cell's whole ``hold_sync`` block) is done before another thread's change is
    applied, its value included (``runner.APPLY``), so what either sets reaches the page."""
    monkeypatch.setattr(runner, "APPLY", lock := WatchedLock())
    w = pcw.SkipTrigramTable(m2, k=5)
    assert w.wait(30)
    w.comm = comm = SentState()
    inside, release, order = threading.Event(), threading.Event(), []

    def paused(*_):  # on the first change's thread, until released
        order.append("first paused")
        inside.set()
        assert release.wait(30)

    if first == "a browser message":  # before it sets anything
        set_state = w.set_state
        w.set_state = lambda state: (paused(), set_state(state))
    elif first == "a result":  # applying the result, before it sets anything
        hold_sync = w.hold_sync

        @contextlib.contextmanager
        def held():
            paused()
            with hold_sync():
                yield

        w.hold_sync = held
    else:  # a cell's block, before it sets anything
        w._pause = paused
    before = w.sort_by
    assert before != "qk"
    w.observe(lambda change: order.append("sort_by set"), "sort_by")
    one = threading.Thread(target=CHANGERS[first], args=(w, "page", 3))
    one.start()
    assert inside.wait(30)
    other = threading.Thread(target=CHANGERS[second], args=(w, "sort_by", "qk"))
    other.start()
    assert lock.waited.wait(30)  # the second waits for the first
    assert w.sort_by == before  # nothing of it is stored meanwhile
    order.append("released")
    release.set()
    one.join(30)
    other.join(30)
    assert order == ["first paused", "released", "sort_by set"]
    assert (w.page, w.sort_by, w.error) == (3, "qk", "")
    sent = set().union(*comm.updates)  # what the kernel sent the page; a browser message's own value is only echoed
    assert ("page" in sent, "sort_by" in sent) == (first != "a browser message", second != "a browser message")


def test_kinds_never_drop_each_other(m2, manual_kernel_loop):
    w = pcw.SkipTrigramTable(m2, k=5)
    gate = Gate()
    w._runner.submit("table", gate.steps(1))
    assert gate.started.wait(30)
    w._runner.submit("token", lambda: iter([{"sort_by": "qk"}]))
    gate.release.set()
    assert w.wait(30)
    assert (w.page, w.sort_by) == (2, "qk")  # both results, in order


def test_a_burst_runs_at_most_one_job_and_one_pending(m2, manual_kernel_loop):
    w = pcw.SkipTrigramTable(m2, k=5)
    gate, ran = Gate(), []
    w._runner.submit("table", gate.steps(1))
    assert gate.started.wait(30)

    def request(i):
        def make():
            ran.append(i)
            yield {"page": i}
        return make

    for i in range(10):
        w._runner.submit("table", request(i))
    gate.release.set()
    assert w.wait(30)
    assert ran == [9] and w.page == 9


def test_results_are_applied_on_the_kernel_thread_only(m2, manual_kernel_loop):
    ex = pcw.CircuitExplorer(m2, TEXT)
    assert ex.wait()
    threads = set()
    for view in [ex, *ex.views().values()]:
        view.observe(lambda change: threads.add(threading.get_ident()))
    for layer, head in [(1, 2), (0, 1), (1, 0)]:
        ex.layer, ex.head = layer, head
        ex.position = 2
    assert ex.wait()
    assert threads == {threading.get_ident()}
    assert manual_kernel_loop.posted > 0  # the workers did ask the kernel's loop to apply them
    assert (ex.trigrams.trigrams["layer"], ex.trigrams.trigrams["head"]) == (1, 0)


def test_a_failing_job_shows_its_kind_and_the_next_success_clears_it(m2):
    w = pcw.EigenvaluePlot(m2, scores={})
    before = w.detail

    def broken():
        raise RuntimeError("boom")
        yield {}

    w._runner.submit("detail", broken)
    assert w.error == "detail: RuntimeError: boom" and w.detail is before
    w.head = 2
    assert w.wait() and w.error == "" and w.detail["head"] == 2


def test_save_html_waits_for_finished_state(m2, manual_kernel_loop, tmp_path):
    ex = pcw.CircuitExplorer(m2, TEXT)
    ex.layer, ex.head = 1, 2
    assert ex.trigrams.busy  # nothing applied yet: the loop stand-in never runs callbacks
    ex.save_html(tmp_path / "page.html")
    assert not ex.busy and not any(v.busy for v in ex.views().values())
    assert (ex.trigrams.trigrams["layer"], ex.trigrams.trigrams["head"]) == (1, 2)


def test_runner_without_kernel_runs_synchronously(m2):
    w = pcw.SkipTrigramTable(m2, k=5)
    runner = Runner(w, loop=None)
    runner.submit("x", lambda: iter([{"page": 4}]))
    assert w.page == 4 and not w.busy


# -- validation: ints only, in range, -1 where "none" is allowed -----------------------------
def test_selection_refuses_bools_and_out_of_range_values(m2):
    ex = pcw.CircuitExplorer(m2, TEXT)
    with pytest.raises(traitlets.TraitError, match="head must be an int, got True"):
        ex.head = True
    with pytest.raises(traitlets.TraitError, match=r"position must be -1 \(none\) or in 0..7, got 8"):
        ex.position = 8
    for view, name in [(ex, "layer"), (ex.trigrams, "token"), (ex.attention, "position"), (ex.loss, "position")]:
        view.set_state({name: True})
        assert f"{name} must be an int, got True" in view.error
        assert getattr(view, name) in (0, -1)


# -- narrow browser surface -----------------------------------------------------------------
KERNEL_ONLY = {
    "explorer": ["loss", "_view", "busy", "model_name", "notices", "mean_loss", "token_ids", "n_layers"],
    "trigrams": ["trigrams", "related", "k", "busy", "approximate", "n_heads"],
    "attention": ["overview", "n_layers", "n_heads", "tokens", "full", "_detail"],
    "loss": ["values", "tokens", "first_position"],
    "eigen": ["scores", "detail", "ov_positivity"],
    "composition": ["scores", "detail", "baselines"],
    "paths": ["terms", "ladder", "importance", "contributions", "tokens"],
    "induction": ["pairs", "tables", "strings", "thresholds"],
    "positional": ["positional", "measured", "rule", "n_tokens"],
    "virtual": ["heads"],
    "bigrams": ["vocab", "rows", "top_ids", "top_logits", "complete"],
}


@pytest.mark.parametrize("name", sorted(KERNEL_ONLY))
def test_browser_cannot_write_kernel_traits(m2, name):
    ex = pcw.CircuitExplorer(m2, TEXT)
    widget = ex if name == "explorer" else getattr(ex, name)
    for trait in KERNEL_ONLY[name]:
        before = getattr(widget, trait)
        bogus = None if not isinstance(before, bool) else not before
        widget.set_state({trait: bogus})
        after = getattr(widget, trait)
        assert after is before or (np.array_equal(after, before) if isinstance(before, np.ndarray) else after == before), trait
        assert f"{trait} cannot be set from the browser" in widget.error, trait
    assert ex.loss is not None and set(ex.views()) == {"loss", "causal", "attention", "trigrams", "composition", "eigen",
                                                       "paths", "induction", "positional", "virtual", "bigrams"}


@pytest.mark.parametrize("bad, message", [
    ("", "text must be a non-empty str"),
    ("t1 " * 40, "n_ctx"),
    ("t1 \ud800 t2", "valid Unicode"),
    ("x" * 100_001, "at most 100000 characters"),
])
def test_bad_text_from_the_browser_shows_an_error_and_keeps_every_view(m2, bad, message):
    ex = pcw.CircuitExplorer(m2, TEXT)
    shown = (ex.text, list(ex.loss.tokens), list(ex.attention.tokens))
    ex.set_state({"text": bad})
    assert message in ex.error
    assert (ex.text, list(ex.loss.tokens), list(ex.attention.tokens)) == shown
    ex.attention.set_state({"text": bad})  # typed in the attention view's text box
    assert message in ex.attention.error or (bad == "" and "non-empty" in ex.error)
    assert (ex.text, list(ex.loss.tokens), list(ex.attention.tokens)) == shown


def test_bad_text_from_python_raises_and_keeps_the_old_value(m2):
    ex = pcw.CircuitExplorer(m2, TEXT)
    with pytest.raises(traitlets.TraitError, match="n_ctx"):
        ex.text = "t1 " * 40
    assert ex.text == TEXT and ex.attention.text == TEXT


def test_a_failing_observer_rolls_the_selection_back_everywhere(m2, monkeypatch):
    ex = pcw.CircuitExplorer(m2, TEXT)
    original = ex.eigen._on_head

    def fail_on_head_2(change):
        if ex.eigen.head == 2:
            raise RuntimeError("no head 2 today")
        original(change)

    ex.eigen.unobserve(original, ["layer", "head", "n_copies"])
    ex.eigen.observe(fail_on_head_2, ["layer", "head", "n_copies"])
    ex.set_state({"head": 2})
    assert "no head 2 today" in ex.error
    assert ex.head == 0 and all(v.head == 0 for n, v in ex.views().items() if n not in ("loss", "bigrams"))
    with pytest.raises(RuntimeError, match="no head 2 today"):
        ex.head = 2  # from Python: raises, and the old value stays
    assert ex.head == 0 and ex.eigen.head == 0


# -- one forward pass per text ---------------------------------------------------------------
def test_one_forward_pass_per_text(m2, monkeypatch):
    calls = []
    original = type(m2).run_with_cache

    def counting(self, tokens, *args, **kwargs):  # text or ids: count the positions read
        calls.append(len(self.to_str_tokens(tokens)) if isinstance(tokens, str) else tokens.shape[-1])
        return original(self, tokens, *args, **kwargs)

    monkeypatch.setattr(type(m2), "run_with_cache", counting)
    ex = pcw.CircuitExplorer(m2, TEXT)
    text_calls = [n for n in calls if n == len(TEXT.split())]
    assert len(text_calls) == 1  # loss and attention share it (head scores read their own random tokens)
    calls.clear()
    ex.attention.set_state({"text": "t5 t6 t5 t6"})
    assert calls == [4] and ex.loss.tokens == ["t6", "t5", "t6"] and ex.attention.tokens == ["t5", "t6", "t5", "t6"]
