"""Kernel-less answers (widgets/core/offline.py): each view's ``_offline`` trait holds, for every
other selection, what the widget itself computes when the selection moves there, compactly
encoded and within the budget; under a kernel it is filled in the background, never busy,
yielding to clicks, and ``wait()`` covers it.

Tolerances (``tests/tolerance.py``): a saved answer is the widget's own result (the same cached analysis),
its arrays packed as float16 (``PACKED``: one rounding to float16), its scalars as JSON numbers with 5
significant digits (``SCALAR``)."""

import json
import threading
import zlib

import numpy as np
import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.core import offline
from pycircuits_widgets.widgets.core.offline import BUDGET, NEEDS_KERNEL, key
from random_models import paper_model
from runner_loop import manual_kernel_loop  # noqa: F401 (fixture)
from tolerance import gamma

PACKED = {"rtol": gamma(1, torch.float16), "atol": 2**-25}
"""A float array against its float16 packing: one rounding, ``u = 2^-11`` relative, or half the subnormal
spacing ``2^-24`` below float16's smallest normal (values past float16's range are packed as float32,
closer still)."""
SCALAR = 5e-5
"""A saved scalar's relative rounding: 5 significant digits are within half a unit of the fifth digit,
``0.5 * 10^-4`` of the leading digit's place, at most ``5e-5`` of the value."""


def saved_rules(state: dict) -> list[dict]:
    """The rules: raw-deflated UTF-8 JSON in a uint8 payload (read here with zlib, not offline.py)."""
    assert state["rules"]["encoding"] == "deflate" and state["rules"]["dtype"] == "uint8"
    return json.loads(zlib.decompress(bytes(state["rules"]["view"]), -15).decode("utf-8"))


def answer(state: dict, rule: int, selection: str) -> dict:
    """The trait patch a kernel-less front end applies (rule base merged under the answer,
    packed arrays decoded): written here from the format's description, not from offline.py."""
    rules = saved_rules(state)
    data = bytes(state["data"])

    def unpack(v):
        if isinstance(v, dict) and "packed" in v:
            offset, dtype, shape = v["packed"]
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            return np.frombuffer(data[offset:offset + n], dtype=dtype).reshape(shape)
        if isinstance(v, dict):
            return {k: unpack(x) for k, x in v.items()}
        return v

    def merge(base, patch):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    r = rules[rule]
    return unpack(merge(r["base"], r["patches"][selection]))


def test_each_heads_table_is_what_the_widget_computes_for_that_head():
    model = paper_model(n_layers=2, n_heads=3)
    table = pcw.SkipTrigramTable(model, k=offline.TABLE_K)
    state = offline.fill(table)
    rules = saved_rules(state)
    assert [r["on"] for r in rules] == [["layer", "head"]] and len(rules[0]["patches"]) == 6
    assert state["kernel"] == {name: NEEDS_KERNEL[name] for name in ("query", "token", "embedding")}
    for layer, head in [(1, 2), (0, 1)]:
        table.layer, table.head = layer, head  # the kernel's own recompute, as oracle
        assert table.wait()
        got = answer(state, 0, key(layer, head))
        assert (got["trigrams"]["layer"], got["trigrams"]["head"]) == (layer, head)
        for column in ("src", "dest", "out"):
            np.testing.assert_array_equal(got["trigrams"][column], table.trigrams[column])
        for column in ("qk", "ov", "score"):
            np.testing.assert_allclose(got["trigrams"][column], table.trigrams[column], **PACKED)
        ids = set(table.trigrams["src"]) | set(table.trigrams["out"])
        assert all(got["trigrams"]["strings"][str(i)] == model.token_strings[i] for i in ids)
        assert got["error"] == "" and got["related"] == {} and got["token"] == -1


def test_saved_tables_are_as_long_as_the_views_and_a_longer_k_is_cut_and_said():
    model = paper_model(n_layers=2, n_heads=3)
    table = pcw.SkipTrigramTable(model, k=30)
    got = answer(offline.fill(table), 0, key(1, 2))
    assert got["k"] == 30 and len(got["trigrams"]["score"]) == 30 and "_offline_note" not in got
    table.k = offline.TABLE_K + 20  # an offline input: the saved answers follow it
    assert not table._offline_fresh
    table._offline_ready()  # as save_html does before writing a page
    got = answer(table._offline, 0, key(1, 2))
    assert got["k"] == len(got["trigrams"]["score"]) == offline.TABLE_K
    assert f"top {offline.TABLE_K} " in got["_offline_note"] and f"top {table.k})" in got["_offline_note"]
    assert got["error"] == ""


