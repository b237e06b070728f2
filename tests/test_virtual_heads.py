"""Virtual heads (V-composition) and the bigram table against dense matrices.

Tolerances (``tests/tolerance.py``): the models are float64; norms come back as float32 copies of
float64 values (one rounding), positivities within ``POSITIVITY_TOL``, tables multiplied from float32
factors within ``centred_product_tol``; top-k indices are checked as far as rounding decides them."""

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis.bigrams import bigram_top
from pycircuits_widgets.analysis.virtual_heads import (
    top_virtual_heads,
    virtual_head_copies,
    virtual_head_norms,
    virtual_head_positivity,
)
from random_models import paper_model
from tolerance import POSITIVITY_TOL, assert_within, centred_product_tol, gamma, logit_tol


@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=3, n_heads=2, d_vocab=30, seed=5)


def dense_virtual_ov(m, h1, h2):
    (l1, i1), (l2, i2) = h1, h2
    return m.W_V[l1, i1] @ m.W_O[l1, i1] @ m.W_V[l2, i2] @ m.W_O[l2, i2]


def test_norms_are_dense_frobenius_norms_for_every_ordered_pair(model):
    norms = virtual_head_norms(model)
    for l1 in range(3):
        for l2 in range(3):
            for i1 in range(2):
                for i2 in range(2):
                    if l1 >= l2:
                        assert torch.isnan(norms[l1, i1, l2, i2])
                    else:
                        ref = torch.linalg.matrix_norm(dense_virtual_ov(model, (l1, i1), (l2, i2)))
                        # a float64 norm's float32 copy (u), float64's own rounding far below a second u
                        assert norms[l1, i1, l2, i2] == pytest.approx(float(ref), rel=gamma(2))


def test_positivity_and_copies_read_the_dense_full_virtual_circuit(model):
    full = model.W_E @ dense_virtual_ov(model, (0, 1), (2, 0)) @ model.W_U  # [src, out]
    eigs = torch.linalg.eigvals(full)
    expected = float(eigs.sum().real / eigs.abs().sum())
    assert virtual_head_positivity(model, (0, 1), (2, 0)) == pytest.approx(expected, abs=POSITIVITY_TOL)
    centred = full.diagonal() - full.mean(1)
    values, ids = torch.topk(centred, 5)
    got = virtual_head_copies(model, (0, 1), (2, 0), 5)
    # ours: the circuit's factors W_E W_V and W_O W_V W_O W_U rounded to float32, multiplied, centred
    left, right = model.W_E @ model.W_V[0, 1], model.W_O[0, 1] @ model.W_V[2, 0] @ model.W_O[2, 0] @ model.W_U
    bound = centred_product_tol(left, right).diagonal()
    top6 = torch.topk(centred, 6)  # the order is decided: neighbours lie further apart than their bounds
    assert bool((top6.values[:-1] - top6.values[1:] > bound[top6.indices][:-1] + bound[top6.indices][1:]).all())
    assert [i for i, _ in got] == ids.tolist()
    assert_within(torch.tensor([v for _, v in got]), values, bound[ids])


def test_top_virtual_heads_are_the_largest_norms_strongest_first(model):
    heads = top_virtual_heads(model, k=4, n_copies=3)
    norms = virtual_head_norms(model)
    ref = torch.topk(torch.nan_to_num(norms, nan=-1).flatten(), 4).values
    assert [h.norm for h in heads] == pytest.approx(ref.tolist(), rel=gamma(2))  # float32 copies of float64 norms
    assert all(h.h1[0] < h.h2[0] and len(h.copies) == 3 for h in heads)
    with pytest.raises(ValueError, match="at least 2 layers"):
        top_virtual_heads(paper_model(n_layers=1))


def test_bigram_top_is_the_dense_table_and_the_zero_layer_models_prediction():
    m = paper_model(n_layers=1, d_vocab=30)
    values, ids = bigram_top(m, 6)
    table = m.W_E @ m.W_U  # float64
    ref = torch.topk(table, 6, dim=1)
    # ours multiplies float32 copies of the factors: each entry within centred_product_tol, so the k-th
    # largest of a row within the row's largest bound, and ours' indices hold entries that large
    bound = centred_product_tol(m.W_E, m.W_U, centre=False)
    assert_within(values, ref.values, bound.amax(1, keepdim=True))
    assert_within(table.gather(1, ids), values, bound.gather(1, ids))
    apart = (ref.values[:, :-1] - ref.values[:, 1:] > 2 * bound.amax(1, keepdim=True)).all(1)  # order decided
    assert apart.any() and (ids == ref.indices)[apart].all()
    sub_values, sub_ids = bigram_top(m, 6, [4, 2])
    # the same rows by another GEMM: the same checks
    assert_within(sub_values, ref.values[[4, 2]], bound[[4, 2]].amax(1, keepdim=True))
    assert_within(table[[4, 2]].gather(1, sub_ids), sub_values, bound[[4, 2]].gather(1, sub_ids))
    assert (sub_ids == ref.indices[[4, 2]])[apart[[4, 2]]].all()
    with pytest.raises(ValueError, match="vocab ids"):
        bigram_top(m, 3, [30])
    # the zero-layer model: the top next tokens are exactly its predictions (the final norm only rescales)
    m0 = pcw.load_pretrained("attn-only-0l")
    _, ids0 = bigram_top(m0, 5, [7, 300])
    for row, t in enumerate([7, 300]):
        logits, cache = m0.run_with_cache(torch.tensor([[t]]))
        logits = logits[0, 0]
        # float32 both ways: ours' next tokens are the top 5 up to swaps within two forwards' rounding
        assert_within(logits[ids0[row]], torch.topk(logits, 5).values, logit_tol(m0, cache, 1))
