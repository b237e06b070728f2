"""The on-demand sections path expansion, positional and neurons, and the exact skip-trigram table,
in pieces (issue 43): each analysis is a generator of ``(done, total)`` pieces whose run-through is the
plain function (bit-equal by construction: checked here on a shipped model and a rotary MLP model);
its view reports a count and an estimate, and stops between two pieces when cancelled, keeping what it
had. Deterministic: a test holds a piece of the real analysis on an event, never on time."""

import threading

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets import screen
from pycircuits_widgets.analysis import cache
from pycircuits_widgets.analysis.neurons import (
    neuron_activations,
    neuron_activations_steps,
    neuron_out_norms,
    neuron_out_norms_steps,
)
from pycircuits_widgets.analysis.positional import positional_scores_by_offset, positional_scores_by_offset_steps
from pycircuits_widgets.analysis.skip_trigrams import (
    SEARCH_STAGES,
    SEED_SOURCES,
    head_table,
    head_table_steps,
    kept_head_table,
)
from pycircuits_widgets.widgets.core import runner
from pycircuits_widgets.widgets.views import skip_trigram_table
from random_models import custom_model
from runner_loop import WAIT, BareView, Blocker, giving_way, manual_kernel_loop  # noqa: F401 (fixture)

TEXT = "t1 t2 t3 t1 t2 t3 t7 t1"


@pytest.fixture(scope="module")
def shipped():
    return pcw.load_pretrained("attn-only-2l")


@pytest.fixture(scope="module")
def rotary_mlp():
    return custom_model(n_layers=3, positional="rotary", attn_only=False, d_mlp=16, act_fn="gelu",
                        dtype=torch.float32, seed=5)


def run_through(steps):
    """``(pieces, result)``: every item a pieces generator yields, and what it returns."""
    pieces = []
    while True:
        try:
            pieces.append(next(steps))
        except StopIteration as stop:
            return pieces, stop.value


def same(a, b) -> bool:
    """Bit-equal (NaN where NaN); ``a`` may be a view's numpy trait."""
    a = torch.as_tensor(a)
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))


class Held:
    """Wraps a pieces generator function: the piece that reports ``done == hold`` waits, once
    computed, until ``release`` is set (``held`` is set when it gets there); ``calls`` lists, per
    call, the pieces yielded (``seen``: the first call's)."""

    def __init__(self, steps_function, hold: int):
        self.function, self.hold = steps_function, hold
        self.held, self.release = threading.Event(), threading.Event()
        self.calls = []

    @property
    def seen(self) -> list:
        return self.calls[0]

    def __call__(self, *args, **kwargs):
        steps = self.function(*args, **kwargs)
        seen = []
        self.calls.append(seen)
        while True:
            try:
                item = next(steps)
            except StopIteration as stop:
                return stop.value
            seen.append(item)
            if item[-2] == self.hold:
                self.held.set()
                assert self.release.wait(WAIT)
            yield item


# -- the analyses: pieces run through are the plain function -----------------------------------
def test_positional_scores_come_one_layer_a_piece_and_equal_the_plain_function(shipped, rotary_mlp):
    for model, run_cache in ((shipped, None), (rotary_mlp, pcw.run(rotary_mlp, TEXT).cache)):
        n_pos = 8 if run_cache is None else run_cache.tokens.shape[-1]
        pieces, scores = run_through(positional_scores_by_offset_steps(model, n_pos, 5, cache=run_cache))
        L = model.cfg.n_layers
        assert pieces == [(i, L) for i in range(L + 1)]
        assert same(scores, positional_scores_by_offset(model, n_pos, 5, cache=run_cache))


def test_positional_pieces_refuse_bad_arguments_before_the_first_piece(shipped):
    with pytest.raises(ValueError, match="max_offset must be in"):
        next(positional_scores_by_offset_steps(shipped, 8, 8))


def test_neuron_activations_and_norms_come_one_layer_a_piece_and_equal_the_plain_functions(rotary_mlp):
    cache = pcw.run(rotary_mlp, TEXT).cache
    pieces, acts = run_through(neuron_activations_steps(rotary_mlp, cache))
    assert pieces == [(i, 3) for i in range(4)]
    assert same(acts, neuron_activations(rotary_mlp, cache))
    for layer in range(3):
        assert same(acts[:, layer], neuron_activations(rotary_mlp, cache, layer))
    pieces, norms = run_through(neuron_out_norms_steps(rotary_mlp))
    assert pieces == [("gram", 0, 1), ("gram", 1, 1)] + [("layers", i, 3) for i in range(1, 4)]
    assert same(norms, neuron_out_norms(rotary_mlp))
    for layer in range(3):
        assert same(norms[layer], neuron_out_norms(rotary_mlp, layer))


