"""Skip-trigram top-k against brute force over the dense [src, dest, out] score tensor.

Tolerances (``tests/tolerance.py``): the oracles are float64, written from the weights or from the
float32 factors a search was given. Ours multiplies float32 factors: its centred QK and OV entries are
within ``centred_product_tol`` of their chains (the first layer norm's ``normalization_tol`` carried
through) or ``product_tol`` of the given factors, its scores within ``score_tol`` of those; a sorted
top-k within the largest score bound of the oracle's (rounding each score by at most ``b`` moves each
order statistic by at most ``b``). Top-k ids are compared where the oracle's gaps exceed the bounds."""

import functools
import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from pycircuits_widgets import screen
from pycircuits_widgets.analysis import circuit_query, skip_trigrams
from pycircuits_widgets.analysis.circuits import embedding_is_normalized
from pycircuits_widgets.analysis.skip_trigrams import centred_factors, top_skip_trigrams, triple_entries, window_bound
from random_models import custom_model, paper_model
from tolerance import assert_within, centred_product_tol, normalization_tol, product_tol, score_tol


def _dense_centred(model, layer, head, vocab=None):
    """``(QKc [dest, src], OVc [src, out], dqk, dov)``: the centred circuits in float64, written from the
    weights (the embedding through torch's layer norm where the head reads it normalised; the learned
    scale is folded into the readers), and the bounds on ours: float32 factors of a float32-normalised
    embedding (``centred_product_tol`` of each chain; ``vocab``: the sub-vocabulary, centred over it)."""
    W = {name: getattr(model, name).double() for name in ("W_E", "W_Q", "W_K", "W_V", "W_O", "W_U")}
    E, U, dE = W["W_E"], W["W_U"], None
    if embedding_is_normalized(model, layer):
        E = F.layer_norm(E, (model.cfg.d_model,), eps=model.cfg.eps)
        dE = normalization_tol(model.W_E, model.cfg.eps, centred=True)
    if vocab is not None:
        E, U, dE = E[vocab], U[:, vocab], None if dE is None else dE[vocab]
    qk_chain = (E, W["W_Q"][layer, head], W["W_K"][layer, head].T, E.T)
    ov_chain = (E, W["W_V"][layer, head], W["W_O"][layer, head], U)
    QK, OV = functools.reduce(torch.matmul, qk_chain), functools.reduce(torch.matmul, ov_chain)
    dqk = centred_product_tol(*qk_chain, errors=[dE, None, None, None if dE is None else dE.T])
    dov = centred_product_tol(*ov_chain, errors=[dE])
    return QK - QK.mean(1, keepdim=True), OV - OV.mean(1, keepdim=True), dqk, dov


def _brute_force(QKc, OVc, k):
    score = QKc.T.clamp_min(0)[:, :, None] * OVc.clamp_min(0)[:, None, :]  # [src, dest, out]
    return torch.topk(score.flatten(), k).values


def _assert_top_scores(scores, QKc, OVc, dqk, dov):
    """``scores`` (ours, sorted) are the top ``len(scores)`` of the exact scores within the largest
    ``score_tol`` over every triple (rounding each score by at most ``b`` moves each order statistic by
    at most ``b``)."""
    bound = score_tol(QKc.T[:, :, None], OVc[:, None, :], dqk.T[:, :, None], dov[:, None, :])  # [src, dest, out]
    assert_within(torch.as_tensor(scores), _brute_force(QKc, OVc, len(scores)), float(bound.max()))


@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=1, n_heads=2, d_model=16, d_head=4, d_vocab=60, dtype=torch.float32)


def test_top_triples_equal_brute_force_with_scores_and_strings(model):
    QKc, OVc, dqk, dov = _dense_centred(model, 0, 1)
    result = skip_trigrams(model, 0, 1, k=25)
    assert len(result) == 25
    _assert_top_scores([r.score for r in result], QKc, OVc, dqk, dov)
    for r in result:
        d, s, o = r.destination, r.source, r.out
        assert abs(r.qk - float(QKc[d, s])) <= float(dqk[d, s]) and abs(r.ov - float(OVc[s, o])) <= float(dov[s, o])
        assert r.qk > 0 and r.ov > 0
        assert abs(r.score - float(QKc[d, s] * OVc[s, o])) <= float(score_tol(QKc[d, s], OVc[s, o], dqk[d, s], dov[s, o]))
        assert (r.source_str, r.destination_str, r.out_str) == (f"t{r.source}", f"t{r.destination}", f"t{r.out}")


