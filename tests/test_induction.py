"""The induction-mechanism analysis against dense token x token matrices (tiny models) and the
shipped two-layer model's known heads.

Tolerances: the tiny models are float64; positivities come back in float32 (``POSITIVITY_TOL``), the
ranked tables and diagonal ranks multiply float32 factors (``centred_product_tol``)."""

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import composition_detail, eigenvalue_positivity, head_scores
from pycircuits_widgets.analysis.induction import (
    COPY_THRESHOLD,
    MATCH_THRESHOLD,
    classify_pair,
    induction_pair,
    k_composition_diagonal_rank,
    k_composition_positivity,
    k_composition_top,
    pair_verdicts,
)
from random_models import custom_model, paper_model
from tolerance import POSITIVITY_TOL, assert_within, centred_product_tol


@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=2, n_heads=3, d_vocab=40, seed=3)


def dense_k_circuit(m, h1, h2):
    """W_E W_Q^{h2} W_K^{h2 T} (W_E W_V^{h1} W_O^{h1})^T, written out: [dest token, token h1 moved]."""
    query, key = k_factors(m, h1, h2)
    return query @ key


def k_factors(m, h1, h2):
    """The circuit's two float64 factors ``(W_E W_Q^{h2} [V, d_head], (W_E W_V^{h1} W_O^{h1} W_K^{h2})^T)``:
    our float32 tables round each to float32, then multiply (``centred_product_tol``)."""
    (l1, i1), (l2, i2) = h1, h2
    moved = m.W_E @ m.W_V[l1, i1] @ m.W_O[l1, i1]
    return m.W_E @ m.W_Q[l2, i2], (moved @ m.W_K[l2, i2]).T


def dense_positivity(M):
    eigs = torch.linalg.eigvals(M.double())
    return float(eigs.sum().real / eigs.abs().sum())


def test_k_composition_positivity_equals_dense_eigenvalues_and_composition_detail(model):
    pos = k_composition_positivity(model)
    assert pos.shape == (2, 3, 2, 3) and torch.isnan(pos[1]).all() and torch.isnan(pos[0, :, 0]).all()
    for h1 in range(3):
        for h2 in range(3):
            dense = dense_positivity(dense_k_circuit(model, (0, h1), (1, h2)))
            assert pos[0, h1, 1, h2] == pytest.approx(dense, abs=POSITIVITY_TOL)
            detail = composition_detail(model, "K", (0, h1), (1, h2)).positivity
            assert pos[0, h1, 1, h2] == pytest.approx(detail, abs=2 * POSITIVITY_TOL)


def test_ranked_table_is_the_top_of_the_row_centred_dense_circuit(model):
    M = dense_k_circuit(model, (0, 2), (1, 0))  # float64
    centred = M - M.mean(1, keepdim=True)
    bound = centred_product_tol(*k_factors(model, (0, 2), (1, 0)))
    values, dest, src = k_composition_top(model, (0, 2), (1, 0), 15)
    ref = torch.topk(centred.flatten(), 15).values
    assert_within(values, ref, bound.max())  # a k-th largest moves by at most the largest bound
    assert_within(centred[dest, src], values, bound[dest, src])


def test_diagonal_rank_counts_entries_below_the_diagonal(model):
    M = dense_k_circuit(model, (0, 1), (1, 2))
    V = M.shape[0]
    # ours compares float32 entries: an entry within both bounds of its row's diagonal may fall either way
    bound = centred_product_tol(*k_factors(model, (0, 1), (1, 2)), centre=False)
    margin = bound + bound.diagonal()[:, None]
    surely = sum(int((M[t] < M[t, t] - margin[t]).sum()) for t in range(V))
    maybe = sum(int((M[t] < M[t, t] + margin[t]).sum()) for t in range(V))
    rank = k_composition_diagonal_rank(model, (0, 1), (1, 2), block_rows=7) * (V * (V - 1))
    assert surely <= round(rank) <= maybe and rank == pytest.approx(round(rank))


@pytest.mark.parametrize("qk, ov, kind", [
    (MATCH_THRESHOLD, COPY_THRESHOLD, "induction"),
    (0.9, -COPY_THRESHOLD, "anti-induction"),
    (0.9, COPY_THRESHOLD - 0.01, "match-only"),
    (-MATCH_THRESHOLD, 0.9, "avoid"),
    (MATCH_THRESHOLD - 0.01, 0.9, "none"),
])
def test_classification_uses_only_the_two_positivities_and_the_documented_thresholds(qk, ov, kind):
    got, sentence = classify_pair((0, 4), (1, 6), qk, ov)
    assert got == kind
    assert "L0.H4" in sentence and "L1.H6" in sentence and f"{qk:+.2f}" in sentence and f"{ov:+.2f}" in sentence


def test_induction_pair_bundles_the_numbers_and_refuses_bad_input(model):
    p = induction_pair(model, (0, 1), (1, 2), k=5)
    # the same float64 positivities by two routes, each copied to float32
    assert p.qk_positivity == pytest.approx(float(k_composition_positivity(model)[0, 1, 1, 2]), abs=2 * POSITIVITY_TOL)
    assert p.ov_positivity == pytest.approx(float(eigenvalue_positivity(model, "OV")[1, 2]), abs=2 * POSITIVITY_TOL)
    assert (p.kind, p.sentence) == classify_pair((0, 1), (1, 2), p.qk_positivity, p.ov_positivity)
    with pytest.raises(ValueError, match="earlier layer"):
        induction_pair(model, (1, 0), (0, 1))
    with pytest.raises(ValueError, match="offset only applies to rotary models"):
        induction_pair(model, (0, 1), (1, 2), offset=1)
    assert induction_pair(custom_model(positional="rotary"), (0, 0), (1, 0), offset=3).offset == 3


def test_shipped_model_previous_token_head_and_induction_heads_form_induction_pairs():
    m = pcw.load_pretrained("attn-only-2l")
    scores = head_scores(m)
    prev = (0, int(scores["previous_token"][0].argmax()))
    induction_heads = [(1, h) for h in range(m.cfg.n_heads) if scores["induction"][1, h] > 0.5]
    assert induction_heads
    for ind in induction_heads:
        p = induction_pair(m, prev, ind, k=5)
        assert p.kind == "induction", p.sentence
        assert p.diagonal_rank > 0.75  # the same token outranks most of the vocabulary


def test_pair_verdicts_are_each_pairs_induction_pair_numbers(model):
    verdicts = pair_verdicts(model)
    assert list(verdicts) == [(0, h1, 1, h2) for h1 in range(3) for h2 in range(3)]
    ov = eigenvalue_positivity(model, "OV")
    for (l1, h1, l2, h2), v in verdicts.items():
        pair = induction_pair(model, (l1, h1), (l2, h2), ov_positivity=ov)
        assert v.qk_positivity == pytest.approx(pair.qk_positivity, abs=2 * POSITIVITY_TOL)
        assert v.ov_positivity == pytest.approx(pair.ov_positivity, abs=2 * POSITIVITY_TOL)
        # float64 scores by two routes (all pairs' Gram route, one pair's): ~1e-13 apart, 1e-4 a float64 margin
        assert v.k_score == pytest.approx(pair.k_score, rel=1e-4)
        assert (v.kind, v.sentence, v.offset) == classify_pair((l1, h1), (l2, h2), v.qk_positivity, v.ov_positivity) + (None,)
