"""The ordinary state of a researcher's kernel (issue 51): the explorer's fill, sections the reader
asked for and a stream of clicks at once, on a model of SmolLM2-135M's layer shape. Everything asked
for completes, and an explorer with nothing to compute uses no CPU.

The model: SmolLM2-135M's layer shape (9 heads of 64, d_model 576, a gated MLP of 1,536, rotary,
vocabulary 49,152) with random weights, and 2 layers instead of 30 so that the fill of every head
fits the suite (``benchmarks/bench_busy_kernel.py`` runs the 30 layers). Deterministic: the test
waits on the views' own signals (``wait``, ``busy``, the scheduler's ``changed``), never on time;
the one span of time is the window the idle CPU is measured over, and its bound is a fraction of it.
"""

import threading
import time

import numpy as np
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import cache
from pycircuits_widgets.widgets.core import scheduler
from random_models import custom_model
from runner_loop import WAIT, giving_way, manual_kernel_loop  # noqa: F401 (fixture)

SMOLLM2_LAYER = {"n_heads": 9, "d_model": 576, "d_head": 64, "d_vocab": 49152, "n_ctx": 256, "positional": "rotary", "rotary_dim": 64,
                     "attn_only": False, "d_mlp": 1536, "act_fn": "silu"}
"""SmolLM2-135M's layer shape (``ModelConfig`` fields)."""
TEXT = " ".join(f"t{(7 * i) % 97 + 3}" for i in range(40))
SECTIONS = ("paths", "virtual", "bigrams")
"""The on-demand sections asked for (besides the measured composition, also asked-for work): those
whose work a click on another head leaves as it is (the neurons section, say, starts again on the
layer clicked, as it should)."""
CLICK_GAP = 0.5
"""Seconds of asked-for pieces between a click's quick views and the next click: "a click every few
seconds", as the scheduler's own clock counts what clicks leave."""
MAX_CLICKS = 400
"""Clicks before the test says what never completed (a hang fails here, by name)."""
IDLE_SPAN = 2.0
"""Seconds the idle explorer's CPU time is measured over."""
IDLE_SHARE = 0.01
"""The most of one core an idle explorer may use (issue 51's target): its threads only block."""


def smollm2_shaped():
    return custom_model(n_layers=2, seed=7, dtype=torch.float32, **SMOLLM2_LAYER)


def clicks_settled(ex) -> bool:
    """Whether every view that follows a click shows the click's answer (the exact skip-trigram
    table may still be on its way: the reader clicks on meanwhile, as a reader does)."""
    views = {name: v for name, v in ex.views().items() if name not in SECTIONS}
    return all(not v.busy for name, v in views.items() if name != "trigrams")


def apply_results(ex) -> None:
    """What the kernel's IO loop does between messages: apply every view's results so far."""
    for view in [ex, *ex.views().values()]:
        view._runner._drain()


def cpu_of_other_threads(span: float) -> float:
    """CPU seconds every thread of this process but the calling one used over ``span`` s of wall time
    (the calling thread blocks meanwhile, on an event nobody sets)."""
    me = time.thread_time()
    before = time.process_time() - me
    threading.Event().wait(span)
    return time.process_time() - time.thread_time() - before


def test_sections_the_fill_and_a_stream_of_clicks_all_complete(manual_kernel_loop):
    model = smollm2_shaped()
    ex = pcw.CircuitExplorer(model, TEXT)
    assert ex.wait(WAIT)
    cfg = model.cfg
    for name in SECTIONS:
        getattr(ex, name).active = True
    ex.composition.measure_on(ex.forward(model, ex.text), "this text")
    ex.composition.source = "measured"
    heads = [(l, h) for l in range(cfg.n_layers) for h in range(cfg.n_heads)]
    asked = {name: getattr(ex, name) for name in SECTIONS}
    clicks, sched = 0, scheduler.shared()

    def asked_for_work_left() -> bool:
        apply_results(ex)
        return any(v.busy for v in asked.values()) or "K" not in ex.composition.measured

    while asked_for_work_left():
        assert clicks < MAX_CLICKS, (f"after {clicks} clicks still computing: "
                                     f"{[n for n, v in asked.items() if v.busy]}, measured {list(ex.composition.measured)}")
        layer, head = heads[clicks % len(heads)]
        with ex.hold_trait_notifications():
            ex.layer, ex.head = layer, head
        clicks += 1
        with sched.changed:  # the click's quick views, then a piece of asked-for work (the time clicks
            # leave), then the next click: the scheduler's own signals, no sleep; its clock says when
            settled = sched.changed.wait_for(lambda: (apply_results(ex), clicks_settled(ex))[1], WAIT)
            assert settled, f"click {clicks} on L{layer}.H{head} never settled"
            before = sched.served[scheduler.ASKED]
            # (the last of the asked-for work may end during the click: nothing is left to serve then)
            served = sched.changed.wait_for(lambda before=before: sched.served[scheduler.ASKED] >= before + CLICK_GAP
                                            or not asked_for_work_left(), WAIT)
            assert served, f"asked-for work had less than {CLICK_GAP} s after click {clicks}"
    assert all(v.error == "" and v.progress == {} for v in asked.values()) and ex.composition.error == ""
    # the clicks stop: the fill (the head-loss table, then every head) runs and completes
    assert ex.wait(WAIT) and ex.wait_background(20 * WAIT)
    assert ex.causal.head_loss_change is not None and np.isfinite(ex.causal.head_loss_change).all()
    assert {key[1:3] for key in cache.keys(model) if key[0] == "skip_trigram_table"} >= set(heads)
    ex.close()


def test_an_idle_explorer_uses_no_cpu_even_with_work_waiting_behind_a_held_piece(manual_kernel_loop):
    """The reported spin: runners parked behind a section's work woke one another without end. Here
    an asked-for piece is held (a section computing) while the explorer's fill and head-loss table
    and the views' kernel-less answers wait behind it; then every view settles. Over each span the
    process's other threads use under ``IDLE_SHARE`` of a core."""
    model = smollm2_shaped()
    ex = pcw.CircuitExplorer(model, TEXT)
    assert ex.wait(WAIT)
    held, release = threading.Event(), threading.Event()

    def holding():
        held.set()
        assert release.wait(20 * WAIT)
        yield None

    ex.paths._runner.submit("held", holding)  # an asked-for piece that computes nothing until released
    assert held.wait(WAIT)
    assert ex.start_background() and giving_way(ex._runner)  # the fill waits behind it
    waiting = cpu_of_other_threads(IDLE_SPAN)
    release.set()
    ex.stop_background()
    assert ex.wait(WAIT) and ex.wait_background(WAIT) and ex.paths._runner.wait(WAIT)
    settled = cpu_of_other_threads(IDLE_SPAN)
    assert waiting < IDLE_SHARE * IDLE_SPAN and settled < IDLE_SHARE * IDLE_SPAN, (waiting, settled)
    ex.close()
