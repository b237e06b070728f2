"""Composition scores against dense norms and TransformerLens's composition_scores, same weights."""

import pytest
import torch
from random_models import paper_model
from transformer_lens.FactoredMatrix import FactoredMatrix as TLFactoredMatrix
from transformer_lens.utilities.matrix import composition_scores as tl_composition_scores

from pycircuits_widgets.analysis import composition_detail, composition_scores, random_baseline


@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=3, n_heads=4, d_model=32, d_head=4, d_vocab=30)


def _dense_composed(model, kind, h1, h2):
    """The composed [d_model, d_model] matrix in the row convention, from explicit products."""
    OV1 = model.W_V[h1] @ model.W_O[h1]
    QK2 = model.W_Q[h2] @ model.W_K[h2].T
    second = {"Q": QK2, "K": QK2.T, "V": model.W_V[h2] @ model.W_O[h2]}[kind]
    return OV1, second, OV1 @ second


def _tl_scores(model, kind):
    # exactly what TransformerBridge.all_composition_scores builds, then its [l1 < l2] mask
    left = TLFactoredMatrix(model.W_V, model.W_O)
    qk = TLFactoredMatrix(model.W_Q, model.W_K.mT)
    right = {"Q": qk, "K": qk.T, "V": left}[kind]
    scores = tl_composition_scores(left, right, broadcast_dims=True)
    L = model.cfg.n_layers
    mask = torch.arange(L)[:, None, None, None] < torch.arange(L)[None, None, :, None]
    return torch.where(mask, scores, torch.zeros_like(scores)), mask.expand_as(scores)


@pytest.mark.parametrize("kind", ["Q", "K", "V"])
def test_scores_equal_transformer_lens_and_dense_norms(model, kind):
    ours = composition_scores(model, kind, baseline=False)
    theirs, defined = _tl_scores(model, kind)
    assert ours.shape == (3, 4, 3, 4)
    torch.testing.assert_close(ours[defined], theirs[defined], rtol=1e-10, atol=1e-12)
    assert torch.isnan(ours[~defined]).all() and (theirs[~defined] == 0).all()
    for h1, h2 in [((0, 1), (1, 3)), ((0, 0), (2, 2)), ((1, 2), (2, 0))]:
        OV1, second, composed = _dense_composed(model, kind, h1, h2)
        expected = composed.norm() / (OV1.norm() * second.norm())
        torch.testing.assert_close(ours[h1 + h2], expected)


def test_float32_scores_match_float64(model):
    ours32 = composition_scores(model.to(torch.float32), "K", baseline=False)
    ours64 = composition_scores(model, "K", baseline=False)
    assert ours32.dtype == torch.float32
    torch.testing.assert_close(ours32.double(), ours64, rtol=1e-5, atol=1e-6, equal_nan=True)


def _paper_factors(model, kind, h1, h2):
    """The paper's (column-convention) product X1 X2 X3 X4, each factor transposed from our weights:
    Q: W_K^T W_Q W_O W_V, K: W_Q^T W_K W_O W_V, V: W_O^{h2} W_V^{h2} W_O^{h1} W_V^{h1}."""
    V1, O1 = model.W_V[h1].T, model.W_O[h1].T  # paper shapes [d_head, d_model], [d_model, d_head]
    Q2, K2, V2, O2 = model.W_Q[h2].T, model.W_K[h2].T, model.W_V[h2].T, model.W_O[h2].T
    second = {"Q": (K2.T, Q2), "K": (Q2.T, K2), "V": (O2, V2)}[kind]
    return (*second, O1, V1)


@pytest.mark.parametrize("kind", ["Q", "K", "V"])
def test_erratum_norms_are_the_two_cyclic_permutations_and_differ_from_the_dense_truth(model, kind):
    correct = composition_scores(model, kind, baseline=False)
    defined = ~correct.isnan()
    h1, h2 = (0, 2), (2, 1)
    X1, X2, X3, X4 = _paper_factors(model, kind, h1, h2)
    truth = X1 @ X2 @ X3 @ X4
    torch.testing.assert_close(correct[h1 + h2], truth.norm() / ((X1 @ X2).norm() * (X3 @ X4).norm()))
    rotations = {"erratum_left": (X2 @ X3 @ X4 @ X1, (X2 @ X1, X4 @ X3)),   # first factor to the end
                 "erratum_right": (X4 @ X1 @ X2 @ X3, (X2 @ X1, X4 @ X3))}  # last factor to the front
    for norm, (rotated, (n2, n1)) in rotations.items():
        erratum = composition_scores(model, kind, baseline=False, norm=norm)
        assert (erratum[defined] - correct[defined]).abs().min() > 1e-3
        assert rotated.shape == (model.cfg.d_head, model.cfg.d_head)
        assert torch.allclose(torch.trace(rotated), torch.trace(truth))  # same trace ...
        assert abs(float(rotated.norm() - truth.norm())) > 1e-3 * float(truth.norm())  # ... not the same norm
        torch.testing.assert_close(erratum[h1 + h2], rotated.norm() / (n1.norm() * n2.norm()))


def test_the_ambiguous_erratum_name_is_refused_naming_both_forms(model):
    with pytest.raises(ValueError, match="erratum_left.*erratum_right"):
        composition_scores(model, "K", norm="erratum")


def test_baseline_is_the_mean_score_of_random_heads_and_is_subtracted(model):
    with_baseline = composition_scores(model, "V")
    without = composition_scores(model, "V", baseline=False)
    b = random_baseline(model.cfg.d_model, model.cfg.d_head)
    torch.testing.assert_close(with_baseline, without - b, equal_nan=True)
    # independent check: Gaussian heads with the same shapes, scored by the full routine
    wide = paper_model(n_layers=2, n_heads=16, d_model=32, d_head=4, d_vocab=30, seed=5)
    g = torch.Generator().manual_seed(7)
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        setattr(wide, name, torch.randn(getattr(wide, name).shape, generator=g, dtype=torch.float64))
    sampled = composition_scores(wide, "K", baseline=False)[0, :, 1, :].mean()
    assert abs(float(sampled) - b) < 0.05 * b


def test_detail_matches_scores_dense_svd_and_token_circuit_positivity(model):
    for kind in "QKV":
        h1, h2 = (0, 3), (2, 1)
        d = composition_detail(model, kind, h1, h2)
        assert d.score == pytest.approx(float(composition_scores(model, kind, baseline=False)[h1 + h2]))
        for norm, value in d.erratum_scores.items():
            assert value == pytest.approx(float(composition_scores(model, kind, False, norm)[h1 + h2]))
        _, _, composed = _dense_composed(model, kind, h1, h2)
        S = torch.linalg.svdvals(composed)[: d.singular_values.numel()]
        torch.testing.assert_close(d.singular_values, S)
        E, U = model.W_E, model.W_U
        token = {"Q": E @ composed @ E.T, "K": E @ composed.T @ E.T, "V": E @ composed @ U}[kind]
        ev = torch.linalg.eigvals(token)
        assert d.positivity == pytest.approx(float(ev.sum().real / ev.abs().sum()), abs=1e-6)


def test_bad_arguments_are_named(model):
    with pytest.raises(ValueError, match="kind must be one of"):
        composition_scores(model, "O")
    with pytest.raises(ValueError, match="norm must be one of"):
        composition_scores(model, "Q", norm="cyclic")
    with pytest.raises(ValueError, match="earlier layer"):
        composition_detail(model, "K", (1, 0), (1, 1))
