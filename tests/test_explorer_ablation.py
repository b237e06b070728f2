"""The explorer's causal checks: the ablate toggle of the selected head (its loss section's loss
change against ``pcw.ablate``, which runs apart from the widget path, and against a float64 forward
with the head's ``z`` zeroed, ``test_interventions.oracle``), toggling back (the clean payloads bit
for bit, nothing run again), the composition section's matrix measured on the text (against
``pcw.measured_composition``) and each head's ablation loss change.

Bit-equal checks only where the computation is the same by construction: the explorer's ablation
is ``pcw.ablate`` on the explorer's clean run, compared with ``pcw.ablate`` given that same run; the
clean payloads come back from the arrays kept, not recomputed.
"""

import numpy as np
import pytest
import torch
import traitlets

import pycircuits_widgets as pcw
from pycircuits_widgets.demo import SAMPLE_TEXT
from pycircuits_widgets.models.corpus import corpus_documents
from runner_loop import WAIT, Blocker, giving_way, manual_kernel_loop  # noqa: F401 (fixture)
from test_interventions import oracle, set_heads, token_loss
from tolerance import assert_within, logit_tol


@pytest.fixture(scope="module")
def model():
    return pcw.load_pretrained("attn-only-2l")


def payloads(explorer) -> dict:
    """What the loss and attention sections send of the run they show."""
    loss, attention = explorer.loss, explorer.attention
    out = {name: getattr(loss, name) for name in ("tokens", "label", "colormap", "vmin", "vmax", "note", "position")}
    out["values"] = loss.values.copy()
    out["overview"] = attention.overview["weights"].copy()
    out["full"] = dict(attention.full)
    out["detail"] = dict(attention._detail)
    out["run_label"] = (attention.run_label, explorer.induction.run_label, explorer.causal.ablated)
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == b[key].dtype and np.array_equal(value, b[key]), key
        else:
            assert value == b[key], key


class Forwards:
    """Counts the model's forwards (``run_with_cache`` calls) and how many were resumed."""

    def __init__(self, model, monkeypatch):
        self.calls = []
        forward = model.run_with_cache

        def counted(tokens, interventions=None, resume=None, **kwargs):
            self.calls.append(resume is not None)
            return forward(tokens, interventions, resume, **kwargs)

        monkeypatch.setattr(model, "run_with_cache", counted)


def test_the_ablated_loss_change_is_pcw_ablates_and_toggling_back_restores_the_clean_run(model, monkeypatch):
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT, layer=1, head=6, position=7)
    clean = payloads(explorer)
    run = explorer.forward(model, explorer.text)
    forwards = Forwards(model, monkeypatch)

    explorer.causal.ablation = "zero"
    assert forwards.calls == [True]  # one forward, resumed from the clean run at layer 1
    oracle_run = pcw.ablate(model, run.tokens, heads=[(1, 6)], kind="zero", clean=run)
    change = (oracle_run.loss - oracle_run.clean_loss)[0]
    assert np.array_equal(explorer.loss.values, change.numpy().astype(np.float32))
    assert explorer.causal.ablated == explorer.attention.run_label == explorer.induction.run_label == "ablated: L1.H6 (zero)"
    m = float(change.abs().max())
    assert (explorer.loss.colormap, explorer.loss.vmin, explorer.loss.vmax) == ("diverging", -m, m)
    assert "symmetric" in explorer.loss.note
    assert np.array_equal(explorer.attention._patterns, oracle_run.cache.patterns[0].numpy())
    assert explorer.loss.position == explorer.position == 7  # the selection stays

    forwards.calls.clear()
    explorer.causal.ablation = "off"
    assert forwards.calls == []  # nothing run again
    assert_same(payloads(explorer), clean)


def test_another_head_or_text_while_ablated_ablates_that(model, monkeypatch):
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT, layer=1, head=6)
    explorer.causal.ablation = "zero"
    explorer.head = 2
    run = explorer.forward(model, explorer.text)
    ref = pcw.ablate(model, run.tokens, heads=[(1, 2)], clean=run)
    assert explorer.causal.ablated == "ablated: L1.H2 (zero)"
    assert np.array_equal(explorer.loss.values, (ref.loss - ref.clean_loss)[0].numpy().astype(np.float32))
    explorer.text = "def f(x):\n    return x + 1\n"
    run = explorer.forward(model, explorer.text)
    ref = pcw.ablate(model, run.tokens, heads=[(1, 2)], clean=run)
    assert explorer.loss.tokens == explorer.tokens[1:]
    assert np.array_equal(explorer.loss.values, (ref.loss - ref.clean_loss)[0].numpy().astype(np.float32))
    assert explorer.attention.run_label == "ablated: L1.H2 (zero)"


def test_in_float64_the_ablated_loss_is_a_forward_with_the_heads_z_zeroed(model):
    model64 = model.to(torch.float64)
    tokens = model64.to_tokens(SAMPLE_TEXT)[None, :40]
    explorer = pcw.CircuitExplorer(model64, tokens, layer=0, head=4, ablation="zero")
    clean, ablated = oracle(model64, tokens), oracle(model64, tokens, z=set_heads({0: [4]}))
    expected = (token_loss(ablated["logits"], tokens) - token_loss(clean["logits"], tokens))[0]
    run = explorer.forward(model64, explorer.text)
    # each loss within twice logit_tol (a log-softmax moves by at most twice its inputs' largest change),
    # a difference of two: four; then one float32 rounding of the value sent
    tol = 4 * logit_tol(model64, run.cache, tokens.shape[1], torch.float64)
    assert_within(torch.as_tensor(explorer.loss.values, dtype=torch.float64), expected,
                  tol + float(expected.abs().max()) * 2.0 ** -24)