def test_neuron_norms_are_the_dense_float64_ones(rotary_mlp):
    dense = (rotary_mlp.W_out.double() @ rotary_mlp.W_U.double()).norm(dim=-1)
    from tolerance import gamma

    size = rotary_mlp.W_out.double().abs().norm(dim=-1) * rotary_mlp.W_U.double().abs().norm(dim=-1).max()
    tol = gamma(2 * rotary_mlp.cfg.d_vocab, torch.float32) * size * 4
    assert bool(((neuron_out_norms(rotary_mlp).double() - dense).abs() <= tol).all())


# -- the views: count, estimate, cancel midway ----------------------------------------------------
def counted(view) -> list[dict]:
    seen = []
    view.observe(lambda change: seen.append(dict(change["new"])), ["progress"])
    return seen


def started_and_held(monkeypatch, module, name: str, hold: int, make_view):
    """``(held, view, seen)``: ``module.name`` (a pieces analysis the view calls) replaced by a ``Held``
    one that stops after ``hold`` pieces; the view made inactive, then started; returns once the
    analysis is held and the runner has applied what came meanwhile (the kernel IO loop's part)."""
    held = Held(getattr(module, name), hold=hold)
    monkeypatch.setattr(module, name, held)
    view = make_view()
    seen = counted(view)
    view.active = True
    assert held.held.wait(WAIT)
    view._runner._drain()
    return held, view, seen


def test_the_positional_view_counts_layers_and_is_cancelled_midway(manual_kernel_loop, monkeypatch, rotary_mlp):
    from pycircuits_widgets.widgets.views import positional_qk

    held, view, seen = started_and_held(monkeypatch, positional_qk, "positional_scores_by_offset_steps", 1,
                                        lambda: pcw.PositionalQK(rotary_mlp, TEXT, active=False))
    # layer 0 computed, layer 1 not begun: the count so far
    assert seen[-1] == {"text": "positional: scores by offset", "done": 0, "total": 3, "unit": "layers",
                        "left_s": None}
    view.cancel()
    held.release.set()
    assert view.wait(WAIT) and not view.busy
    assert held.seen == [(0, 3), (1, 3)]  # no piece after the cancel
    assert view.positional is None
    assert view.progress == {"text": "positional: scores by offset", "done": 0, "total": 3, "unit": "layers",
                             "state": "cancelled"}
    monkeypatch.setattr(positional_qk, "positional_scores_by_offset_steps", positional_scores_by_offset_steps)
    view.active = True  # restart
    assert view.wait(WAIT) and view.progress == {}
    assert seen[-2]["done"] == 3 and seen[-2]["left_s"] == 0
    assert same(view.positional, positional_scores_by_offset(rotary_mlp, 8, 7, cache=pcw.run(rotary_mlp, TEXT).cache))


def test_the_neurons_view_meters_each_stage_and_is_cancelled_midway(manual_kernel_loop, monkeypatch, rotary_mlp):
    from pycircuits_widgets.widgets.views import neurons

    held, view, seen = started_and_held(monkeypatch, neurons, "neuron_out_norms_steps", 2,
                                        lambda: pcw.NeuronView(rotary_mlp, TEXT, active=False))
    # the Gram and layers 0-1 of the norms
    texts = {p.get("text") for p in seen if p}
    assert {"neurons: activations on the text", "neurons: W_U W_U^T", "neurons: ||W_out W_U|| per neuron"} <= texts
    view.cancel()
    held.release.set()
    assert view.wait(WAIT) and not view.busy
    assert held.seen[-1] == ("layers", 2, 3)
    assert view.neurons is None and view.progress["state"] == "cancelled"
    monkeypatch.setattr(neurons, "neuron_out_norms_steps", neuron_out_norms_steps)
    view.active = True
    assert view.wait(WAIT) and view.progress == {} and view.ranking == "norm"
    assert view.neurons.tolist() == torch.topk(neuron_out_norms(rotary_mlp)[0], 10).indices.tolist()


