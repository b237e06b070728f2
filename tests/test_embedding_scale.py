"""The embedding token circuits read: W_E divided by the first layer norm's per-token scale
where that is exact (the paper's choice for one-layer models), the raw W_E elsewhere.

Oracles: the model's own forward on one-token contexts (what its first layer divides by),
torch's ``F.layer_norm`` on W_E (written apart from the model's normalisation), dense
products and a brute-force top-k over every (source, destination, out) triple.

Tolerances (``tests/tolerance.py``): identities between the forward and the circuits run on a float64
copy of the shipped model (what they check does not depend on the precision) within float64 rounding
bounds; float32 analyses against float64 oracles within ``normalization_tol`` (the per-token division)
carried through ``centred_product_tol`` (the products); positivities within ``POSITIVITY_TOL``.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import eigenvalue_positivity, full_ov_circuit, full_qk_circuit, skip_trigrams
from pycircuits_widgets.analysis.circuits import (
    direct_path,
    embedding,
    embedding_is_normalized,
    embedding_note,
    k_composition_circuit,
)
from random_models import custom_model, paper_model
from tolerance import (
    POSITIVITY_TOL,
    assert_within,
    centred_product_tol,
    logit_tol,
    model_forward_length,
    normalization_tol,
    product_tol,
    reduction_tol,
    score_tol,
)


@pytest.fixture(scope="module")
def one_layer():
    return pcw.load_pretrained("attn-only-1l")


@pytest.fixture(scope="module")
def one_layer64(one_layer):
    return one_layer.to(torch.float64)


def normed_embedding(model) -> torch.Tensor:
    """``LN(W_E[t])`` per token, by torch's layer norm (no learned scale: it is folded into readers)."""
    return F.layer_norm(model.W_E, (model.cfg.d_model,), eps=model.cfg.eps)


def normed_tol(model) -> torch.Tensor:
    """``normalization_tol`` of the model's per-token division of ``W_E``, in the model's dtype."""
    return normalization_tol(model.W_E, model.cfg.eps, centred=True, dtype=model.W_E.dtype)


def test_the_scale_is_what_the_first_layer_divides_each_token_by(one_layer):
    """One-token contexts: layer 0 reads ``resid / ln_scale``; that is ``embedding(model, 0)``."""
    tokens = torch.arange(one_layer.cfg.d_vocab)[:, None]
    _, cache = one_layer.run_with_cache(tokens)
    resid = cache.resid[:, 0, 0]
    read = (resid - resid.mean(-1, keepdim=True)) / cache.ln_scale[:, 0, 0, None]
    # float32 layer norms of the same rows, each within normalization_tol (F.layer_norm's one-pass
    # statistics round no worse than the two-pass ones the bound counts)
    assert_within(embedding(one_layer, 0), read, 2 * normed_tol(one_layer))
    assert_within(embedding(one_layer, 0), normed_embedding(one_layer), 2 * normed_tol(one_layer))
    assert not torch.allclose(embedding(one_layer, 0), one_layer.W_E, atol=1e-2)  # the scale matters here


def test_full_ov_rows_equal_what_the_head_writes_on_one_token_contexts(one_layer64):
    """On a one-token context a head attends to its only token: its output times W_U is the
    head's full OV row for that token, exactly (float64: two evaluations of the chain
    ``LN(W_E) W_V W_O W_U``, each normalising the embedding itself)."""
    m, tokens = one_layer64, torch.tensor([3, 77, 500, 1000])[:, None]
    _, cache = m.run_with_cache(tokens)
    for h in (0, 5):
        expected = cache.head_out[:, 0, h, 0] @ m.W_U
        got = full_ov_circuit(m, 0, h).A[tokens[:, 0]] @ full_ov_circuit(m, 0, h).B
        E = embedding(m, 0)[tokens[:, 0]]
        chain = (E, m.W_V[0, h], m.W_O[0, h], m.W_U)
        bound = centred_product_tol(*chain, dtype=torch.float64, errors=[normed_tol(m)[tokens[:, 0]]], centre=False)
        assert_within(got, expected, 2 * bound)