@pytest.mark.parametrize("k, block_bytes, tail", [(1, 480, 0.0), (40, 2000, 0.0), (300, 4000, 0.0), (60, 480, 3.0)])
def test_exact_in_small_blocks_with_and_without_prunable_norms(k, block_bytes, tail):
    # small blocks force many chunks; heavy-tailed token norms (tail > 0) let the bounds prune
    g = torch.Generator().manual_seed(k)
    V, dh = 120, 5
    norms = torch.exp(tail * torch.rand(V, 1, generator=g))
    q, kk, v = (torch.randn(V, dh, generator=g) * norms for _ in range(3))
    u = torch.randn(dh, V, generator=g)
    score, idx, _ = top_skip_trigrams(q, kk, v, u, k, block_bytes)
    # the exact scores of these float32 factors; ours within product_tol of each product
    QK, OV = q.double() @ kk.double().T, v.double() @ u.double()  # [dest, src], [src, out]
    dqk, dov = product_tol(q, kk.T, computations=1), product_tol(v, u, computations=1)
    _assert_top_scores(score, QK, OV, dqk, dov)
    s, d, o = idx.unbind(1)
    assert_within(score, QK[d, s] * OV[s, o], score_tol(QK[d, s], OV[s, o], dqk[d, s], dov[s, o]))


def test_fewer_positive_triples_than_k_returns_them_all():
    q = torch.tensor([[1.0], [-1.0]])
    score, idx, _ = top_skip_trigrams(q, q.clone(), q.clone(), q.T.clone(), 50)
    # qk[d, s] = q_d k_s and ov[s, o] = v_s u_o: positive pairs need d = s sign-wise and o = s
    assert score.tolist() == [1.0, 1.0] and sorted(idx[:, 0].tolist()) == [0, 1]


def test_queries_read_rows_and_columns_of_the_centred_circuits(model):
    QKc, OVc, dqk, dov = _dense_centred(model, 0, 0)
    cases = {"attends_to": (QKc[7], dqk[7]), "attended_by": (QKc[:, 7], dqk[:, 7]), "copies_to": (OVc[7], dov[7])}
    for mode, (row, bound) in cases.items():
        got = circuit_query(model, 0, 0, 7, mode, k=5)
        values, ids = torch.topk(row, 6)
        # the ids are decided: neighbours among the oracle's top 6 lie further apart than their two bounds
        assert bool((values[:-1] - values[1:] > bound[ids[:-1]] + bound[ids[1:]]).all()), "near-tied entries"
        assert [g[0] for g in got] == ids[:5].tolist()
        assert_within(torch.tensor([g[2] for g in got]), values[:5], bound[ids[:5]])
        assert got[0][1] == f"t{ids[0]}"
    with pytest.raises(ValueError, match="mode must be one of"):
        circuit_query(model, 0, 0, 7, "writes_to")
    with pytest.raises(ValueError, match="vocab id"):
        circuit_query(model, 0, 0, 60, "copies_to")


def test_deeper_models_are_refused_unless_approximate_and_rotary_ones_read_at_an_offset():
    deep = paper_model(n_layers=2, d_vocab=30, dtype=torch.float32)
    with pytest.raises(ValueError, match="approximate=True"):
        skip_trigrams(deep, 1, 0)
    approx = skip_trigrams(deep, 1, 0, k=5, approximate=True)
    _assert_top_scores([r.score for r in approx], *_dense_centred(deep, 1, 0))  # layer 1 reads the raw W_E
    # rotary at offset 0 is the position-free circuit (R(0) = I); other offsets: tests/test_rotary_circuits.py
    at_zero = skip_trigrams(custom_model(n_layers=1, positional="rotary"), 0, 0, k=5, offset=0)
    plain = skip_trigrams(custom_model(n_layers=1, positional="none"), 0, 0, k=5)
    assert [(r.source, r.destination, r.out, r.offset) for r in at_zero] == [(r.source, r.destination, r.out, 0) for r in plain]
    with pytest.raises(ValueError, match="out of range"):
        skip_trigrams(deep, 2, 0, approximate=True)