# -- path expansion --------------------------------------------------------------------------------
def test_path_expansion_comes_one_term_a_piece_and_equals_the_plain_function(shipped, rotary_mlp):
    from pycircuits_widgets.analysis.path_expansion import path_expansion, path_expansion_steps

    for model, text in ((shipped, "def f(x): return x"), (rotary_mlp, TEXT)):
        run = pcw.run(model, text)
        pieces, pe = run_through(path_expansion_steps(model, run))
        n = len(pe.terms)
        assert pieces == [(i, n) for i in range(n + 1)]
        plain = path_expansion(model, run)
        assert [(t.source, t.heads) for t in pe.terms] == [(t.source, t.heads) for t in plain.terms]
        pieces, readout = run_through(pe.readout_steps())
        assert pieces == [(i, n) for i in range(n + 1)]
        assert pe.readout is readout  # kept
        assert same(readout.by_order, plain.readout.by_order)
        assert same(readout.contributions, plain.next_token_contributions())
        pieces, importance = run_through(pe.term_importance_steps())
        assert pieces == [(i, n) for i in range(n + 1)]
        assert same(importance, plain.term_importance())


def test_the_path_expansion_view_meters_three_stages_and_is_cancelled_midway(manual_kernel_loop, monkeypatch,
                                                                            rotary_mlp):
    from pycircuits_widgets.analysis.path_expansion import PathExpansion

    real = PathExpansion.term_importance_steps
    held = Held(real, hold=2)
    monkeypatch.setattr(PathExpansion, "term_importance_steps", lambda pe: held(pe))
    view = pcw.PathExpansion(rotary_mlp, TEXT, active=False)
    seen = counted(view)
    view.active = True
    assert held.held.wait(WAIT)  # terms and their logits done, 2 importances computed
    view._runner._drain()
    texts = [p["text"] for p in seen if p]
    assert texts[0] == "path expansion: terms" and "path expansion: logits of each term" in texts
    assert seen[-1]["text"] == "path expansion: loss without each term"
    view.cancel()
    held.release.set()
    assert view.wait(WAIT) and not view.busy
    assert held.seen[-1][0] == 2 and view.terms == [] and view.progress["state"] == "cancelled"
    monkeypatch.setattr(PathExpansion, "term_importance_steps", real)
    view.active = True
    assert view.wait(WAIT) and view.progress == {} and view.terms
    plain = pcw.analysis.path_expansion(rotary_mlp, pcw.run(rotary_mlp, TEXT), view._max_order)
    assert same(view.importance, plain.term_importance().float())


# -- the exact skip-trigram table ------------------------------------------------------------------
COLUMNS = ("source", "destination", "out", "qk", "ov", "score")


@pytest.mark.parametrize("which", ["shipped", "rotary"])
def test_the_exact_search_comes_block_by_block_and_equals_the_plain_function(which, shipped):
    model = shipped if which == "shipped" else custom_model(n_layers=1, positional="rotary", d_vocab=2048, n_ctx=32,
                                                            dtype=torch.float32, seed=2)
    layer = model.cfg.n_layers - 1
    small = model.cfg.d_vocab * 4 * 8  # 8 sources a recompute block: several pieces
    cache.clear(model)
    pieces, table = run_through(head_table_steps(model, layer, 1, 30, approximate=True, block_bytes=small))
    stages = [p[0] for p in pieces]
    assert stages == sorted(stages, key=SEARCH_STAGES.index) and len(pieces) >= 4
    for stage in set(stages):  # each stage from 0 to its total
        mine = [p for p in pieces if p[0] == stage]
        assert mine[0][1] == 0 and mine[-1][1] == mine[-1][2]
    assert (which == "rotary") == ("offsets" in stages)
    assert kept_head_table(model, layer, 1, 30, block_bytes=small) is table  # kept
    cache.clear(model)
    plain = head_table(model, layer, 1, 30, approximate=True, block_bytes=small)
    assert plain is not table
    for name in COLUMNS + (("offset",) if which == "rotary" else ()):
        assert same(getattr(table, name), getattr(plain, name)), name
    pieces, kept = run_through(head_table_steps(model, layer, 1, 30, approximate=True, block_bytes=small))
    assert pieces == [] and kept is plain  # the kept table: no piece


LARGE_VOCAB = 2048
BLOCKS = len(range(SEED_SOURCES, LARGE_VOCAB, screen.SCREEN_ROWS["float32"]))
"""Source blocks of ``large_vocab``'s exact search after its seed: 2 (a click can stop it between them)."""


@pytest.fixture
def large_vocab(monkeypatch):
    """A one-layer model whose vocabulary the view treats as large (a partial table first, then the
    exact search in pieces), and the exact search held at its first block's end (``Held``). The screen
    runs on the float32 route, usable on every CPU, so the search has ``BLOCKS`` blocks everywhere."""
    monkeypatch.setattr(pcw.SkipTrigramTable, "partial_above", 1024)
    monkeypatch.setattr(screen, "exact_route", lambda device_type="cpu": "float32")
    held = Held(head_table_steps, hold=1)
    monkeypatch.setattr(skip_trigram_table, "head_table_steps", held)
    return custom_model(n_layers=1, d_vocab=LARGE_VOCAB, dtype=torch.float32, seed=2), held