def test_mean_ablation_without_a_sweep_is_refused_by_name(model):
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT)
    assert "needs a sweep" in explorer.causal.ablation_kinds["mean"]
    with pytest.raises(traitlets.TraitError, match="mean ablation needs a sweep"):
        explorer.causal.ablation = "mean"
    assert explorer.causal.ablation == "off"


def test_mean_ablation_reads_the_explorers_sweep(model, tmp_path):
    sweep = pcw.sweep(model, pcw.Corpus.from_texts(corpus_documents("pydoc")[:4]), tmp_path, seq_len=32,
                      max_windows=8, progress=False)
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT, sweep=sweep, layer=1, head=6, ablation="mean")
    assert explorer.causal.ablation_kinds == {"zero": "", "mean": ""}
    run = explorer.forward(model, explorer.text)
    ref = pcw.ablate(model, run.tokens, heads=[(1, 6)], kind="mean", means=sweep, clean=run)
    assert np.array_equal(explorer.loss.values, (ref.loss - ref.clean_loss)[0].numpy().astype(np.float32))
    assert explorer.causal.ablated == "ablated: L1.H6 (mean)"


@pytest.mark.parametrize("via", ["Q", "K", "V"])
def test_the_measured_matrix_is_pcw_measured_composition_of_the_text(model, via):
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT)
    composition = explorer.composition
    composition.kind = via
    composition.source = "measured"
    run = explorer.forward(model, explorer.text)
    expected = pcw.measured_composition(model, run.tokens, via, clean=run).float()
    torch.testing.assert_close(torch.as_tensor(composition.measured[via]), expected, rtol=0, atol=0, equal_nan=True)
    assert composition.progress == {}
    assert "measured on this text" in composition.measured_note
    explorer.text = "x = 1\ny = x\n"  # a new text: its matrix, not the old one's
    assert via not in composition.measured or composition.measured[via] is not None
    run = explorer.forward(model, explorer.text)
    expected = pcw.measured_composition(model, run.tokens, via, clean=run).float()
    torch.testing.assert_close(torch.as_tensor(composition.measured[via]), expected, rtol=0, atol=0, equal_nan=True)


def test_a_composition_matrix_without_a_text_refuses_the_measured_source(model):
    view = pcw.CompositionMatrix(model)
    with pytest.raises(ValueError, match="needs a text to measure on"):
        view.source = "measured"
    assert view.source == "weights" and "needs a text" in view.error


def test_each_heads_ablation_loss_change(model):
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT)
    assert explorer.causal.head_loss_change is None  # a script computes nothing in the background
    explorer.causal.compute_head_loss_change()
    run = explorer.forward(model, explorer.text)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    expected = np.array([[pcw.ablate(model, run.tokens, heads=[(l, h)], clean=run).loss_change for h in range(H)]
                         for l in range(L)], dtype=np.float32)
    assert np.array_equal(explorer.causal.head_loss_change, expected)
    assert explorer.progress == {}
    explorer.text = "x = 1\n"
    assert explorer.causal.head_loss_change is None  # of the old text: dropped


def test_under_a_kernel_the_toggle_the_measured_matrix_and_the_head_table_run_off_the_kernel_thread(
        model, manual_kernel_loop):
    explorer = pcw.CircuitExplorer(model, SAMPLE_TEXT, layer=1, head=6)
    assert explorer.wait(WAIT) and explorer.wait_background(WAIT)  # the precompute, then each head's ablation
    run = explorer.forward(model, explorer.text)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    expected = np.array([[pcw.ablate(model, run.tokens, heads=[(l, h)], clean=run).loss_change for h in range(H)]
                         for l in range(L)], dtype=np.float32)
    assert np.array_equal(explorer.causal.head_loss_change, expected) and explorer.progress == {}

    explorer.causal.ablation = "zero"
    assert explorer.causal.ablated == ""  # computed on the explorer's runner, applied by wait()
    assert explorer.wait(WAIT)
    assert explorer.causal.ablated == explorer.attention.run_label == "ablated: L1.H6 (zero)"
    ref = pcw.ablate(model, run.tokens, heads=[(1, 6)], clean=run)
    assert np.array_equal(explorer.loss.values, (ref.loss - ref.clean_loss)[0].numpy().astype(np.float32))

    composition = explorer.composition
    held = Blocker(explorer.eigen._runner)  # another view busy with a click's request
    composition.source = "measured"
    assert giving_way(composition._runner)  # the background measurement waits for it
    assert composition.measured == {}
    held.release.set()
    assert composition.wait(WAIT)
    expected = pcw.measured_composition(model, run.tokens, "K", clean=run).float()
    torch.testing.assert_close(torch.as_tensor(composition.measured["K"]), expected, rtol=0, atol=0, equal_nan=True)
    assert composition.progress == {}
    explorer.close()
