"""What the views do for large and rotary models: tables computed on first use, the OV side
of the eigenvalue plot under rotary positions, the explorer's notices and header name.

Oracles: the analysis functions (``composition_scores``, ``eigenvalue_positivity``,
``head_scores``) called directly on the same weights; the refusal of ``eigenvalues(m, "QK")``.

Tolerance (``COPY``): a view shows the analysis's own results (the same functions on the same weights,
kept per model) as float32 arrays: at most one rounding of a copy on each side, never a recomputation
by another route (which would differ by more and fail here).
"""

import numpy as np
import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import composition_scores
from pycircuits_widgets.analysis.composition import random_baseline
from pycircuits_widgets.analysis.eigen import eigenvalue_positivity, eigenvalues
from pycircuits_widgets.analysis.head_scores import head_scores
from pycircuits_widgets.models.config import short_name
from pycircuits_widgets.widgets.views.registry import BY_NAME
from random_models import custom_model, paper_model
from runner_loop import manual_kernel_loop  # noqa: F401 (fixture)
from tolerance import COPY


@pytest.fixture(scope="module")
def m2():
    return paper_model(n_layers=2, n_heads=4, d_model=32, d_head=8, dtype=torch.float32)


@pytest.fixture(scope="module")
def rotary():
    """Rotary positions, MLPs, no positional weights: a LLaMA-like weight view."""
    return custom_model(n_layers=2, n_heads=3, positional="rotary", rotary_dim=6, attn_only=False, d_mlp=48, act_fn="silu",
                        dtype=torch.float32)


def test_lazy_composition_computes_only_the_shown_table_then_each_toggle_on_first_use(m2):
    w = pcw.CompositionMatrix(m2, lazy=True)
    assert w.wait(30) and not w.error
    assert {k: set(v) for k, v in w.scores.items()} == {"K": {"correct"}}
    assert set(w.baselines) == {"correct"}
    np.testing.assert_allclose(w.scores["K"]["correct"],
                               composition_scores(m2, "K", baseline=False).numpy(), equal_nan=True, **COPY)
    w.kind = "Q"
    assert w.wait(30)
    assert {k: set(v) for k, v in w.scores.items()} == {"K": {"correct"}, "Q": {"correct"}}
    w.show_erratum = True
    assert w.wait(30)
    assert set(w.scores["Q"]) == {"correct", "erratum"} and "erratum" not in w.scores["K"]
    np.testing.assert_allclose(w.scores["Q"]["erratum"],
                               composition_scores(m2, "Q", baseline=False, norm="erratum_left").numpy(),
                               equal_nan=True, **COPY)
    assert w.baselines == {"correct": random_baseline(31, 8), "erratum": random_baseline(31, 8, "erratum_left")}  # layer norm: 31 dims
    w.compute_all()
    assert all(set(w.scores[k]) == {"correct", "erratum"} for k in "QKV")


def test_lazy_composition_with_a_selected_pair_gets_table_and_detail(m2):
    w = pcw.CompositionMatrix(m2, lazy=True, kind="V", selected_pair=[0, 1, 1, 2])
    assert w.wait(30) and not w.error
    assert set(w.scores) == {"V"} and w.detail["kind"] == "V" and w.detail["h1"] == [0, 1]


def test_rotary_eigenvalue_plot_reads_qk_at_each_heads_strongest_offset(rotary):
    w = pcw.EigenvaluePlot(rotary, layer=1, head=2, offsets=range(0, 6))
    np.testing.assert_allclose(w.ov_positivity, eigenvalue_positivity(rotary, "OV").numpy(), **COPY)
    by_offset = torch.stack([eigenvalue_positivity(rotary, "QK", offset=o) for o in range(6)])
    np.testing.assert_allclose(w.qk_positivity, by_offset.amax(0).numpy(), **COPY)
    assert "at the strongest of query - key offsets 0..5" in w.offset_note
    d = w.detail
    best = int(by_offset[:, 1, 2].argmax())
    assert (d["layer"], d["head"]) == (1, 2) and d["qk_offset"] == best and len(d["copies"]) == 12
    spectrum = eigenvalues(rotary, "QK", offset=best)[1, 2]
    np.testing.assert_allclose(np.sort(d["qk_re"]), np.sort(spectrum.real.numpy()), **COPY)


def test_head_scores_of_a_large_model_are_computed_when_colouring_asks(m2, monkeypatch):
    monkeypatch.setattr(pcw.EigenvaluePlot, "EAGER_HEADS", 4)
    w = pcw.EigenvaluePlot(m2)
    ref = head_scores(m2)
    assert w.scores == {name: {} for name in ref}
    w.color_by = "induction"
    assert w.wait(30) and not w.error
    for name, value in ref.items():
        np.testing.assert_allclose(w.scores[name], value.numpy(), equal_nan=True, **COPY)