def test_a_click_on_another_head_stops_the_exact_table_at_its_next_block(manual_kernel_loop, large_vocab):
    model, held = large_vocab
    view = pcw.SkipTrigramTable(model, layer=0, head=0)
    assert held.held.wait(WAIT)  # head 0: partial table shown, its exact search one block in
    view._runner._drain()
    assert view.trigrams["head"] == 0 and view.trigrams["exact"] is False
    assert view.progress["text"] == "exact table: screening sources" and view.progress["unit"] == "source blocks"
    view.head = 1  # a click on another head
    held.release.set()
    assert view.wait(WAIT)
    assert held.calls[0] == [("screen", 0, BLOCKS), ("screen", 1, BLOCKS)]  # head 0's search: no block after the click
    assert kept_head_table(model, 0, 0, view.k) is None
    t = view.trigrams
    assert (t["head"], t["exact"], view.progress) == (1, True, {})
    assert same(t["score"], head_table(model, 0, 1, view.k, approximate=True).score)


def test_the_exact_table_gives_way_to_another_views_click_between_blocks(manual_kernel_loop, large_vocab):
    model, held = large_vocab
    view = pcw.SkipTrigramTable(model, layer=0, head=2)
    assert held.held.wait(WAIT)
    click = Blocker(runner.Runner(BareView(), loop=manual_kernel_loop))  # another view's click, running
    held.release.set()
    assert giving_way(view._runner)  # the search waits at its next block boundary...
    assert held.seen == [("screen", 0, BLOCKS), ("screen", 1, BLOCKS)]  # ...before computing it
    click.release.set()
    assert view.wait(WAIT) and view.trigrams["exact"] and view.trigrams["head"] == 2
    assert len(held.seen) > 2


def test_cancel_stops_the_exact_table_and_keeps_the_partial_one_labelled_partial(manual_kernel_loop, large_vocab):
    model, held = large_vocab
    view = pcw.SkipTrigramTable(model, layer=0, head=1)
    assert held.held.wait(WAIT)
    view._runner._drain()  # the partial table and the count, as the kernel's IO loop applies them
    view.cancel()
    held.release.set()
    assert view.wait(WAIT) and not view.busy
    assert held.seen == [("screen", 0, BLOCKS), ("screen", 1, BLOCKS)]
    assert view.trigrams["exact"] is False and view.trigrams["progress"] < 1 and view.trigrams["head"] == 1
    # the count last reported (the held block's own report was never sent: it was held before it)
    assert view.progress == {"text": "exact table: screening sources", "done": 0, "total": BLOCKS,
                             "unit": "source blocks", "state": "cancelled"}
    view.recompute()  # computes it again
    assert view.trigrams["exact"] is True and view.progress == {}


# -- a forward that stops early (the dataset examples' re-run) ------------------------------------
def test_a_forward_of_the_first_layers_is_the_whole_forwards_first_layers_bit_for_bit(rotary_mlp):
    tokens = torch.tensor([[1, 2, 3, 1, 2, 3, 7, 1], [4, 5, 6, 4, 5, 6, 8, 4]])
    _, full = rotary_mlp.run_with_cache(tokens, mlp_post=True, logits=False)
    for layers in (1, 2):
        _, early = rotary_mlp.run_with_cache(tokens, mlp_post=True, logits=False, layers=layers)
        assert same(early.patterns, full.patterns[:, :layers]) and same(early.mlp_post, full.mlp_post[:, :layers])
        assert same(early.resid, full.resid[:, :layers + 1]) and same(early.ln_scale, full.ln_scale[:, :layers])
    _, all_layers = rotary_mlp.run_with_cache(tokens, mlp_post=True, logits=False, layers=3)
    assert same(all_layers.ln_scale, full.ln_scale) and same(all_layers.resid, full.resid)


@pytest.mark.parametrize("kwargs, match", [
    ({"layers": 0, "logits": False}, "layers must be an int in 1..3"),
    ({"layers": 2.0, "logits": False}, "layers must be an int"),
    ({"layers": 2}, "pass logits=False"),
])
def test_a_forward_that_stops_early_refuses_what_it_cannot_give(rotary_mlp, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rotary_mlp.run_with_cache(torch.tensor([[1, 2, 3]]), **kwargs)