def test_answers_stop_at_the_budget_current_selection_first_and_say_the_rest_needs_a_kernel():
    model = paper_model(n_layers=2, n_heads=3)
    eigen = pcw.EigenvaluePlot(model, scores={}, layer=1, head=1)
    full = offline.fill(eigen)
    rule = saved_rules(full)[0]
    assert len(rule["patches"]) == 6 and len(full["data"]) + len(json.dumps(saved_rules(full), separators=(",", ":"))) <= BUDGET
    one = len(json.dumps(rule["patches"][key(1, 1)], separators=(",", ":"))) + len(full["data"]) // 6
    small = saved_rules(offline.fill(eigen, budget=len(json.dumps(rule["base"])) + 100 + 2 * one + one // 2))[0]
    assert list(small["patches"]) == [key(1, 1), key(0, 0)]  # the selected head first
    assert "over its" in small["missing"] and "needs a running kernel" in small["missing"]
    got = answer(offline.fill(eigen), 0, key(0, 2))
    eigen.layer, eigen.head = 0, 2
    assert eigen.wait()
    np.testing.assert_allclose(got["detail"]["ov_re"], eigen.detail["ov_re"], **PACKED)
    assert [c["id"] for c in got["detail"]["copies"]] == [c["id"] for c in eigen.detail["copies"]]
    assert pcw.ColoredTokens(["a"], [1.0])._offline == {}


def test_composition_answers_follow_the_kind_shown(m2_composition):
    comp = m2_composition
    state = offline.fill(comp)
    pair = [0, 1, 1, 2]
    got = answer(state, 0, key(pair, comp.kind))
    comp.selected_pair = pair
    assert comp.wait()
    assert got["detail"]["kind"] == comp.kind and got["detail"]["h2"] == [1, 2]
    assert got["detail"]["score"] == pytest.approx(comp.detail["score"], rel=SCALAR, abs=0)
    assert got["detail"]["baseline"] == pytest.approx(comp.detail["baseline"], rel=SCALAR, abs=0)
    np.testing.assert_allclose(got["detail"]["singular_values"], comp.detail["singular_values"], **PACKED)


@pytest.fixture
def m2_composition():
    return pcw.CompositionMatrix(paper_model(n_layers=2, n_heads=3))


def test_under_a_kernel_answers_fill_in_the_background_never_busy_and_wait_covers_them(manual_kernel_loop):
    model = paper_model(n_layers=2, n_heads=3)
    table = pcw.SkipTrigramTable(model, k=5)
    assert table.wait()
    assert len(saved_rules(table._offline)[0]["patches"]) == 6
    eigen = pcw.EigenvaluePlot(model, scores={})
    assert eigen.wait()
    first = eigen._offline
    eigen.n_copies = 3  # an input of the answers: they are recomputed
    assert eigen.wait() and eigen._offline is not first
    assert all(len(c["copies"]) == 3 for c in (answer(eigen._offline, 0, key(l, h))["detail"]
                                              for l in range(2) for h in range(3)))


def test_a_background_job_yields_to_a_request_between_its_chunks(manual_kernel_loop):
    model = paper_model(n_layers=2, n_heads=3)
    w = pcw.SkipTrigramTable(model, k=5)
    assert w.wait()
    order, started, release = [], threading.Event(), threading.Event()

    def background():
        order.append("b1")
        started.set()
        assert release.wait(30)
        yield None  # a chunk boundary: the request below runs here
        order.append("b2")
        yield {"sort_by": "ov"}

    def request():
        order.append("request")
        yield {"page": 1}

    w._runner.submit("offline", background, tier="fill")
    assert started.wait(30) and not w.busy  # background work never shows as busy
    w._runner.submit("table", request)
    assert w.busy
    release.set()
    assert w.wait(30)
    assert order == ["b1", "request", "b2"] and (w.page, w.sort_by) == (1, "ov") and not w.busy


def test_values_past_float16_range_are_packed_as_float32_without_a_warning():
    """float16 holds at most 65504: a larger value keeps float32 (exact) instead of becoming inf
    (numpy's "overflow encountered in cast" RuntimeWarning in the notebook)."""
    import warnings

    from pycircuits_widgets.widgets.core.payload import as_wire
    big = np.array([1.5, -70000.0, 3e5, np.nan], dtype=np.float32)
    small = np.array([1.5, -65504.0, 0.25], dtype=np.float32)
    answers = offline.Answers()
    answers.rule(["layer"], iter([((0,), {"t": big}), ((1,), {"t": small})]), missing="")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = offline.last(answers.steps())["_offline"]
        direct = as_wire(big, "float16")
    assert direct.dtype == np.float32 and as_wire(small, "float16").dtype == np.float16
    np.testing.assert_array_equal(direct, big)
    got_big, got_small = answer(state, 0, key(0))["t"], answer(state, 0, key(1))["t"]
    assert got_big.dtype == np.float32 and got_small.dtype == np.float16
    np.testing.assert_array_equal(got_big, big)
    np.testing.assert_array_equal(got_small, small)
