"""Property: any interleaving of selection, token and text changes -- from Python and as
browser messages (``set_state``, what the comm delivers; see tests/harness.py), valid or not,
on the explorer or any child view -- ends with every view showing the last selection, with
the kernel-side results (table, token query, spectrum) of that selection. The oracle is an
independent model of the selection rules; runs both as a script (synchronous runner) and
as under a kernel (workers; results applied when the test thread waits)."""

from unittest import mock

import pytest
import torch
import traitlets
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.core import runner
from random_models import paper_model
from runner_loop import ManualLoop

L, H, V, N_CTX = 2, 3, 40, 16
TEXTS = ["t1 t2 t3 t1 t2 t3 t7 t1", "t5 t6 t5 t6", "t9", "t2 t2 t2 t4 t2", "", "t1 " * 20, "t1 t99"]
MODEL = paper_model(n_layers=L, n_heads=H, d_vocab=V, n_ctx=N_CTX, dtype=torch.float32)

KEYS = {
    "explorer": ["layer", "head", "position", "token", "text"],
    "attention": ["layer", "head", "position", "text"],
    "loss": ["position"],
    "trigrams": ["layer", "head", "token"],
    "eigen": ["layer", "head"],
    "composition": ["layer", "head", "selected_pair"],
}


@st.composite
def operations(draw):
    kind = draw(st.sampled_from(["python", "browser", "browser", "wait"]))
    if kind == "wait":
        return ("wait",)
    target = draw(st.sampled_from(sorted(KEYS)))
    key = draw(st.sampled_from(KEYS[target]))
    if key == "text":
        value = draw(st.sampled_from(TEXTS))
    elif key == "selected_pair":
        value = draw(st.one_of(st.just([]), st.lists(st.integers(-1, 3), min_size=4, max_size=4)))
    elif key == "token":  # mostly tokens of the texts (and -1), sometimes any
        value = draw(st.one_of(st.sampled_from([-1, 1, 2, 3, 5, 7, 9, 30]), st.integers(-2, V + 1)))
    else:
        value = draw(st.integers(-2, 9))
    return (kind, target, key, value)


def ids_of(text):
    return [int(t[1:]) for t in text.split()]


class Oracle:
    """The selection rules, written from the spec (not from the widgets)."""

    def __init__(self, text):
        self.text, self.ids = text, ids_of(text)
        self.sel = {"layer": 0, "head": 0, "position": -1, "token": -1}

    def valid(self, key, value):
        if key == "text":
            return bool(value) and len(value.split()) <= N_CTX and all(i < V for i in ids_of(value))
        if key == "selected_pair":
            if value == []:
                return True
            l1, h1, l2, h2 = value
            return 0 <= l1 < l2 < L and 0 <= h1 < H and 0 <= h2 < H
        hi = {"layer": L - 1, "head": H - 1, "position": len(self.ids) - 1, "token": V - 1}[key]
        return 0 <= value <= hi or (value == -1 and key in ("position", "token"))

    def apply(self, key, value):
        s = self.sel
        if key == "text":
            if value != self.text:
                self.text, self.ids = value, ids_of(value)
                s["position"] = -1
        elif key == "selected_pair":
            if value:
                s["layer"], s["head"] = value[2], value[3]
        elif key == "position":
            s["position"] = value
            if value >= 0:
                s["token"] = self.ids[value]
        elif key == "token":
            s["token"] = value
            if value < 0:
                s["position"] = -1
            elif s["position"] < 0 or self.ids[s["position"]] != value:
                s["position"] = max((i for i, t in enumerate(self.ids) if t == value), default=-1)
        else:
            s[key] = value


def play(ops):
    ex = pcw.CircuitExplorer(MODEL, TEXTS[0])
    oracle = Oracle(TEXTS[0])
    for op in ops:
        if op[0] == "wait":
            assert ex.wait()
            continue
        kind, target, key, value = op
        widget = ex if target == "explorer" else getattr(ex, target)
        ok = oracle.valid(key, value)
        if kind == "python":
            try:
                setattr(widget, key, value)
            except traitlets.TraitError:
                assert not ok, (op, "refused a valid value")
            else:
                assert ok, (op, "accepted an invalid value")
        else:
            widget.set_state({key: value})
            assert (widget.error == "") == ok, (op, widget.error)
        if ok:
            oracle.apply(key, value)
    assert ex.wait()
    return ex, oracle


def check(ex, oracle):
    s = oracle.sel
    assert {k: getattr(ex, k) for k in s} == s
    assert ex.text == oracle.text and ex.token_ids == oracle.ids
    assert (ex.attention.layer, ex.attention.head, ex.attention.position) == (s["layer"], s["head"], s["position"])
    assert ex.attention.tokens == [f"t{i}" for i in oracle.ids] and ex.loss.position == s["position"]
    assert (ex.trigrams.layer, ex.trigrams.head, ex.trigrams.token) == (s["layer"], s["head"], s["token"])
    for view in (ex.eigen, ex.composition):
        assert (view.layer, view.head) == (s["layer"], s["head"])
    # the kernel's results are for the last selection
    assert (ex.trigrams.trigrams["layer"], ex.trigrams.trigrams["head"]) == (s["layer"], s["head"])
    assert (ex.eigen.detail["layer"], ex.eigen.detail["head"]) == (s["layer"], s["head"])
    related = ex.trigrams.related
    if s["token"] < 0:
        assert related == {}
    else:
        assert (related["token"], related["layer"], related["head"]) == (s["token"], s["layer"], s["head"])
    assert not ex.busy and not any(v.busy for v in ex.views().values())


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Interleavings that must always be in the run (hypothesis adds random ones).
EXAMPLES = [
    [("browser", "loss", "position", 3), ("python", "trigrams", "token", -1)],  # no token, no position
    [("browser", "loss", "position", 1), ("python", "explorer", "token", 1)],  # a token's last position
    [("browser", "trigrams", "token", 2), ("wait",), ("browser", "explorer", "token", 3)],
    [("python", "explorer", "head", 2), ("browser", "trigrams", "token", 7), ("browser", "attention", "layer", 1)],
    [("browser", "trigrams", "token", 2), ("browser", "attention", "text", "t2 t2 t2 t4 t2"), ("python", "explorer", "position", 1)],
    [("browser", "composition", "selected_pair", [0, 1, 1, 2]), ("browser", "eigen", "head", 0), ("wait",),
     ("browser", "explorer", "text", ""), ("python", "explorer", "token", 30)],
]


def examples(test):
    for ops in EXAMPLES:
        test = example(ops)(test)
    return test


@SETTINGS
@examples
@given(st.lists(operations(), min_size=1, max_size=12))
def test_every_view_ends_on_the_last_selection_as_a_script(ops):
    check(*play(ops))


@SETTINGS
@examples
@given(st.lists(operations(), min_size=1, max_size=12))
def test_every_view_ends_on_the_last_selection_under_a_kernel(ops):
    with mock.patch.object(runner, "_kernel_loop", lambda: ManualLoop()):
        check(*play(ops))


@pytest.mark.parametrize("value", [True, False])
def test_bools_are_not_selection_ints(value):
    ex = pcw.CircuitExplorer(MODEL, TEXTS[0])
    ex.set_state({"head": value})
    assert "head must be an int" in ex.error and ex.head == 0
