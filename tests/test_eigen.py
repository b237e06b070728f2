"""Eigenvalue positivity against dense eigendecompositions and TransformerLens's FactoredMatrix."""

import pytest
import torch
from transformer_lens.FactoredMatrix import FactoredMatrix as TLFactoredMatrix

from pycircuits_widgets.analysis import eigenvalue_positivity, eigenvalues, full_ov_circuit, full_qk_circuit
from pycircuits_widgets.factored import gram
from random_models import custom_model, paper_model
from tolerance import POSITIVITY_TOL, product_tol


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
            key = lambda e: (e.real * 1e6).round() * 1e7 + (e.imag * 1e6).round()
            torch.testing.assert_close(mine[key(mine).argsort()], theirs[key(theirs).argsort()])
            expected = dense.sum().real / dense.abs().sum()
            # both spectra float64; the positivity is returned as float32 (POSITIVITY_TOL's derivation)
            assert abs(float(pos[l, h]) - float(expected)) < POSITIVITY_TOL


def test_positivity_matches_transformer_lens_factored_matrix_route(model):
    U = model.W_U
    ours = eigenvalue_positivity(model, "OV")
    for l in range(2):
        # layer 0 reads the embedding alone: divided by its per-token layer-norm scale (exact there)
        E = torch.nn.functional.layer_norm(model.W_E, (model.cfg.d_model,), eps=model.cfg.eps) if l == 0 else model.W_E
        for h in range(3):
            ev = TLFactoredMatrix(E @ model.W_V[l, h], model.W_O[l, h] @ U).eigenvalues
            assert abs(float(ours[l, h]) - float(ev.sum().real / ev.abs().sum())) < POSITIVITY_TOL


def test_a_pure_copying_head_has_positivity_one_and_its_negation_minus_one():
    m = paper_model(n_layers=1, d_vocab=30)
    m.W_U = m.W_E.T.clone()  # tied embeddings and W_O = W_V^T: full OV = W_E W_V W_V^T W_E^T, PSD
    m.W_O = m.W_V.mT.clone()
    pos = eigenvalue_positivity(m, "OV")
    torch.testing.assert_close(pos, torch.ones(1, 3))
    m.W_O = -m.W_O
    torch.testing.assert_close(eigenvalue_positivity(m, "OV"), -torch.ones(1, 3))


def test_rotary_qk_is_read_at_an_offset_ov_needs_none_and_bad_kind_is_named():
    """Rotary QK positivity at offset 0 equals the position-free circuit's (R(0) = I); the OV side
    takes no offset (numbers against dense oracles: tests/test_rotary_circuits.py)."""
    rotary = custom_model(positional="rotary")
    plain = custom_model(positional="none")
    torch.testing.assert_close(eigenvalue_positivity(rotary, "QK", offset=0), eigenvalue_positivity(plain, "QK"))
    assert eigenvalue_positivity(rotary, "QK").shape == (2, 3)  # default window, max
    with pytest.raises(ValueError, match="OV circuit does not depend on position"):
        eigenvalue_positivity(rotary, "OV", offset=1)
    assert eigenvalue_positivity(rotary, "OV").shape == (2, 3)
    with pytest.raises(ValueError, match="kind must be one of"):
        eigenvalue_positivity(rotary, "VO")


def test_zero_layer_rotary_model_has_empty_spectra_over_a_window():
    model = custom_model(n_layers=0, positional="rotary")
    assert eigenvalues(model, "QK", range(4)).shape == (4, 0, 3, 6)
    assert eigenvalue_positivity(model, "QK").shape == (0, 3)


def test_gram_equals_the_dense_float64_product_and_is_exactly_symmetric():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2, 700, 45, generator=g)
    for blocks in (1, 4, 6, 45):
        G = gram(X, blocks)
        # a float32 product of 700 terms per entry, against the exact float64 one (Higham 3.5)
        bound = product_tol(X.mT, X, computations=1)
        assert ((G.double() - X.double().mT @ X.double()).abs() <= bound).all()
        assert torch.equal(G, G.mT)


@pytest.mark.parametrize("kind", ["OV", "QK"])
def test_float32_positivity_agrees_with_float64_at_a_large_vocabulary(kind):
    # The module docstring's claim, not a derived bound: float32 products perturb each circuit by
    # at most gamma(V + 2 d_model) of its absolute product, but how far that moves a non-normal
    # spectrum depends on its eigenvectors' conditioning (Bauer-Fike), not bounded here. 1e-6 is the
    # precision the docstring promises users (random-sign sums: ~sqrt(V) u relative per entry).
    m = custom_model(n_layers=2, n_heads=4, d_model=256, d_head=32, d_vocab=20000, dtype=torch.float32)
    m64 = m.to(torch.float64)  # the same circuits in float64
    assert m.W_E.dtype == torch.float32 and m64.W_E.dtype == torch.float64
    ours, ref = eigenvalue_positivity(m, kind), eigenvalue_positivity(m64, kind)
    assert (ours.double() - ref.double()).abs().max() < 1e-6
    assert ref.abs().max() > 0.01  # a real spread of positivities, not all ~0
