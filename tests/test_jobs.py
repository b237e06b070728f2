"""Jobs never block each other (issue 43): clicks first, then work the user asked for (an
on-demand section), then the background fill. An asked-for job runs in pieces that give way to
clicks and share the tier's time with other asked-for jobs; it reports a count and an estimate, stops
between pieces when cancelled (the view says so and can restart), and a page save waits for
it only within its budget, saving the section as "not computed". Deterministic: the tests wait
on the scheduler's own signals (its ``changed`` condition, ``giving_way``, events a test job sets),
never on time."""

import threading

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets import compute_pool
from pycircuits_widgets.widgets.core import runner
from pycircuits_widgets.widgets.core.meter import Meter
from pycircuits_widgets.widgets.sharing.standalone import NOT_COMPUTED
from random_models import paper_model
from runner_loop import WAIT, BareView, Blocker, ManualLoop, giving_way, manual_kernel_loop, piece_clock  # noqa: F401 (fixtures)

TEXT = "t1 t2 t3 t1 t2 t3 t7 t1"


class Gated:
    """A test-only asked-for job of ``n`` pieces: piece ``hold`` waits, mid-piece, until ``release``
    is set (``held`` is set when it gets there); ``done`` lists the pieces computed."""

    def __init__(self, n: int, hold: int):
        self.n, self.hold = n, hold
        self.held, self.release = threading.Event(), threading.Event()
        self.done: list[int] = []

    def steps(self):
        for piece in range(self.n):
            if piece == self.hold:
                self.held.set()
                assert self.release.wait(WAIT)
            self.done.append(piece)
            yield None


def test_an_asked_for_job_gives_way_to_a_click_between_pieces_and_never_holds_one_up():
    loop = ManualLoop()
    asked = runner.Runner(BareView(), loop=loop, tier="asked")
    clicks = runner.Runner(BareView(), loop=loop)
    job = Gated(50, hold=3)
    asked.submit("pairs", job.steps)
    assert job.held.wait(WAIT)  # piece 3 computing
    events = []
    clicks.submit("click", lambda: iter([events.append("click")]))
    assert clicks.wait(WAIT) and events == ["click"]  # computed while the asked-for piece still runs
    held = Blocker(clicks)  # a click running when the piece ends
    job.release.set()
    assert giving_way(asked)  # waits at its next piece boundary...
    assert job.done == [0, 1, 2, 3]  # ...before computing piece 4
    held.release.set()
    assert clicks.wait(WAIT) and asked.wait(WAIT)
    assert job.done == list(range(50))


def test_a_clicks_rest_waits_for_at_most_the_asked_for_piece_computing(piece_clock):
    """The reported hang: a head's skip-trigram table (a click's exact rest, after ``GIVE_WAY``)
    waited for a whole induction job. The rest is asked-for work: it waits for the one asked-for
    piece computing (non-click pieces run one at a time), then goes before that job's next piece,
    having had less of the tier's time."""
    loop = ManualLoop()
    asked = runner.Runner(BareView(), loop=loop, tier="asked")
    table = runner.Runner(BareView(), loop=loop)
    job = Gated(5, hold=0)
    asked.submit("pairs", job.steps)
    assert job.held.wait(WAIT)

    def click():
        job.done.append("partial")
        yield {"busy": True}
        yield runner.GIVE_WAY
        job.done.append("exact")
        yield None

    table.submit("table", click)
    assert giving_way(table) and job.done == ["partial"]  # the quick part of the click at once
    piece_clock.now += 10.0  # the asked-for piece took 10 s
    job.release.set()
    assert table.wait(WAIT) and asked.wait(WAIT)
    assert job.done == ["partial", 0, "exact", 1, 2, 3, 4]


def test_two_asked_for_jobs_share_the_tiers_time_one_piece_at_a_time(piece_clock):
    """One asked-for piece computes at a time across runners (no two torch thread pools on the
    same cores); the next goes to the view that has had the least of the tier's time, the first
    to come between equals: two jobs of 1 s pieces alternate, and a view arriving later starts
    level with the one there (it neither waits for it nor overtakes it)."""
    loop = ManualLoop()
    a, b = (runner.Runner(BareView(), loop=loop, tier="asked") for _ in range(2))
    order, computing = [], []
    a_computes, b_waits = threading.Event(), threading.Event()

    def steps(name):
        def run():
            for piece in range(3):
                computing.append(name)
                assert len(computing) == 1, computing  # never two pieces at once
                if (name, piece) == ("A", 0):
                    a_computes.set()
                    assert b_waits.wait(WAIT)  # B queued behind A's first piece
                piece_clock.now += 1.0
                order.append(f"{name}{piece}")
                computing.remove(name)
                yield None
        return run

    a.submit("job", steps("A"))
    assert a_computes.wait(WAIT)
    b.submit("job", steps("B"))
    assert giving_way(b)
    b_waits.set()
    assert a.wait(WAIT) and b.wait(WAIT)
    assert order == ["A0", "B0", "A1", "B1", "A2", "B2"]


