"""Non-finite results are refused, naming the weight that holds NaN/inf or the overflow, where they
used to come back as inf scores, empty tables, a positivity of 0.0 or a LAPACK error."""

import pytest
import torch

from pycircuits_widgets.analysis import (
    composition_detail,
    composition_scores,
    eigenvalue_positivity,
    full_ov_circuit,
    full_qk_circuit,
    skip_trigrams,
)
from pycircuits_widgets.analysis.finite import NonFiniteError
from pycircuits_widgets.analysis.induction import k_composition_positivity
from pycircuits_widgets.analysis.virtual_heads import virtual_head_norms
from random_models import custom_model, paper_model


def scaled(model, name, factor):
    setattr(model, name, getattr(model, name) * factor)
    return model


def test_skip_trigrams_of_an_overflowing_embedding_are_refused():
    # no normalization: W_E * 1e30 enters the circuits as is, and q . k ~ 1e60 overflows float32
    model = scaled(custom_model(n_layers=1, normalization=None, positional="none", dtype=torch.float32), "W_E", 1e30)
    assert bool(torch.isfinite(model.W_E).all())
    with pytest.raises(NonFiniteError, match=r"skip-trigram scores of L0.H1.*overflows torch.float32.*W_E [\d.]+e\+(29|30)"):
        skip_trigrams(model, 0, 1, k=5)
    # the same model at a scale that fits stays answerable (the check is not a magnitude limit)
    fine = scaled(custom_model(n_layers=1, normalization=None, positional="none", dtype=torch.float32), "W_E", 1e8)
    assert all(torch.isfinite(torch.tensor(t.score)) for t in skip_trigrams(fine, 0, 1, k=5))


def test_an_overflowing_layer_norm_of_the_embedding_is_refused_not_read_as_zero():
    # the per-token norm of W_E * 1e30 overflows: x / inf would be an all-zero circuit (positivity 0.0)
    model = scaled(paper_model(n_layers=1, dtype=torch.float32), "W_E", 1e30)
    for analysis in (lambda: skip_trigrams(model, 0, 1, k=5), lambda: eigenvalue_positivity(model, "OV"),
                     lambda: full_ov_circuit(model, 0, 0), lambda: full_qk_circuit(model)):
        with pytest.raises(NonFiniteError, match=r"norm of W_E's rows overflows torch.float32"):
            analysis()


@pytest.mark.parametrize("weight, bad", [("W_Q", float("nan")), ("W_V", float("inf")), ("W_U", -float("inf"))])
def test_non_finite_weights_are_named(weight, bad):
    model = paper_model(n_layers=1, dtype=torch.float32)
    w = getattr(model, weight).clone()
    w.view(-1)[w.numel() // 2] = bad
    setattr(model, weight, w)
    with pytest.raises(NonFiniteError, match=rf"L0.H1 are not finite: weight {weight} .* holds 1 NaN/inf"):
        skip_trigrams(model, 0, 1, k=5)
    kind = "QK" if weight == "W_Q" else "OV"
    with pytest.raises(NonFiniteError, match=rf"{kind} circuits are not finite: weight {weight}"):
        eigenvalue_positivity(model, kind)


@pytest.mark.parametrize("weight, factor, kind", [("W_V", 1e20, "V"), ("W_Q", 1e20, "K"), ("W_O", 1e36, "Q")])
def test_overflowing_composition_scores_are_refused(weight, factor, kind):
    model = scaled(paper_model(dtype=torch.float32), weight, factor)
    pattern = rf"{kind}-composition scores are not finite: the computation overflows torch.float32.*{weight} \d"
    with pytest.raises(NonFiniteError, match=pattern):
        composition_scores(model, kind)
    with pytest.raises(NonFiniteError, match=pattern):
        composition_scores(model, kind, norm="erratum_left")


def test_zero_heads_keep_their_nan_composition_scores():
    # 0 / 0 is the documented NaN of a head that writes nothing, not an overflow
    model = paper_model(dtype=torch.float32)
    model.W_O[0, 1] = 0
    scores = composition_scores(model, "V", baseline=False)
    assert scores[0, 1, 1].isnan().all() and torch.isfinite(scores[0, 0, 1]).all()


def test_composition_detail_and_pair_spectra_refuse_an_overflowing_token_gram():
    # raw W_E (layer-1 reads) * 1e30: W_E^T W_E ~ 1e60 overflows float32; the positivity read 0.0
    model = scaled(paper_model(dtype=torch.float32), "W_E", 1e30)
    with pytest.raises(NonFiniteError, match=r"K-composition token circuit of \(0, 0\) -> \(1, 0\).*overflows torch.float32"):
        composition_detail(model, "K", (0, 0), (1, 0))
    with pytest.raises(NonFiniteError, match="K-composition token circuits' eigenvalues.*overflows torch.float32"):
        k_composition_positivity(model)


def test_virtual_head_norms_refuse_overflow():
    model = scaled(paper_model(dtype=torch.float32), "W_V", 1e20)
    with pytest.raises(NonFiniteError, match=r"virtual head norms.*overflows torch.float32.*W_V [\d.]+e\+(19|20)"):
        virtual_head_norms(model)


def test_non_finite_error_is_a_value_error():
    assert issubclass(NonFiniteError, ValueError)  # callers catching bad-input ValueErrors still do


def test_top_k_tables_of_overflowing_products_are_refused():
    # no normalization: W_E * 1e25 (and W_U * 1e20) give finite factors whose products overflow float32
    from pycircuits_widgets.analysis.bigrams import bigram_top
    from pycircuits_widgets.analysis.induction import k_composition_top

    model = scaled(custom_model(normalization=None, positional="none", dtype=torch.float32), "W_E", 1e25)
    with pytest.raises(NonFiniteError, match=r"K-composition token circuit's entries are not finite.*overflows torch.float32"):
        k_composition_top(model, (0, 0), (1, 1), k=3)
    assert bool(torch.isfinite(bigram_top(model, k=3)[0]).all())  # linear in W_E: ~1e25 fits
    scaled(model, "W_U", 1e20)
    with pytest.raises(NonFiniteError, match=r"bigram logits.*overflows torch.float32.*W_E [\d.]+e\+(24|25), W_U [\d.]+e\+(19|20)"):
        bigram_top(model, k=3)
