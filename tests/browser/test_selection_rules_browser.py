"""The explorer's selection rules are one rule: ``selection.resolve_selection`` (the kernel's) and
``js/src/lib/selection.js`` ``resolveSelection`` (a page without a kernel) give the same whole
selection on the same cases, run on the source file itself in Chromium; the browser's strongest
writer is a lookup in the kernel's table, never its own argmax."""

import itertools
import json
import pathlib

import numpy as np
import pytest

from pycircuits_widgets.analysis.composition import strongest_writers
from pycircuits_widgets.widgets.core.selection import SELECTION_KEYS, resolve_selection

SELECTION_JS = pathlib.Path(__file__).parents[2] / "js/src/lib/selection.js"
TOKEN_IDS = [5, 7, 5, 9, 7, 5]
L, H = 3, 2


@pytest.fixture(scope="module")
def k_scores():
    scores = np.random.default_rng(0).random((L, H, L, H))
    scores[:, :, 0] = np.nan  # nothing writes into layer 0
    scores[1, :, 2, 1] = np.nan  # no defined score from layer 1 into L2.H1: layer 0's best wins
    scores[:, :, 1, 1] = np.nan  # none at all into L1.H1: no writer
    for l1, l2 in itertools.product(range(L), repeat=2):
        if l1 >= l2:
            scores[l1, :, l2] = np.nan
    return scores


def cases():
    """(current, change) over every kind of change, from selections with and without a pair."""
    starts = [
        {"layer": 0, "head": 0, "position": -1, "token": -1, "selected_pair": []},
        {"layer": 1, "head": 0, "position": 2, "token": 5, "selected_pair": [0, 1, 1, 0]},
        {"layer": 2, "head": 1, "position": 3, "token": 9, "selected_pair": [1, 0, 2, 1]},
    ]
    changes = ([{"layer": l} for l in range(L)] + [{"head": h} for h in range(H)]
               + [{"layer": l, "head": h} for l in range(L) for h in range(H)]
               + [{"position": p} for p in (-1, 0, 1, 3, 5)] + [{"token": t} for t in (-1, 5, 7, 9, 11)]
               + [{"selected_pair": p} for p in ([], [0, 0, 1, 1], [0, 1, 2, 0], [1, 1, 2, 1])]
               + [{"position": 4, "token": 7}, {"layer": 2, "selected_pair": [0, 0, 1, 0]}])
    return [(start, change) for start in starts for change in changes]


def python_answers(writers):
    def writer_of(layer, head):
        l1, h1 = writers[layer, head]
        return None if l1 < 0 else (int(l1), int(h1))

    out = []
    for with_table in (True, False):
        for current, change in cases():
            out.append(resolve_selection(current, change, TOKEN_IDS, writer_of if with_table else None))
    return out


def js_answers(page, writers):
    page.set_content("<!doctype html><title>selection rules</title>")
    return page.evaluate("""async ([source, cases, tokenIds, writers, L, H]) => {
      const url = "data:text/javascript;base64," + btoa(unescape(encodeURIComponent(source)));
      const { resolveSelection, writerLookup } = await import(url);
      const out = [];
      for (const table of [writers, null]) {
        const writerOf = writerLookup(table && new Int32Array(table), L, H);
        for (const [current, change] of cases) out.push(resolveSelection(current, change, tokenIds, writerOf));
      }
      return out;
    }""", [SELECTION_JS.read_text(encoding="utf-8"), cases(), TOKEN_IDS, writers.reshape(-1).tolist(), L, H])


def test_python_and_the_browser_resolve_every_selection_change_alike(page, k_scores):
    writers = strongest_writers(k_scores)
    python, js = python_answers(writers), js_answers(page, writers)
    assert len(js) == len(python) == 2 * len(cases())
    for (current, change), py, browser in zip(cases() * 2, python, js):
        assert browser == py, json.dumps({"current": current, "change": change})
    # the cases reach every rule: a writer's pair, a position's token, a token's last position
    by_case = {json.dumps(case): answer for case, answer in zip(cases(), python)}
    start = cases()[0][0]
    assert by_case[json.dumps((start, {"token": 5}))]["position"] == 5  # its last position
    assert by_case[json.dumps((start, {"position": 3}))]["token"] == 9
    assert by_case[json.dumps((start, {"token": 11}))]["position"] == -1  # not in the text
    moved = [p for (c, ch), p in zip(cases(), python) if "layer" in ch and p["selected_pair"] != c["selected_pair"]]
    assert moved and all(p["selected_pair"][2:] == [p["layer"], p["head"]] for p in moved)


def test_the_browser_names_the_same_selection(page):
    page.set_content("<!doctype html><title>selection keys</title>")
    keys = page.evaluate("""async (source) => {
      const m = await import("data:text/javascript;base64," + btoa(unescape(encodeURIComponent(source))));
      return m.SELECTION_KEYS;
    }""", SELECTION_JS.read_text(encoding="utf-8"))
    assert keys == list(SELECTION_KEYS)


def test_the_writer_table_is_the_argmax_over_earlier_heads_of_finite_scores(k_scores):
    writers = strongest_writers(k_scores)
    for l2, h2 in itertools.product(range(L), range(H)):
        earlier = [(l1, h1) for l1 in range(l2) for h1 in range(H) if np.isfinite(k_scores[l1, h1, l2, h2])]
        best = max(earlier, key=lambda h: k_scores[h[0], h[1], l2, h2], default=(-1, -1))
        assert tuple(writers[l2, h2]) == best, (l2, h2)
    assert tuple(writers[1, 1]) == (-1, -1) and writers[2, 1][0] == 0
