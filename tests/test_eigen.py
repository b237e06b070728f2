"""Eigenvalue positivity against dense eigendecompositions and TransformerLens's FactoredMatrix."""

import pytest
import torch
from random_models import custom_model, paper_model
from transformer_lens.FactoredMatrix import FactoredMatrix as TLFactoredMatrix

from pycircuits_widgets.analysis import eigenvalue_positivity, eigenvalues, full_ov_circuit, full_qk_circuit


@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=2, d_vocab=30)


def _top_by_magnitude(eigs, n):
    return eigs[eigs.abs().argsort(descending=True)[:n]]


@pytest.mark.parametrize("kind, circuit", [("OV", full_ov_circuit), ("QK", full_qk_circuit)])
def test_spectrum_and_positivity_match_the_dense_vocab_circuit(model, kind, circuit):
    ours, pos = eigenvalues(model, kind), eigenvalue_positivity(model, kind)
    assert ours.shape == (2, 3, model.cfg.d_head) and pos.shape == (2, 3)
    for l in range(2):
        for h in range(3):
            dense = torch.linalg.eigvals(circuit(model, l, h).dense())  # [d_vocab], rest ~0
            mine = _top_by_magnitude(ours[l, h], model.cfg.d_head)
            theirs = _top_by_magnitude(dense, model.cfg.d_head)
            # compare as multisets: sort by (real, imag) after rounding away ordering noise
            key = lambda e: (e.real * 1e6).round() * 1e7 + (e.imag * 1e6).round()  # noqa: E731
            torch.testing.assert_close(mine[key(mine).argsort()], theirs[key(theirs).argsort()])
            expected = dense.sum().real / dense.abs().sum()
            assert abs(float(pos[l, h]) - float(expected)) < 1e-5


def test_positivity_matches_transformer_lens_factored_matrix_route(model):
    U = model.W_U
    ours = eigenvalue_positivity(model, "OV")
    for l in range(2):
        # layer 0 reads the embedding alone: divided by its per-token layer-norm scale (exact there)
        E = torch.nn.functional.layer_norm(model.W_E, (model.cfg.d_model,), eps=model.cfg.eps) if l == 0 else model.W_E
        for h in range(3):
            ev = TLFactoredMatrix(E @ model.W_V[l, h], model.W_O[l, h] @ U).eigenvalues
            assert abs(float(ours[l, h]) - float(ev.sum().real / ev.abs().sum())) < 1e-6


def test_a_pure_copying_head_has_positivity_one_and_its_negation_minus_one():
    m = paper_model(n_layers=1, d_vocab=30)
    m.W_U = m.W_E.T.clone()  # tied embeddings and W_O = W_V^T: full OV = W_E W_V W_V^T W_E^T, PSD
    m.W_O = m.W_V.mT.clone()
    pos = eigenvalue_positivity(m, "OV")
    torch.testing.assert_close(pos, torch.ones(1, 3))
    m.W_O = -m.W_O
    torch.testing.assert_close(eigenvalue_positivity(m, "OV"), -torch.ones(1, 3))


def test_rotary_qk_is_refused_but_ov_works_and_bad_kind_is_named():
    rotary = custom_model(positional="rotary")
    with pytest.raises(ValueError, match="rotary"):
        eigenvalue_positivity(rotary, "QK")
    assert eigenvalue_positivity(rotary, "OV").shape == (2, 3)
    with pytest.raises(ValueError, match="kind must be one of"):
        eigenvalue_positivity(rotary, "VO")