def test_centred_factors_reproduce_the_centred_circuits(model):
    q, k, v, u = centred_factors(model, 0, 1)
    QKc, OVc, dqk, dov = _dense_centred(model, 0, 1)
    assert_within(q @ k.T, QKc, dqk)
    assert_within(v @ u, OVc, dov)


def test_vocab_subset_equals_the_model_restricted_to_those_tokens(model):
    ids = torch.tensor([3, 8, 9, 15, 22, 40, 41, 57])
    sub = skip_trigrams(model, 0, 0, k=10, vocab=ids)
    # the head reads each token's embedding divided by its layer-norm scale (one-layer model: exact)
    _assert_top_scores([r.score for r in sub], *_dense_centred(model, 0, 0, vocab=ids))
    assert all(r.source in ids and r.destination in ids and r.out in ids for r in sub)
    with pytest.raises(ValueError, match="vocab must be"):
        skip_trigrams(model, 0, 0, vocab=[70])


@pytest.fixture(params=screen.describe().usable())
def screened(request, monkeypatch):
    """Every screen route this machine's probe accepts (not only the default one), with a small
    seed so the low-precision screen, not the exact seed, decides most sources, and column tiles
    of 32 so a rotary search's per-offset screen skips some tiles (at 1024 a test vocabulary is one)."""
    st = importlib.import_module("pycircuits_widgets.analysis.skip_trigrams")
    monkeypatch.setattr(st, "SEED_SOURCES", 4)
    monkeypatch.setattr(screen, "TILE_COLS", 32)
    monkeypatch.setattr(screen, "exact_route", lambda device_type="cpu": request.param)
    return request.param


@pytest.mark.parametrize("case", ["near_ties", "norms_spread_e9"])
def test_screened_search_equals_brute_force_on_adversarial_factors(screened, case):
    g = torch.Generator().manual_seed(11)
    V, r = 150, 8
    shapes = ((V, r), (V, r), (V, r), (r, V))
    if case == "near_ties":  # integer factors: thousands of exactly tied triples, plus 1-ulp near-ties
        q, k, v, u = (torch.randint(-3, 4, shape, generator=g).float() for shape in shapes)
        k[::7] *= 1 + 2.0**-23
    else:  # source and destination norms spread over e^±9
        q, k, v, u = (torch.randn(*shape, generator=g) for shape in shapes)
        for x in (q, k, v):
            x *= torch.exp(torch.rand(V, 1, generator=g) * 18 - 9)
    score, idx, _ = top_skip_trigrams(q, k, v, u, 60, block_bytes=V * 4 * 16)
    QK, OV = q.double() @ k.double().T, v.double() @ u.double()  # [dest, src], [src, out]
    dqk, dov = product_tol(q, k.T, computations=1), product_tol(v, u, computations=1)  # ours: float32 products
    _assert_top_scores(score, QK, OV, dqk, dov)
    s, d, o = idx.unbind(1)
    assert_within(score, QK[d, s] * OV[s, o], score_tol(QK[d, s], OV[s, o], dqk[d, s], dov[s, o]))


def _rotary_pairs(r: int, offsets, base: float = 100.0, rotary_dim: int | None = None) -> torch.Tensor:
    """Rotary maps (GPT-NeoX layout: dims ``i`` and ``i + half`` turn together by ``offset * base^(-i/half)``)
    at each offset, identity beyond ``rotary_dim``, written here from the rotary definition."""
    rotary_dim = rotary_dim or r
    half = rotary_dim // 2
    R = torch.eye(r).repeat(len(offsets), 1, 1)
    for t, o in enumerate(offsets):
        for i in range(half):
            a = o * base ** (-i / half)
            R[t, i, i] = R[t, i + half, i + half] = math.cos(a)
            R[t, i, i + half], R[t, i + half, i] = math.sin(a), -math.sin(a)
    return R


def _maps(kind: str, r: int, g) -> torch.Tensor:
    if kind == "dense":  # one block: every dim mixes with every other
        return torch.linalg.qr(torch.randn(5, r, r, generator=g)).Q
    return _rotary_pairs(r, range(0, 8), rotary_dim=r - 2)  # frequency pairs, two dims that never turn


