"""Array traits (widgets/core/arrays.py): Python holds numpy arrays of the wire dtype; the
serializer writes the binary payload ipywidgets sends as buffers, and reads it back. Payloads
are checked here with numpy and zlib from the format's description, not with payload.py."""

import zlib

import numpy as np
import pytest
import torch
import traitlets
from ipywidgets.widgets.widget import _remove_buffers

from pycircuits_widgets.widgets import CircuitWidget
from pycircuits_widgets.widgets.core import offline
from pycircuits_widgets.widgets.core.arrays import Array, ArrayDict, Patterns


class Holder(CircuitWidget):
    _view = traitlets.Unicode("Holder").tag(sync=True)
    grid = Array("float32", ndim=2).tag(sync=True)
    half = Array("float16", compress=True).tag(sync=True)
    ids = Array(None).tag(sync=True)
    tables = ArrayDict("float32").tag(sync=True)


def read(payload: dict) -> np.ndarray:
    data = bytes(payload["view"])
    if payload.get("encoding") == "deflate":
        data = zlib.decompress(data, -15)
    return np.frombuffer(data, payload["dtype"]).reshape(payload["shape"])


def test_a_tensor_is_held_as_a_numpy_array_of_the_wire_dtype_and_sent_as_one_buffer():
    w = Holder(grid=torch.arange(6, dtype=torch.float64).view(2, 3))
    assert isinstance(w.grid, np.ndarray) and w.grid.dtype == np.float32 and w.grid.shape == (2, 3)
    state, paths, buffers = _remove_buffers(w.get_state(["grid", "half"]))
    assert paths == [["grid", "view"]] and state["half"] == {}  # None: the empty payload of today's traits
    assert state["grid"]["dtype"] == "float32" and state["grid"]["shape"] == [2, 3]
    np.testing.assert_array_equal(read({**state["grid"], "view": buffers[0]}), np.arange(6).reshape(2, 3))


def test_float16_is_a_request_and_compress_deflates_on_the_wire():
    w = Holder(half=np.array([1.5, -2.25, 0.1], np.float32))
    assert w.half.dtype == np.float16
    payload = w.get_state(["half"])["half"]
    assert payload["encoding"] == "deflate" and payload["dtype"] == "float16"
    np.testing.assert_array_equal(read(payload), np.array([1.5, -2.25, 0.1], np.float16))
    w.half = np.array([1.0, 70000.0], np.float32)  # past float16's range: float32, exact
    assert w.half.dtype == np.float32 and read(w.get_state(["half"])["half"]).tolist() == [1.0, 70000.0]


def test_dtype_none_keeps_the_dtype_narrowing_64_bits_and_refuses_what_does_not_fit():
    w = Holder(ids=np.array([3, 65535], np.uint16))
    assert w.ids.dtype == np.uint16
    w.ids = torch.tensor([1, 2, 3])  # int64
    assert w.ids.dtype == np.int32 and w.ids.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="do not fit int32"):
        w.ids = np.array([2**40])
    assert w.ids.tolist() == [1, 2, 3]


def test_bad_values_are_refused_naming_the_trait():
    w = Holder()
    with pytest.raises(traitlets.TraitError, match="grid must have 2 dimensions, got shape \\[3\\]"):
        w.grid = np.zeros(3)
    with pytest.raises(TypeError, match="grid must be an array of numbers"):
        w.grid = [["a", "b"]]
    assert w.grid is None


def test_an_array_dict_sends_each_leaf_as_its_own_payload_and_reads_them_back():
    w = Holder(tables={"K": {"correct": torch.ones(2, 2, dtype=torch.float64), "note": "raw"}, "Q": {}})
    leaf = w.tables["K"]["correct"]
    assert leaf.dtype == np.float32 and w.tables["K"]["note"] == "raw" and w.tables["Q"] == {}
    wire = w.get_state(["tables"])["tables"]
    state, paths, _ = _remove_buffers({"tables": wire})
    assert paths == [["tables", "K", "correct", "view"]] and state["tables"]["K"]["note"] == "raw"
    np.testing.assert_array_equal(read(wire["K"]["correct"]), np.ones((2, 2)))
    back = Holder.tables.metadata["from_json"](wire, None)
    np.testing.assert_array_equal(back["K"]["correct"], np.ones((2, 2)))
    assert back["K"]["note"] == "raw" and back["Q"] == {}
    assert Holder.grid.metadata["from_json"](w.get_state(["grid"])["grid"], None) is None


def test_array_leaves_in_lists_are_cast_sent_and_read_back_too():
    w = Holder(tables={"tables": [{"term": "in", "values": torch.arange(3, dtype=torch.float64)}, {"term": "out"}]})
    leaf = w.tables["tables"][0]["values"]
    assert isinstance(leaf, np.ndarray) and leaf.dtype == np.float32
    wire = w.get_state(["tables"])["tables"]
    _, paths, _ = _remove_buffers({"tables": wire})
    assert paths == [["tables", "tables", 0, "values", "view"]]
    np.testing.assert_array_equal(read(wire["tables"][0]["values"]), [0, 1, 2])
    back = Holder.tables.metadata["from_json"](wire, None)
    np.testing.assert_array_equal(back["tables"][0]["values"], [0, 1, 2])
    assert back["tables"][1] == {"term": "out"}


def test_kernel_less_answers_cast_each_patch_by_the_views_own_trait():
    """An answer holds what setting the trait would: a float64 tensor on a float32 trait is
    packed from float32 values (float16 where they fit), not as float64."""
    w = Holder()
    answers = offline.Answers(widget=w)
    value = torch.tensor([[0.1, 2.0]], dtype=torch.float64)
    answers.rule(["layer"], iter([((0,), {"grid": value})]), missing="")
    state = offline.last(answers.steps())["_offline"]
    packed = offline.rules(state)[0]["patches"][offline.key(0)]["grid"]["packed"]
    offset, dtype, shape = packed
    assert dtype == "float16" and shape == [1, 2]
    got = np.frombuffer(bytes(state["data"]), dtype, 2, offset).reshape(shape)
    np.testing.assert_array_equal(got, value.numpy().astype(np.float32).astype(np.float16))


class Weights(CircuitWidget):
    _view = traitlets.Unicode("Weights").tag(sync=True)
    shown = Patterns(compress=True).tag(sync=True)


def test_patterns_are_held_quantised_and_a_causal_one_sent_as_its_lower_triangle():
    a = np.tril(np.random.default_rng(0).random((2, 4, 4), dtype=np.float32))
    w = Weights(shown={"weights": torch.from_numpy(a), "causal": True, "factor": 2})
    held = w.shown["weights"]
    assert held.dtype == np.uint8 and np.abs(held / 255 - a).max() <= 1 / 510 + 1e-7
    payload = w.get_state(["shown"])["shown"]
    assert (payload["layout"], payload["n"], payload["factor"], payload["shape"]) == ("causal", 4, 2, [2, 10])
    rows = read(payload)  # row dest holds a[dest, :dest + 1]
    np.testing.assert_array_equal(rows[:, 6:10], held[:, 3, :4])
    np.testing.assert_array_equal(rows[:, 1:3], held[:, 1, :2])
    back = Weights.shown.metadata["from_json"](payload, None)
    np.testing.assert_array_equal(back["weights"], held)
    assert back["causal"] and back["factor"] == 2
    assert Weights(shown={}).get_state(["shown"])["shown"] == {}
    with pytest.raises(traitlets.TraitError, match=r"shown\['weights'\] must be \[\.\.\., n, n\], got shape \[2, 3\]"):
        w.shown = {"weights": np.zeros((2, 3)), "causal": False}
