"""Issue 27, Python side: what a shared page is written from cannot destroy a notebook, wedge a
view, or make a view undisplayable, and browser writes are checked as Python writes are."""

import json
import re

import pytest
import torch
import traitlets

import pycircuits_widgets as pcw
from pycircuits_widgets.__main__ import main as cli_main
from pycircuits_widgets.models.tokenizer import escape_invisible
from pycircuits_widgets.widgets.core.payload import encode_json
from pycircuits_widgets.widgets.sharing import standalone
from pycircuits_widgets.widgets.sharing.notebook_export import WIDGET_STATE, WIDGET_VIEW
from random_models import paper_model
from runner_loop import manual_kernel_loop  # noqa: F401 (fixture)


def test_save_html_refuses_to_replace_a_notebook(tmp_path):
    w = pcw.ColoredTokens(["a", " b"], [1.0, 2.0])
    for name in ["analysis.ipynb", "Analysis.IPYNB"]:
        notebook = tmp_path / name
        notebook.write_text('{"cells": [], "nbformat": 4}', encoding="utf-8")
        with pytest.raises(ValueError, match=f"refusing to write the HTML page to .*{name}: it would replace a notebook"):
            w.save_html(notebook)
        with pytest.raises(ValueError, match="it would replace a notebook"):
            standalone.save_html([w], notebook)
        assert notebook.read_text(encoding="utf-8") == '{"cells": [], "nbformat": 4}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Analysis.IPYNB", "analysis.ipynb"]


# -- #5: a KeyboardInterrupt/SystemExit inside a recompute ------------------------------------
@pytest.fixture(scope="module")
def m1():
    return paper_model(n_layers=1, n_heads=2, dtype=torch.float32)


def interrupted(exc):
    def make():
        yield None
        raise exc
    return make


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)], ids=["KeyboardInterrupt", "SystemExit"])
def test_an_interrupted_recompute_on_the_worker_is_reported_and_the_view_keeps_working(m1, manual_kernel_loop, exc):
    st = pcw.SkipTrigramTable(m1, k=5)
    assert st.wait(30)
    before = st.trigrams
    st._runner.submit("table", interrupted(exc))
    assert st.wait(30)  # the runner's completion signal: the worker did not die with the job
    assert not st.busy and st.trigrams is before
    assert st.error == f"table: {type(exc).__name__}" + (": 3" if isinstance(exc, SystemExit) else "")
    st.head = 1  # later requests are served, and the next table clears the report
    assert st.wait(30) and not st.busy
    assert (st.trigrams["layer"], st.trigrams["head"]) == (0, 1) and st.error == ""


def test_an_interrupted_recompute_in_a_script_stops_the_script_and_leaves_the_view_usable(m1):
    st = pcw.SkipTrigramTable(m1, k=5)
    with pytest.raises(KeyboardInterrupt):
        st._runner.submit("table", interrupted(KeyboardInterrupt()))
    assert st.error == "table: KeyboardInterrupt" and not st.busy
    st.head = 1
    assert (st.trigrams["layer"], st.trigrams["head"]) == (0, 1) and st.error == ""


# -- #9: browser writes checked as Python writes are -----------------------------------------
@pytest.mark.parametrize("name, bad, message", [
    ("page", True, "page must be an int, got True"),
    ("page", -2, r"page must be in 0..9999, got -2"),
    ("page", 10**100, r"page must be in 0..9999, got 1000000000"),
    ("page_size", True, "page_size must be an int, got True"),
    ("page_size", -2, r"page_size must be in 1..10000, got -2"),
    ("page_size", 0, r"page_size must be in 1..10000, got 0"),
    ("page_size", 10**100, r"page_size must be in 1..10000, got 1000000000"),
    ("query", "x" * 200_000, "query must be at most 100000 characters, got 200000"),
    ("query", "ab\ud800", "query must be valid Unicode: surrogates not allowed at character 2"),
])
def test_skip_trigram_browser_writes_are_refused_like_python_writes(m1, name, bad, message):
    st = pcw.SkipTrigramTable(m1, k=5)
    before = getattr(st, name)
    with pytest.raises(traitlets.TraitError, match=message):
        setattr(st, name, bad)
    st.set_state({name: bad})  # what the browser sends
    assert getattr(st, name) == before and re.search(message, st.error)
    st.set_state({name: {"page": 1, "page_size": 5, "query": "t3"}[name]})
    assert st.error == "" and getattr(st, name) == {"page": 1, "page_size": 5, "query": "t3"}[name]


