"""The explorer's background fill: under a kernel it computes, for every head, what a click
would (the exact skip-trigram table, the eigenvalue detail, the composition detail of the pair
the click selects) into the per-model cache, gives way to every other runner's requests, stops
when cancelled or closed, and a click after it recomputes nothing the cache keeps. In a script
nothing runs. Deterministic: the tests wait on the scheduler's and runner's own signals
(``changed``, ``giving_way``, ``wait``), never on time."""

import copy

import numpy as np
import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import cache
from pycircuits_widgets.analysis.skip_trigrams import kept_head_table
from pycircuits_widgets.widgets.core import runner
from random_models import paper_model
from runner_loop import WAIT, BareView, Blocker, ManualLoop, giving_way, manual_kernel_loop  # noqa: F401 (fixture)

TEXT = "t1 t2 t3 t1 t2 t3 t7 t1"


def fresh_model():
    """A model no other test has cached anything for."""
    return paper_model(n_layers=2, n_heads=3, dtype=torch.float32, seed=5)


def table_keys(model) -> set:
    return {key[1:3] for key in cache.keys(model) if key[0] == "skip_trigram_table"}


def test_the_fill_visits_every_head_and_a_revisit_answers_from_the_cache(manual_kernel_loop):
    model = fresh_model()
    ex = pcw.CircuitExplorer(model, TEXT)
    assert ex.wait(WAIT) and ex.wait_background(WAIT)
    cfg = model.cfg
    assert table_keys(model) == {(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)}
    assert {key[1:3] for key in cache.keys(model) if key[0] == "ov_diagonal"} == table_keys(model)
    assert ex.progress == {}  # the header's "precomputing heads" line is gone
    # every precomputed table is the one a script computes for that head on its own
    twin = copy.deepcopy(model)
    for layer, head in [(0, 2), (1, 1)]:
        view = pcw.SkipTrigramTable(twin, layer=layer, head=head)
        assert view.wait(WAIT)
        table = kept_head_table(model, layer, head, ex.trigrams.k)
        kept = {"src": table.source, "dest": table.destination, "out": table.out, "score": table.score}
        for name in ("src", "dest", "out", "score"):
            assert np.array_equal(np.asarray(kept[name]), view.trigrams[name]), name
    before = cache.stats(model)
    ex.layer, ex.head = 1, 2  # a head the explorer never showed
    assert ex.wait(WAIT)
    after = cache.stats(model)
    assert after["misses"] == before["misses"] and after["hits"] > before["hits"]
    assert (ex.trigrams.trigrams["layer"], ex.trigrams.trigrams["head"]) == (1, 2)
    assert (ex.eigen.detail["layer"], ex.eigen.detail["head"]) == (1, 2)
    assert ex.composition.detail["h2"] == [1, 2] and ex.selected_pair[2:] == [1, 2]


def test_the_fill_gives_way_to_a_click_and_then_finishes(manual_kernel_loop):
    model = fresh_model()
    ex = pcw.CircuitExplorer(model, TEXT)
    ex.stop_background()
    assert ex.wait(WAIT) and ex.wait_background(WAIT)
    cache.clear(model)
    held = Blocker(ex.eigen._runner)  # another view busy on a request
    assert ex.start_background()
    assert giving_way(ex._runner)
    assert table_keys(model) == set()  # it gave way before its first head
    ex.layer, ex.head = 1, 1  # a click while the fill waits
    held.release.set()
    assert ex.wait(WAIT)
    assert (ex.trigrams.trigrams["layer"], ex.trigrams.trigrams["head"]) == (1, 1)
    assert ex.wait_background(WAIT)
    assert len(table_keys(model)) == model.cfg.n_layers * model.cfg.n_heads and ex.progress == {}


def test_requests_of_another_runner_are_computed_before_any_fill_chunk():
    """Two runners as under a kernel: the fill of one waits, before its first chunk, until the
    other's requests (one running, one submitted meanwhile) are both computed."""
    events = []

    loop = ManualLoop()
    fill, clicks = runner.Runner(BareView(), loop=loop), runner.Runner(BareView(), loop=loop)
    held = Blocker(clicks)

    def background():
        for chunk in range(3):
            events.append(f"chunk {chunk}")
            yield None

    def click():
        events.append("click")
        yield None

    fill.submit("fill", background, tier="fill")
    assert giving_way(fill)
    clicks.submit("click", click)
    held.release.set()
    assert clicks.wait(WAIT) and fill.wait(WAIT)
    assert events == ["click", "chunk 0", "chunk 1", "chunk 2"]


def test_a_request_giving_way_waits_for_other_runners_requests_but_not_for_another_giving_way():
    """``GIVE_WAY`` in a request's steps (the skip-trigram table after its partial answer): the
    rest waits until the other runner's request is done; two requests giving way at once do not
    wait for each other (no deadlock), and a synchronous run ignores it."""
    events = []

    loop = ManualLoop()
    table, other, second = (runner.Runner(BareView(), loop=loop) for _ in range(3))
    held = Blocker(other)

    def slow(name):
        def steps():
            events.append(f"{name} partial")
            yield {"busy": True}
            yield runner.GIVE_WAY
            events.append(f"{name} exact")
            yield None
        return steps

    table.submit("table", slow("A"))
    assert giving_way(table)
    second.submit("table", slow("B"))
    assert giving_way(second)
    assert events == ["A partial", "B partial"]  # both wait for the held request, neither for the other
    held.release.set()
    assert other.wait(WAIT) and table.wait(WAIT) and second.wait(WAIT)
    assert sorted(events[2:]) == ["A exact", "B exact"]
    sync = runner.Runner(BareView(), loop=None)
    events.clear()
    sync.submit("table", slow("C"))  # no kernel: runs through, the checkpoint skipped
    assert events == ["C partial", "C exact"]


@pytest.mark.parametrize("how", ["stop_background", "close"])
def test_cancelling_stops_the_fill(manual_kernel_loop, how):
    model = fresh_model()
    ex = pcw.CircuitExplorer(model, TEXT)
    ex.stop_background()
    assert ex.wait(WAIT) and ex.wait_background(WAIT)
    cache.clear(model)
    held = Blocker(ex.trigrams._runner)
    assert ex.start_background() and giving_way(ex._runner)
    getattr(ex, how)()
    held.release.set()
    assert ex.wait_background(WAIT)
    assert table_keys(model) == set() and ex.progress == {}


def test_a_script_runs_nothing_in_the_background():
    model = fresh_model()
    ex = pcw.CircuitExplorer(model, TEXT)
    assert ex.start_background() is False
    assert ex._runner.join(0) and ex.progress == {}  # nothing handed to the scheduler
    assert table_keys(model) == {(0, 0)}  # only the table the explorer shows
