"""Precomputed answers of kernel-less pages (widgets/offline.py): each answer is what the
widget itself computes when the selection moves there, within the page's budget."""

import base64
import json

import numpy as np

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.offline import NEEDS_KERNEL, Budget, key, offline_answers
from random_models import paper_model


def decode(answer: dict, path: list) -> np.ndarray:
    """A binary array of an answer, given the path of its payload (a dict with view/dtype/shape)."""
    payload = answer["state"]
    for k in path:
        payload = payload[k]
    buffer = base64.b64decode(answer["buffers"][answer["buffer_paths"].index([*path, "view"])])
    return np.frombuffer(buffer, dtype=payload["dtype"]).reshape(payload["shape"])


def test_each_heads_answer_is_what_the_widget_computes_for_that_head():
    model = paper_model(n_layers=2, n_heads=3)
    table = pcw.SkipTrigramTable(model, k=40)
    answers = offline_answers(table, Budget())
    (rule,) = answers["answers"]
    assert rule["on"] == ["layer", "head"] and len(rule["patches"]) == 6
    assert answers["kernel"] == {"query": NEEDS_KERNEL["query"], "token": NEEDS_KERNEL["token"]}
    for layer, head in [(1, 2), (0, 1)]:
        table.layer, table.head = layer, head  # the kernel's own recompute, as oracle
        assert table.wait()
        answer = rule["patches"][key(layer, head)]
        assert (answer["state"]["trigrams"]["layer"], answer["state"]["trigrams"]["head"]) == (layer, head)
        for column in ("src", "dest", "out", "score"):
            np.testing.assert_array_equal(decode(answer, ["trigrams", column]),
                                          np.frombuffer(bytes(table.trigrams[column]["view"]),
                                                        dtype=table.trigrams[column]["dtype"]))
        assert answer["state"]["error"] == "" and answer["state"]["related"] == {}
    assert key(1, 2) == json.dumps(1) + "," + json.dumps(2)  # the page's host builds the same key


def test_answers_stop_at_the_budget_and_say_the_rest_needs_a_kernel():
    model = paper_model(n_layers=2, n_heads=3)
    eigen = pcw.EigenvaluePlot(model, scores={}, layer=1, head=1)
    full = offline_answers(eigen, Budget())["answers"][0]
    one = len(json.dumps(full["patches"][key(1, 1)]))
    small = offline_answers(eigen, Budget(2 * one + one // 2))["answers"][0]
    assert list(small["patches"]) == [key(1, 1), key(0, 0)]  # the selected head first
    assert "over its" in small["missing"] and "needs a running kernel" in small["missing"]
    assert offline_answers(pcw.ColoredTokens(["a"], [1.0]), Budget()) is None