def test_the_browser_turning_off_an_on_demand_view_cancels_it(m1):
    """``active`` False from the browser is the view's "cancel" button: the view stops, keeps what
    it computed and says "cancelled"; True again (its "restart" button) computes again."""
    m = paper_model(n_layers=2, n_heads=2, dtype=torch.float32)
    v = pcw.VirtualHeads(m, k=3, n_copies=2)
    assert v.active and v.wait(30) and v.heads
    v.set_state({"active": False})
    assert v.active is False and v.error == "" and v.progress["state"] == "cancelled" and v.heads
    v.set_state({"active": True})
    assert v.active and v.wait(30) and v.heads and v.error == "" and v.progress == {}
    idle = pcw.VirtualHeads(m, k=3, n_copies=2, active=False)  # not started: the browser may start it
    idle.set_state({"active": True})
    assert idle.active and idle.wait(30) and idle.heads and idle.error == ""
    v.set_state({"busy": True})  # still a kernel-only trait
    assert "busy cannot be set from the browser" in v.error


# -- #6, #7: text made displayable, invisible and bidi characters shown as escapes -----------
HOSTILE = {"lone": "lo\ud800ne", "rlo": "\u202e", "zwsp": "a\u200bb", "bom": "\ufeff", "filler": "\u3164",
           "nul": "x\x00", "astral": "\U000e0041", "separators": "\u00a0x\u2028", "replacement": "\ufffd"}
SHOWN = {"lone": "lo\\ud800ne", "rlo": "\\u202e", "zwsp": "a\\u200bb", "bom": "\\ufeff", "filler": "\\u3164",
         "nul": "x\\u0000", "astral": "\\U000e0041",
         "separators": "\\u00a0x\\u2028", "replacement": "\\ufffd"}  # as js/test/tokens.test.js


def test_escape_invisible_shows_each_character_that_draws_nothing_or_reorders():
    for name, text in HOSTILE.items():
        assert escape_invisible(text) == SHOWN[name], name
        assert escape_invisible(SHOWN[name]) == SHOWN[name]  # display strings stay as they are
    for text in ["plain", " spaced\n\t\r", "日本語", "naïve", "∑x²", "🙂", "<b>&amp;"]:
        assert escape_invisible(text) == text


def test_colored_tokens_with_a_lone_surrogate_displays_and_its_picture_shows_escapes():
    w = pcw.ColoredTokens(["ok", "lo\ud800ne", "\u202e", "a\u200bb", " sat"], [1.0, 2.0, 3.0, 4.0, 5.0])
    data, _ = w._repr_mimebundle_()  # raised UnicodeEncodeError
    data["text/html"].encode("utf-8")
    shown = re.findall(r'<span title="[^"]*" style="[^"]*">([^<]*)</span>', data["text/html"])
    assert shown == ["ok", "lo\\ud800ne", "\\u202e", "a\\u200bb", "·sat"]
    assert "\u202e" not in data["text/html"] and "\u200b" not in data["text/html"]


class HostileTokenizer:
    """Token ``i`` displays as ``"t{i}"``, except a few hostile strings a tokenizer may hold."""

    def encode(self, text):
        return [int(t[1:]) for t in text.split()]

    def display_token(self, token_id):
        hostile = list(HOSTILE.values())
        return hostile[token_id] if token_id < len(hostile) else f"t{token_id}"


def test_skip_trigram_table_of_a_hostile_tokenizer_saves_a_page(tmp_path):
    from pycircuits_widgets.models import AttnOnlyTransformer, attn_only_config, from_attn_only

    cfg = attn_only_config(1, n_heads=2, d_model=16, d_head=4, d_vocab=len(HOSTILE) + 3, n_ctx=8)
    model = from_attn_only(AttnOnlyTransformer(cfg, seed=1), HostileTokenizer()).to(torch.float32)
    assert model.token_strings[: len(HOSTILE)] == list(SHOWN.values())
    st = pcw.SkipTrigramTable(model, k=20)
    page = st.save_html(tmp_path / "page.html").read_text(encoding="utf-8")  # raised from encode_json
    assert "pcw-state" in page and "\u202e" not in page
    assert set(st.trigrams["strings"].values()) <= set(model.token_strings)
    st.search("\\u202e")
    assert st.matches[0]["str"] == "\\u202e"


