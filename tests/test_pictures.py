"""Static fallback pictures of the paper views (widgets/sharing/pictures.py): each view's
``text/html`` fallback carries its figure, under the budget, drawn from the same numbers the
analysis functions give (the oracles here call them directly, not the widgets).

Tolerances: what the picture prints, ``f"{v:.Ng}"``, is within half a unit of its last digit, at most
``printed(N) = 5 * 10^-N`` of the value (float32 copies add a rounding or two, far below); coordinates
printed to 0.1 px are within 0.05 px."""

import html
import re

import numpy as np
import pytest

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import (
    bigram_top,
    induction_pair,
    path_expansion,
    positional_scores_by_offset,
    run,
    top_virtual_heads,
)
from pycircuits_widgets.widgets.sharing.pictures import BUDGET, TABLE_ROWS
from tolerance import gamma

TEXT = "def fibonacci(n):\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def m2():
    return pcw.load_pretrained("attn-only-2l")


def printed(digits: int) -> float:
    """Relative error of a number printed with ``digits`` significant digits, and of its float32 copies."""
    return 5 * 10.0 ** -digits + gamma(2)


def figure(widget, name: str) -> str:
    """The widget's fallback (checked under budget) and its figure ``name``."""
    page = widget._fallback_html()
    assert len(page.encode("utf-8")) <= BUDGET
    found = re.search(rf'<(svg|table)[^>]*data-pcw-figure="{name}".*?</\1>', page, re.DOTALL)
    assert found, f"no {name} figure in the fallback of {type(widget).__name__}"
    return found.group(0)


def cells(table: str) -> list[list[str]]:
    rows = re.findall(r"<tr>(.*?)</tr>", table, re.DOTALL)
    return [[html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td>(.*?)</td>", r, re.DOTALL)]
            for r in rows[1:]]


def shown(token: str) -> str:
    return token.replace(" ", "·").replace("\n", "↵")


def test_path_expansion_picture_shows_the_loss_ladder_and_the_most_important_terms(m2):
    w = pcw.PathExpansion(m2, TEXT)
    pe = path_expansion(m2, TEXT)
    losses = [float(x) for x in pe.loss_by_order()]
    ladder = figure(w, "path-ladder")
    titles = [float(t) for t in re.findall(r"<title>([^<]+)</title>", ladder)]
    assert titles[:len(losses)] == pytest.approx(losses, rel=printed(4))  # orders 0.., then the full model
    terms = figure(w, "path-terms")
    importance = pe.term_importance().numpy()
    best = np.argsort(-importance)[:TABLE_ROWS]
    assert [float(t) for t in re.findall(r"<title>([^<]+)</title>", terms)] == pytest.approx(
        importance[best].tolist(), rel=printed(4), abs=0)
    names = [html.unescape(n) for n in re.findall(r'<text x="0"[^>]*>([^<]+)</text>', terms)]
    assert names == [pe.terms[i].name for i in best]


def test_positional_picture_draws_the_selected_heads_offset_curve(m2):
    w = pcw.PositionalQK(m2, TEXT, layer=0, head=4)
    svg = figure(w, "positional")
    points = re.search(r'data-pcw-curve="positional" points="([^"]+)"', svg).group(1).split()
    ys = np.array([float(p.split(",")[1]) for p in points])
    n = len(run(m2, TEXT).str_tokens[0])
    want = positional_scores_by_offset(m2, n, len(ys) - 1)[0, 4].numpy()
    # the curve is the score scaled to its range, upside down (SVG y grows downwards)
    assert np.argmin(ys) == np.argmax(want) and np.argmax(ys) == np.argmin(want)
    scaled = (ys.max() - ys) / (ys.max() - ys.min())
    # three coordinates each within 0.05 px: the scaled value within 0.2 px of the curve's span
    expected = (want - want.min()) / (want.max() - want.min())
    np.testing.assert_allclose(scaled, expected, atol=0.2 / (ys.max() - ys.min()))
    assert "L0.H4" in w._fallback_html()


def test_virtual_heads_picture_lists_the_strongest_pairs(m2):
    w = pcw.VirtualHeads(m2)
    rows = cells(figure(w, "virtual-heads"))
    want = top_virtual_heads(m2, k=len(rows))
    assert [r[0] for r in rows] == [f"L{v.h1[0]}.H{v.h1[1]} → L{v.h2[0]}.H{v.h2[1]}" for v in want]
    assert [float(r[1]) for r in rows] == pytest.approx([v.norm for v in want], rel=printed(3))


def test_induction_picture_shows_the_selected_pairs_verdict_and_ranked_table(m2):
    w = pcw.InductionMechanism(m2, selected_pair=[0, 4, 1, 6])
    rows = cells(figure(w, "induction-table"))
    want = induction_pair(m2, (0, 4), (1, 6), k=len(rows))
    strings = m2.token_strings
    assert [(r[0], r[1]) for r in rows] == [(shown(strings[d]), shown(strings[s]))
                                            for d, s in zip(want.top_dest.tolist(), want.top_src.tolist())]
    assert "L0.H4 → L1.H6" in w._fallback_html()


def test_bigram_picture_shows_each_rows_top_next_tokens(m2):
    m0 = pcw.load_pretrained("attn-only-0l")
    w = pcw.BigramTable(m0, token=5)
    rows = cells(figure(w, "bigrams"))
    assert len(rows) == TABLE_ROWS
    values, ids = bigram_top(m0, 5, [5])
    strings = m0.token_strings
    assert rows[0][0] == shown(strings[5])  # the selected token's row first
    assert re.findall(r"(\S+) (-?[\d.e+-]+)", rows[0][1]) == [
        (shown(strings[i]), f"{v:.3g}") for i, v in zip(ids[0].tolist(), values[0].tolist())]


def test_a_state_saved_before_the_views_moved_is_still_drawn_from_its_data(m2):
    from pycircuits_widgets.widgets.sharing.standalone import saved_picture, widget_state

    explorer = pcw.CircuitExplorer(m2, TEXT)
    saved = widget_state([explorer])
    for model in saved.values():  # the class paths an older version saved
        state = model["state"]
        if "_anywidget_id" in state:
            module, name = state["_anywidget_id"].rsplit(".", 1)
            state["_anywidget_id"] = f"pycircuits_widgets.widgets.{module.rsplit('.', 1)[-1]}.{name}"
    picture = saved_picture(saved, explorer.model_id)
    assert picture == explorer._fallback_html()
    saved[explorer.model_id]["state"]["_anywidget_id"] = "pycircuits_widgets.widgets.explorer.NotAView"
    assert saved_picture(saved, explorer.model_id) is None