def test_cancel_stops_an_asked_for_job_between_pieces():
    loop = ManualLoop()
    asked = runner.Runner(BareView(), loop=loop, tier="asked")
    job = Gated(100, hold=2)
    asked.submit("pairs", job.steps)
    assert job.held.wait(WAIT)
    assert asked.cancel_all() == ["pairs"]
    job.release.set()
    assert asked.wait(WAIT)
    assert job.done == [0, 1, 2]  # the piece running finished; none after it


def test_the_meter_counts_and_estimates_from_the_pieces_done():
    meter = Meter("induction: ranked tables", 4, "pairs")
    assert meter.first()["progress"] == {"text": "induction: ranked tables", "done": 0, "total": 4, "unit": "pairs",
                                         "left_s": None}
    report = meter.report(1)
    assert report["done"] == 1 and report["left_s"] >= 0
    assert meter.at(4)["progress"]["left_s"] == 0  # the last report always goes


def test_the_induction_verdicts_come_strongest_pairs_first_in_equal_pieces():
    """A rotary 3-layer model over 4 offsets: the two score pieces, then equal pieces of head pairs
    (``EIGS_PER_PIECE // 4`` pairs, every offset of each) counted in order; each piece's verdicts land
    in ``into`` as it ends, in order of the pairs' largest K-composition score; the verdicts are
    ``pair_verdicts``' (the same generator, run through), and a run given some verdicts computes only
    the rest (a restart resumes)."""
    from pycircuits_widgets.analysis.composition import composition_scores
    from pycircuits_widgets.analysis.induction import EIGS_PER_PIECE, pair_verdicts, pair_verdicts_steps
    from random_models import custom_model

    model = custom_model(n_layers=3, positional="rotary", dtype=torch.float32)
    H, offsets = model.cfg.n_heads, list(range(4))
    per_piece, n_pairs = EIGS_PER_PIECE // 4, 3 * H * H
    pieces = -(-n_pairs // per_piece)
    into, seen, sizes = {}, [], []
    steps = pair_verdicts_steps(model, offsets, into=into)
    while True:
        try:
            seen.append(next(steps))
        except StopIteration as stop:
            verdicts = stop.value
            break
        sizes.append(len(into))
    counts = [min(i * per_piece, n_pairs) for i in range(1, pieces + 1)]  # head pairs done
    assert seen == [("scores", 1, 2), ("scores", 2, 2)] + [("positivity", n, n_pairs) for n in counts]
    assert sizes == [0, 0] + counts
    assert verdicts == pair_verdicts(model, offsets)
    strongest = composition_scores(model, "K", baseline=False, offsets=offsets).nan_to_num(float("-inf")).amax(0)
    order = [float(strongest[key]) for key in into]  # the order they were computed in
    assert order == sorted(order, reverse=True)
    some = dict(list(into.items())[:5])
    resumed = pair_verdicts_steps(model, offsets, into=dict(some))
    counted = [item for item in resumed if item[0] == "positivity"]
    assert counted[-1][1:] == (n_pairs - 5, n_pairs - 5)


def test_virtual_heads_report_a_count_per_head(manual_kernel_loop):
    model = paper_model(n_layers=2, n_heads=3, dtype=torch.float32, seed=11)
    seen = []
    view = pcw.VirtualHeads(model, k=5, n_copies=2, active=False)
    view.observe(lambda change: seen.append(dict(change["new"])), ["progress"])
    view.active = True
    assert view.wait(WAIT) and len(view.heads) == 5 and view.progress == {}
    counted = [p for p in seen if p]
    assert counted[0] == {"text": "virtual heads", "done": 0, "total": 5, "unit": "heads", "left_s": None}
    assert counted[-1]["done"] == 5 and counted[-1]["left_s"] == 0


def test_virtual_heads_show_each_head_as_it_comes_strongest_first(manual_kernel_loop):
    from pycircuits_widgets.analysis.virtual_heads import top_virtual_heads

    model = paper_model(n_layers=2, n_heads=3, dtype=torch.float32, seed=11)
    sizes = []
    view = pcw.VirtualHeads(model, k=5, n_copies=2, active=False)
    view.observe(lambda change: sizes.append([h["pair"] for h in change["new"]]), ["heads"])
    view.active = True
    assert view.wait(WAIT)
    expected = [[*v.h1, *v.h2] for v in top_virtual_heads(model, 5, 2)]
    assert sizes == [expected[:n] for n in range(1, 6)]  # one more each piece, strongest first, then no change


# -- the explorer, a real model ------------------------------------------------------------------
def explorer():
    model = paper_model(n_layers=2, n_heads=3, dtype=torch.float32, seed=11)
    ex = pcw.CircuitExplorer(model, TEXT)
    ex.stop_background()
    assert ex.wait(WAIT)
    return ex


def test_the_induction_section_reports_count_and_estimate_then_clears_it(manual_kernel_loop):
    ex = explorer()
    seen = []
    ex.induction.observe(lambda change: seen.append(dict(change["new"])), ["progress"])
    ex.compute("induction")
    assert ex.wait(WAIT)
    assert ex.induction.pairs and ex.induction.progress == {}
    stages = {p["text"] for p in seen if p}
    assert {"induction: K-composition eigenvalues", "induction: ranked tables"} <= stages
    counted = [p for p in seen if p and p["done"] > 0]
    assert counted and all(p["left_s"] is not None and p["left_s"] >= 0 and p["total"] >= p["done"] for p in counted)


def test_the_induction_section_shows_the_strongest_pair_first_then_fills_in(manual_kernel_loop, monkeypatch):
    """One head pair a piece: the verdicts show as their number doubles (1, 2, 4, 8, then all 9), the
    first is the pair with the largest K-composition score, selected, with its table before the rest
    of the verdicts; the final ``pairs`` are ``pair_verdicts``' numbers."""
    from pycircuits_widgets.analysis import induction
    from pycircuits_widgets.widgets.core.selection import pair_key

    monkeypatch.setattr(induction, "EIGS_PER_PIECE", 1)
    model = paper_model(n_layers=2, n_heads=3, dtype=torch.float32, seed=11)
    view = pcw.InductionMechanism(model, active=False)  # (the explorer's section selects no pair itself)
    sizes, tables_at = [], []
    view.observe(lambda change: sizes.append(len(change["new"])), ["pairs"])
    view.observe(lambda change: tables_at.append(sizes[-1] if sizes else 0), ["tables"])
    view.active = True
    assert view.wait(WAIT)
    assert sizes[:5] == [1, 2, 4, 8, 9]
    verdicts = induction.pair_verdicts(model)
    strongest = max(verdicts, key=lambda key: verdicts[key].k_score)
    assert view.selected_pair == list(strongest)
    assert tables_at[0] == 1  # the strongest pair's table came with its verdict, before the others'
    pairs = view.pairs
    assert list(pairs) == [pair_key(key) for key in verdicts]
    assert all(pairs[pair_key(key)]["qk_positivity"] == v.qk_positivity and pairs[pair_key(key)]["kind"] == v.kind
               for key, v in verdicts.items())


def test_a_long_asked_for_job_blocks_neither_a_click_on_another_head_nor_save_html(manual_kernel_loop, tmp_path):
    ex = explorer()
    ex.induction.active = True
    assert ex.wait(WAIT)
    job = Gated(1000, hold=1)
    ex.induction._runner.submit("pairs", job.steps)  # a long job on the section's own runner
    assert job.held.wait(WAIT)
    ex.layer, ex.head = 1, 2  # a click on another head while a piece of it computes
    for name in ("trigrams", "eigen", "composition", "attention"):
        assert getattr(ex, name).wait(WAIT), name
    assert (ex.trigrams.trigrams["layer"], ex.trigrams.trigrams["head"]) == (1, 2)
    assert ex.induction.busy
    page = ex.save_html(tmp_path / "page.html", budget=0).read_text()  # returns, the piece still computing
    assert NOT_COMPUTED in page.lower() and "InductionMechanism was still computing pairs" in page
    assert ex.induction.busy  # the save cancelled nothing: the section still computes here
    assert ex.cancel("induction") == ["induction"]
    assert ex.induction.progress["state"] == "cancelled" and not ex.induction.active
    job.release.set()
    assert ex.induction.wait(WAIT)
    assert job.done == [0, 1] and not ex.induction.busy
    assert ex.induction.pairs  # the last good state stays
    ex.induction.active = True  # restart
    assert ex.induction.wait(WAIT) and ex.induction.progress == {} and ex.induction.tables


def test_a_real_job_cancelled_before_a_piece_computes_nothing_and_says_so(manual_kernel_loop):
    ex = explorer()
    held = Blocker(ex.trigrams._runner)  # a click running: the asked-for job waits for it
    ex.induction.active = True
    assert giving_way(ex.induction._runner)
    ex.induction.cancel()
    held.release.set()
    assert ex.wait(WAIT)
    assert ex.induction.pairs == {} and not ex.induction.busy
    assert ex.induction.progress == {"state": "cancelled"} and not ex.induction.active
    ex.induction.active = True
    assert ex.wait(WAIT) and ex.induction.pairs


def test_a_page_saved_in_time_has_no_not_computed_line(tmp_path):
    model = paper_model(n_layers=2, n_heads=2, dtype=torch.float32, seed=3)
    ex = pcw.CircuitExplorer(model, TEXT)  # a script: every job runs at once
    page = ex.save_html(tmp_path / "page.html").read_text()
    assert NOT_COMPUTED not in page.lower()


def test_explorer_cancel_refuses_an_unknown_section():
    model = paper_model(n_layers=2, n_heads=2, dtype=torch.float32, seed=3)
    ex = pcw.CircuitExplorer(model, TEXT)
    with pytest.raises(ValueError, match="cancel\\(\\) takes names from"):
        ex.cancel("trigrams")


def test_a_notebook_saved_while_a_view_computed_shows_not_computed_in_its_page():
    """The exporter's pages (``standalone.Page``, from a notebook's saved state): a view saved
    busy is shown "not computed", never a spinner that cannot end."""
    from pycircuits_widgets.widgets.sharing.standalone import SAVED_BUSY, Page, widget_state

    model = paper_model(n_layers=2, n_heads=2, dtype=torch.float32, seed=3)
    view = pcw.VirtualHeads(model, k=3, n_copies=2, active=False)
    saved = widget_state([view])
    saved[view.model_id]["state"]["busy"] = True  # as JupyterLab saves a view mid-computation
    page = Page(saved)
    state = page.saved[view.model_id]["state"]
    assert state["busy"] is False and state["progress"] == {"state": NOT_COMPUTED, "text": SAVED_BUSY}


def test_a_stage_is_timed_from_its_first_piece(monkeypatch):
    """``metered``: the first report of a stage counts the time its first piece took (a meter made
    after that piece would say nothing is left). A stand-in clock: 10 s pass in each piece."""
    import types

    from pycircuits_widgets.widgets.core import meter

    now = [100.0]
    monkeypatch.setattr(meter, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    def pieces():
        for done in range(1, 4):
            now[0] += 10.0  # the piece computes
            yield done, 3
        return "result"

    steps = meter.metered(pieces(), {None: ("stage", "pieces")})
    first = next(steps)["progress"]
    assert (first["done"], first["left_s"]) == (1, 20.0)  # 10 s a piece, 2 left
    assert next(steps)["progress"]["left_s"] == 10.0  # 10 s past the last report: due
    assert next(steps)["progress"]["left_s"] == 0.0
    with pytest.raises(StopIteration) as stop:
        next(steps)
    assert stop.value.value == "result"


def test_each_tier_computes_at_its_compute_pool_priority():
    """The screens' compute pool serves a click's tiles before asked-for work's, and those before
    the fill's (``runner.PRIORITY``); every tier's own torch ops run at torch's thread count (the
    fill's results are the numbers a click computes)."""
    loop = ManualLoop()
    seen = {}

    def job(name):
        def steps():
            seen[name] = (compute_pool.current_priority(), torch.get_num_threads())
            yield None
        return steps

    clicks, asked = runner.Runner(BareView(), loop=loop), runner.Runner(BareView(), loop=loop, tier="asked")
    clicks.submit("click", job("click"))
    assert clicks.wait(WAIT)
    asked.submit("pairs", job("asked"))
    assert asked.wait(WAIT)
    clicks.submit("fill", job("background"), tier="fill")
    assert clicks.wait(WAIT)
    threads = torch.get_num_threads()  # what a runner's new thread starts with
    assert seen == {"click": (0, threads), "asked": (1, threads), "background": (2, threads)}