def test_encode_json_names_a_lone_surrogate_instead_of_a_raw_unicode_error():
    with pytest.raises(ValueError, match=r"cannot encode '\\ud800' \(not valid Unicode: a lone surrogate\)"):
        encode_json({"strings": ["ok", "lo\ud800ne"]})


# -- #8: every malformed notebook is a one-line error, exit 2 ---------------------------------
def _good_notebook() -> dict:
    w = pcw.ColoredTokens(["a", " b"], [1.0, 2.0])
    data, _ = w._repr_mimebundle_()
    state = standalone.widget_state([w])
    ours = next(k for k, m in state.items() if m.get("buffers"))
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"widgets": {WIDGET_STATE: {"state": state}}},
          "cells": [{"cell_type": "code", "id": "c1", "source": "w", "metadata": {}, "execution_count": 1,
                     "outputs": [{"output_type": "display_data", "metadata": {}, "data": data}]}]}
    return nb, ours


def _deep(n) -> str:
    """JSON text of objects nested ``n`` deep (Python's json cannot write it)."""
    return '{"a":' * n + "{}" + "}" * n


def _malform(nb, ours, shape):
    saved = nb["metadata"]["widgets"][WIDGET_STATE]["state"]
    if shape == "buffer without path":
        del saved[ours]["buffers"][0]["path"]
    elif shape == "buffer path a string":
        saved[ours]["buffers"][0]["path"] = "values"
    elif shape == "buffer data a number":
        saved[ours]["buffers"][0]["data"] = 5
    elif shape == "buffers a dict":
        saved[ours]["buffers"] = {"path": ["values", "view"]}
    elif shape == "model entry a string":
        saved[ours] = "IPY_MODEL_x"
    elif shape == "model state a list":
        saved[ours]["state"] = [1, 2]
    elif shape == "state a list":
        nb["metadata"]["widgets"][WIDGET_STATE]["state"] = list(saved.values())
    elif shape == "widget state a string":
        nb["metadata"]["widgets"][WIDGET_STATE] = "state"
    elif shape == "metadata.widgets a list":
        nb["metadata"]["widgets"] = [1]
    elif shape == "notebook a JSON array":
        return [nb]
    elif shape == "state 5000 deep":
        saved[ours]["state"]["deep"] = "DEEP-5000"
    elif shape == "outputs 300 deep":
        nb["cells"][0]["outputs"][0]["data"]["application/json"] = "DEEP-300"
    elif shape == "widget output without model_id":
        del nb["cells"][0]["outputs"][0]["data"][WIDGET_VIEW]["model_id"]
    elif shape == "cells a dict":
        nb["cells"] = {"0": nb["cells"][0]}
    elif shape == "a cell a string":
        nb["cells"] = ["w"]
    return nb


MALFORMED = ["buffer without path", "buffer path a string", "buffer data a number", "buffers a dict",
             "model entry a string", "model state a list", "state a list", "widget state a string",
             "metadata.widgets a list", "notebook a JSON array", "state 5000 deep", "outputs 300 deep",
             "widget output without model_id", "cells a dict", "a cell a string"]


@pytest.mark.parametrize("shape", MALFORMED)
def test_export_of_a_malformed_notebook_is_a_one_line_error_with_exit_2(tmp_path, capsys, shape):
    nb, ours = _good_notebook()
    src = tmp_path / "bad.ipynb"
    text = re.sub(r'"DEEP-(\d+)"', lambda m: _deep(int(m.group(1))), json.dumps(_malform(nb, ours, shape)))
    src.write_text(text, encoding="utf-8")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["export", str(src)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert str(src) in err
    assert not src.with_suffix(".html").exists()


def test_the_malformed_shapes_are_each_one_change_from_a_notebook_that_exports(tmp_path):
    nb, _ = _good_notebook()
    src = tmp_path / "good.ipynb"
    src.write_text(json.dumps(nb), encoding="utf-8")
    assert cli_main(["export", str(src)]) == 0 and "pcw-state" in src.with_suffix(".html").read_text(encoding="utf-8")