def test_full_qk_equals_the_attention_logit_gap_on_two_token_contexts(one_layer64):
    """Context ``[s, d]``: ``log(A[1, 0] / A[1, 1])`` times attn_scale is the score gap of the
    destination ``d`` (position 1) to ``s`` (position 0) and to itself; its token-token terms are
    the full QK circuit, the rest are positional terms written out here (float64)."""
    m, h = one_layer64, 2
    pairs = torch.tensor([[5, 9], [100, 7], [640, 640], [31, 900]])
    _, cache = m.run_with_cache(pairs)
    A = cache.patterns[:, 0, h, 1]
    gap = torch.log(A[:, 0] / A[:, 1]) * m.cfg.attn_scale
    E, P = normed_embedding(m), m.W_pos
    WQK = m.W_Q[0, h] @ m.W_K[0, h].T
    qk = full_qk_circuit(m, 0, h).dense()
    s, d = pairs[:, 0], pairs[:, 1]


    def bilinear(x, y):  # rowwise x WQK y^T
        return ((x @ WQK) * y).sum(-1)

    P0, P1 = P[0].expand_as(E[s]), P[1].expand_as(E[s])
    positional = (bilinear(E[d], P0) + bilinear(P1, E[s]) + bilinear(P1, P0)
                  - bilinear(E[d], P1) - bilinear(P1, E[d]) - bilinear(P1, P1))
    expected = qk[d, s] - qk[d, d] + positional
    # float64 throughout: each side sums score terms of size at most (|x_d| + |P_1|) |W_QK| (|x_s| + |P_0|)
    # (x the normalised embedding) along at most a forward's length to the scores, three evaluations
    # (the forward, the circuit, the positional terms) of two scores each; the log and softmax add a few
    def size(x, y):  # rowwise |x| |WQK| |y|^T
        return ((x.abs() @ WQK.abs()) * y.abs()).sum(-1)

    query = E[d].abs() + P[1].abs()
    terms = size(query, E[s].abs() + P[0].abs()) + size(query, E[d].abs() + P[1].abs())
    n = model_forward_length(m.cfg, 2, to="scores") + 2 * m.cfg.d_model + 8
    assert_within(gap, expected, reduction_tol(n, terms, torch.float64, computations=3))


