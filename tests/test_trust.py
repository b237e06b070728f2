"""Issue 27, Python side: what a shared page is written from cannot destroy a notebook, wedge a
view, or make a view undisplayable, and browser writes are checked as Python writes are."""

import pytest

import pycircuits_widgets as pcw
from pycircuits_widgets.widgets import standalone


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
