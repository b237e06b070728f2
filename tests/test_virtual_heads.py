"""Virtual heads (V-composition) and the bigram table against dense matrices."""

import pytest
import torch
from random_models import paper_model

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import run
from pycircuits_widgets.analysis.bigrams import bigram_top
from pycircuits_widgets.analysis.virtual_heads import (top_virtual_heads, virtual_head_copies, virtual_head_norms,
                                                       virtual_head_positivity)


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
                        assert norms[l1, i1, l2, i2] == pytest.approx(float(ref), rel=1e-5)


def test_positivity_and_copies_read_the_dense_full_virtual_circuit(model):
    full = model.W_E @ dense_virtual_ov(model, (0, 1), (2, 0)) @ model.W_U  # [src, out]
    eigs = torch.linalg.eigvals(full)
    assert virtual_head_positivity(model, (0, 1), (2, 0)) == pytest.approx(float(eigs.sum().real / eigs.abs().sum()), abs=1e-6)
    centred = full.diagonal() - full.mean(1)
    values, ids = torch.topk(centred, 5)
    got = virtual_head_copies(model, (0, 1), (2, 0), 5)
    assert [i for i, _ in got] == ids.tolist()
    assert [v for _, v in got] == pytest.approx(values.tolist(), rel=1e-4, abs=1e-5)


def test_top_virtual_heads_are_the_largest_norms_strongest_first(model):
    heads = top_virtual_heads(model, k=4, n_copies=3)
    norms = virtual_head_norms(model)
    ref = torch.topk(torch.nan_to_num(norms, nan=-1).flatten(), 4).values
    assert [h.norm for h in heads] == pytest.approx(ref.tolist(), rel=1e-6)
    assert all(h.h1[0] < h.h2[0] and len(h.copies) == 3 for h in heads)
    with pytest.raises(ValueError, match="at least 2 layers"):
        top_virtual_heads(paper_model(n_layers=1))


def test_bigram_top_is_the_dense_table_and_the_zero_layer_models_prediction():
    m = paper_model(n_layers=1, d_vocab=30)
    values, ids = bigram_top(m, 6)
    ref = torch.topk((m.W_E @ m.W_U).float(), 6, dim=1)
    torch.testing.assert_close(values, ref.values, rtol=1e-5, atol=1e-5)
    assert (ids == ref.indices).all()
    sub_values, sub_ids = bigram_top(m, 6, [4, 2])
    assert (sub_ids == ref.indices[[4, 2]]).all()
    with pytest.raises(ValueError, match="vocab ids"):
        bigram_top(m, 3, [30])
    # the zero-layer model: the top next tokens are exactly its predictions (the final norm only rescales)
    m0 = pcw.load_pretrained("attn-only-0l")
    _, ids0 = bigram_top(m0, 5, [7, 300])
    for row, t in enumerate([7, 300]):
        logits = run(m0, [t]).logits[0, 0]
        assert ids0[row].tolist() == torch.topk(logits, 5).indices.tolist()