def test_skip_trigrams_equal_a_brute_force_top_k_on_the_normalised_embedding(one_layer):
    """Every triple scored densely (``qk`` row-centred over sources, ``ov`` row-centred over outs,
    both positive): a triple in the top 20 has its destination among its source's 20 best and its
    out among its source's 20 best, so 20 x 20 candidates per source cover it."""
    m, h, k = one_layer, 4, 20
    w = {name: getattr(m, name).double() for name in ("W_Q", "W_K", "W_V", "W_O", "W_U")}
    E = F.layer_norm(m.W_E.double(), (m.cfg.d_model,), eps=m.cfg.eps)  # the oracle in float64
    qk = (E @ w["W_Q"][0, h]) @ (E @ w["W_K"][0, h]).T  # [dest, src]
    qk = qk - qk.mean(1, keepdim=True)
    ov = (E @ w["W_V"][0, h]) @ (w["W_O"][0, h] @ w["W_U"])  # [src, out]
    ov = ov - ov.mean(1, keepdim=True)
    # ours multiplies float32 factors of its float32-normalised embedding: centred_product_tol of each chain
    dE = normed_tol(m)
    dqk = centred_product_tol(E, w["W_Q"][0, h], w["W_K"][0, h].T, E.T, errors=[dE, None, None, dE.T])
    dov = centred_product_tol(E, w["W_V"][0, h], w["W_O"][0, h], w["W_U"], errors=[dE])
    top_qk, dest = torch.topk(qk.T, k, dim=1)  # per source
    top_ov, out = torch.topk(ov, k, dim=1)
    score = top_qk.clamp_min(0)[:, :, None] * top_ov.clamp_min(0)[:, None, :]  # [src, k, k]
    best, flat = torch.topk(score.flatten(), k)
    src = flat // (k * k)
    expected = [(int(s), int(dest[s, (f % (k * k)) // k]), int(out[s, f % k])) for s, f in zip(src, flat)]
    got = skip_trigrams(m, 0, h, k=k)
    ours = [(t.source, t.destination, t.out) for t in got]

    def oracle(s, d, o):
        return float(qk[d, s].clamp_min(0) * ov[s, o].clamp_min(0))

    def bound(s, d, o):
        return float(score_tol(qk[d, s], ov[s, o], dqk[d, s], dov[s, o]))

    # rounding may swap triples whose scores lie within their bounds: ours are k distinct triples in
    # descending order, each within its bound of the oracle's score, holding every triple certainly in
    # the oracle's top k and none certainly out of it
    scores = [t.score for t in got]
    assert len(set(ours)) == k and scores == sorted(scores, reverse=True)
    assert all(abs(score - oracle(*t)) <= bound(*t) for t, score in zip(ours, scores))
    kth, slack = float(best[-1]), 2 * max(bound(*t) for t in {*ours, *expected})
    assert {t for t, v in zip(expected, best) if v > kth + slack} <= set(ours)
    assert all(oracle(*t) >= kth - slack for t in ours)
    # and in the oracle's order as far as neighbours lie further apart than their bounds
    apart = [best[i] - best[i + 1] > bound(*expected[i]) + bound(*expected[i + 1]) for i in range(k - 1)]
    decided = apart.index(False) + 1 if False in apart else k
    assert decided >= 2 and ours[:decided] == expected[:decided]


def test_eigenvalue_positivity_equals_the_dense_spectrum_of_the_normalised_circuits():
    m = paper_model(n_layers=1, d_vocab=40)
    E = normed_embedding(m)
    for kind in ("OV", "QK"):
        dense = [E @ m.W_V[0, h] @ m.W_O[0, h] @ m.W_U if kind == "OV" else
                 E @ m.W_Q[0, h] @ m.W_K[0, h].T @ E.T for h in range(m.cfg.n_heads)]
        eigs = [torch.linalg.eigvals(M) for M in dense]
        expected = torch.stack([e.real.sum() / e.abs().sum() for e in eigs])  # float64
        assert_within(eigenvalue_positivity(m, kind)[0], expected, POSITIVITY_TOL)


def test_later_layers_and_learned_positions_read_the_raw_embedding():
    two = paper_model(n_layers=2)
    assert embedding_is_normalized(two, 0) and not embedding_is_normalized(two, 1)
    torch.testing.assert_close(full_ov_circuit(two, 1, 0).A, two.W_E @ two.W_V[1, 0], atol=0, rtol=0)
    torch.testing.assert_close(full_ov_circuit(two).A[1], two.W_E @ two.W_V[1], atol=0, rtol=0)
    # float64: the model's and torch's layer norms of W_E, each times W_V
    E, dE = normed_embedding(two), normed_tol(two)
    bound = centred_product_tol(E, two.W_V[0], dtype=torch.float64, errors=[dE], centre=False)
    assert_within(full_ov_circuit(two).A[0], E @ two.W_V[0], 2 * bound)
    kc = k_composition_circuit(two, (0, 1), (1, 2))  # circuits through two heads: raw W_E on both sides
    torch.testing.assert_close(kc.A, two.W_E @ two.W_Q[1, 2], atol=0, rtol=0)
    chain = (two.W_E, two.W_V[0, 1], two.W_O[0, 1], two.W_K[1, 2])
    assert_within(kc.B.mT, functools.reduce(torch.matmul, chain), product_tol(*chain))  # float64, another order
    learned = custom_model(n_layers=1, positional="learned")
    assert not embedding_is_normalized(learned, 0) and "raw W_E" in embedding_note(learned)
    torch.testing.assert_close(embedding(learned, 0), learned.W_E, atol=0, rtol=0)


def test_a_zero_layer_model_direct_path_is_its_logits():
    """The unembedding of a 0-layer model reads the embedding alone: logits are exactly
    ``embedding W_U``, row by row."""
    m = pcw.load_pretrained("attn-only-0l")
    tokens = torch.tensor([0, 17, 999])
    ours, cache = m.run_with_cache(tokens[None])
    # float32 both ways (the dense product, the forward): tolerance.logit_tol of a 0-layer forward
    assert_within(direct_path(m).dense()[tokens], ours[0], logit_tol(m, cache, len(tokens)))


def test_notes_say_which_embedding(one_layer):
    assert "per-token scale" in embedding_note(one_layer) and "exact" in embedding_note(one_layer)
    assert "later layers read the raw W_E" in embedding_note(pcw.load_pretrained("attn-only-2l"))