def test_explorer_on_a_rotary_mlp_model_shows_every_section(rotary):
    e = pcw.CircuitExplorer(rotary, "t1 t2 t3 t1 t2")
    # every section but those that read a corpus sweep or a task (none given)
    assert set(e.views()) == {n for n, spec in BY_NAME.items() if not (spec.needs_sweep or spec.needs_task)}
    assert not e.notices
    assert "offsets 0..4" in e.eigen.offset_note and "offsets 0..4" in e.trigrams.offset_note


@pytest.mark.parametrize("name, short", [
    ("/home/me/models/SmolLM-135M/", "SmolLM-135M"), ("HuggingFaceTB/SmolLM-135M", "SmolLM-135M"),
    ("C:\\models\\gpt2", "gpt2"), ("attn-only-2l", "attn-only-2l"), ("", ""),
])
def test_header_name_is_the_last_part_of_a_path(name, short):
    assert short_name(name) == short


def test_notes_name_what_each_view_ignores(m2, rotary):
    # the first layer's norm reads the embedding alone: its per-token scale is applied
    # (analysis.circuits.embedding); the division elsewhere depends on the context
    later = "the {}'s division where it depends on the context (the unembedding and layers after the first)"
    table = pcw.SkipTrigramTable(m2, k=5)
    assert table.ignores == ["composition with other heads", later.format("layer norm")]
    norm = "RMS norm" if rotary.cfg.normalization == "rmsnorm" else "layer norm"
    plot = pcw.EigenvaluePlot(rotary, scores={})
    assert plot.ignores == ["composition with other heads", "MLPs", later.format(norm)]
    comp = pcw.CompositionMatrix(rotary, kind="V")
    assert comp.ignores == ["MLPs", later.format(norm)]  # composition is what it shows
    attn_only_1l = paper_model(n_layers=1, dtype=torch.float32)
    assert pcw.SkipTrigramTable(attn_only_1l, k=5).ignores == [
        "the layer norm's division where it depends on the context (the unembedding)"]
    learned = pcw.SkipTrigramTable(custom_model(n_layers=1, positional="learned", dtype=torch.float32), k=5)
    assert learned.ignores == ["the layer norm's per-token scale"]


def test_explorer_displays_while_its_views_still_compute(monkeypatch, manual_kernel_loop):
    """Under a kernel a notebook displays the explorer as soon as it is built, before the runners'
    results are applied: its static fallback (part of every display) names the views still
    computing instead of failing, then draws them once they are in."""
    from pycircuits_widgets.widgets.views.composition_matrix import CompositionMatrix
    from pycircuits_widgets.widgets.views.eigenvalue_plot import EigenvaluePlot
    monkeypatch.setattr(EigenvaluePlot, "EAGER_HEADS", 4)
    monkeypatch.setattr(CompositionMatrix, "EAGER_HEADS", 4)
    ex = pcw.CircuitExplorer(paper_model(n_layers=2, n_heads=4, d_model=32, d_head=8, dtype=torch.float32), "t1 t2 t3 t1 t2")
    assert ex.eigen.ov_positivity is None and ex.composition.scores == {}
    page = ex._fallback_html()
    assert "Eigenvalue positivity: not computed yet" in page and "K-composition scores: not computed yet" in page
    assert ex.wait(30)
    page = ex._fallback_html()
    assert "not computed yet" not in page and 'data-pcw-figure="eigen-positivity"' in page


@pytest.mark.parametrize("mode", ["script", "kernel"])
def test_many_heads_eigenvalues_fill_in_from_the_runner_and_equal_the_analysis(monkeypatch, request, mode):
    """Over EAGER_HEADS heads the scatter's spectra (two vocab-sized products) are not part of the
    build under a kernel: the traits are None when the constructor returns, the runner fills them,
    and they equal eigenvalue_positivity on the same weights; a script computes them at once."""
    from pycircuits_widgets.widgets.views.eigenvalue_plot import EigenvaluePlot
    if mode == "kernel":
        request.getfixturevalue("manual_kernel_loop")
    monkeypatch.setattr(EigenvaluePlot, "EAGER_HEADS", 4)
    model = paper_model(n_layers=2, n_heads=4, d_model=32, d_head=8, dtype=torch.float32)
    w = pcw.EigenvaluePlot(model, layer=1, head=2)
    if mode == "kernel":
        assert w.ov_positivity is None and w.qk_positivity is None and w.busy
    assert w.wait(30) and not w.error and not w.busy
    for kind, trait in (("OV", w.ov_positivity), ("QK", w.qk_positivity)):
        np.testing.assert_allclose(trait, eigenvalue_positivity(model, kind).numpy(), **COPY)
    assert (w.detail["layer"], w.detail["head"]) == (1, 2) and w.detail["copies"]
    rotary = custom_model(n_layers=2, n_heads=3, positional="rotary", rotary_dim=6, dtype=torch.float32)
    r = pcw.EigenvaluePlot(rotary)
    assert r.wait(30) and r.qk_positivity is not None and "query - key offsets" in r.offset_note
    np.testing.assert_allclose(r.ov_positivity, eigenvalue_positivity(rotary, "OV").numpy(), **COPY)