@pytest.mark.parametrize("kind", ["dense", "rotary"])
def test_window_bound_is_above_every_maps_entry_and_close_for_rotary_pairs(kind):
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(300, 16, generator=g, dtype=torch.float64), torch.randn(200, 16, generator=g, dtype=torch.float64)
    R = _maps(kind, 16, g).double() * 1.3
    qw, kw = window_bound(q, k, R)
    truth = torch.stack([k @ (q @ Rt).T for Rt in R]).amax(0)  # [src, dest]: max over the maps
    bound = kw @ qw.T
    # float64 throughout: sums of ~40 terms of size <= ~25 round by < 1e-12, the spectral norms' backward
    # error is ~1e-14; the margin 1e-9 is far above both and far below any real violation
    assert (bound >= truth - 1e-9).all()
    if kind == "rotary":  # slow pairs barely turn over 8 offsets: the bound on each source's best is near it
        assert float((bound.amax(1) / truth.amax(1)).median()) < 1.6


@pytest.mark.parametrize("kind", ["dense", "rotary"])
def test_screened_search_over_a_window_of_rotations_equals_brute_force(screened, kind):
    # one search for the whole window: each triple's QK factor is its largest over the maps R[t]
    # (scaled by 1.3, as rotary attention scaling does), the screens deciding most sources
    g = torch.Generator().manual_seed(5)
    V, r = 180, 8
    q, k, v = (torch.randn(V, r, generator=g) * torch.exp(torch.rand(V, 1, generator=g) * 4 - 2) for _ in range(3))
    u = torch.randn(r, V, generator=g)
    R = _maps(kind, r, g) * 1.3
    score, idx, at = top_skip_trigrams(q, k, v, u, 60, block_bytes=V * 4 * 16, R=R)
    QK = torch.stack([q.double() @ Rt.double() @ k.double().T for Rt in R])  # [map, dest, src]
    QKmax, OV = QK.amax(0), v.double() @ u.double()
    # ours: float32 products q R k^T (any order) and v u; a maximum over maps moves by at most the largest bound
    dqk = torch.stack([product_tol(q, Rt, k.T, computations=1) for Rt in R]).amax(0)
    dov = product_tol(v, u, computations=1)
    _assert_top_scores(score, QKmax, OV, dqk, dov)
    s, d, o = idx.unbind(1)
    assert_within(score, QKmax[d, s] * OV[s, o], score_tol(QKmax[d, s], OV[s, o], dqk[d, s], dov[s, o]))
    # each triple at its strongest map: ours picks it among float32 entries, each within dqk of its exact one
    assert (QK[at, d, s] >= QKmax[d, s] - 2 * dqk[d, s]).all()
    assert len(set(map(tuple, idx.tolist()))) == len(idx)  # no triple twice
    assert at.unique().numel() > 1  # the window matters: the best triples peak at different maps


@pytest.mark.parametrize("weight, bad", [("W_Q", float("nan")), ("W_V", -float("inf")), ("W_U", float("inf"))])
def test_non_finite_weights_are_refused_by_name(weight, bad):
    # NaN compares false everywhere: without the check the top-k would come back empty, not fail
    m = paper_model(n_layers=1, n_heads=2, d_model=16, d_head=4, d_vocab=60, dtype=torch.float32)
    w = getattr(m, weight).clone()
    w.view(-1)[w.numel() // 2] = bad
    setattr(m, weight, w)
    with pytest.raises(ValueError, match="L0.H1 are not finite"):
        skip_trigrams(m, 0, 1, k=5)


def test_triple_entries_are_the_dense_centred_circuits_entries(model):
    QKc, OVc, dqk, dov = _dense_centred(model, 0, 1)
    idx = torch.tensor([[3, 7, 11], [0, 0, 0], [59, 1, 30], [12, 12, 59]])  # (src, dest, out)
    qk, ov = triple_entries(*centred_factors(model, 0, 1), idx)
    s, d, o = idx.unbind(1)
    assert_within(qk, QKc[d, s], dqk[d, s])
    assert_within(ov, OVc[s, o], dov[s, o])
