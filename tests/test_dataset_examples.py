"""Dataset examples (``pcw.DatasetExamples``, the explorer's "examples" section) on a real sweep of the
shipped 2-layer model over 64 windows of 64 tokens of the Python stdlib corpus (k = 8).

Oracles, written here independently of the view: each row's tokens are the sweep's window tokens
around the destination; the attention shown is the window re-run alone through ``run_with_cache``
(float32, compared within ``pattern_tol``); a neuron's activations are the window's ``mlp_post``
recomputed the same way; a window's document is counted from the end-of-text separators of the
windows before it."""

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.corpus import Corpus
from pycircuits_widgets.models import load_pretrained
from random_models import custom_model

T, N, K = 64, 64, 8


@pytest.fixture(scope="module")
def model():
    return load_pretrained("attn-only-2l")


@pytest.fixture(scope="module")
def swept(model, tmp_path_factory):
    return pcw.sweep(model, Corpus.python_stdlib(), tmp_path_factory.mktemp("sweep") / "store", seq_len=T, k=K,
                     max_windows=N, progress=False)


@pytest.fixture(scope="module")
def other_model(model):
    """Random weights of another shape, the shipped tokenizer."""
    m = custom_model(dtype=torch.float32, n_layers=1, n_heads=2, d_model=32, d_head=16,
                     d_vocab=model.cfg.d_vocab, n_ctx=T, seed=5)
    m.tokenizer = model.tokenizer
    return m


def test_the_explorer_takes_a_sweep_of_its_model_and_refuses_another_models_by_name(model, swept, other_model):
    explorer = pcw.CircuitExplorer(model, "def f(x):\n    return x", sweep=swept)
    try:
        assert explorer.sweep is swept
    finally:
        explorer.close()
    with pytest.raises(ValueError, match="made with model 'attn-only-2l', not with this model"):
        pcw.CircuitExplorer(other_model, "def f(x):", sweep=swept)
    with pytest.raises(TypeError, match="sweep must be a pcw.Sweep"):
        pcw.CircuitExplorer(model, "def f(x):", sweep=str(swept.path))
