"""Skip-trigram top-k against brute force over the dense [src, dest, out] score tensor."""

import importlib
import math

import pytest
import torch
from random_models import custom_model, paper_model

from pycircuits_widgets import screen
from pycircuits_widgets.analysis import circuit_query, full_ov_circuit, full_qk_circuit, skip_trigrams
from pycircuits_widgets.analysis.skip_trigrams import centred_factors, top_skip_trigrams, triple_entries, window_bound


def _dense_centred(model, layer, head):
    QK = full_qk_circuit(model, layer, head).dense()  # [dest, src]
    OV = full_ov_circuit(model, layer, head).dense()  # [src, out]
    return QK - QK.mean(1, keepdim=True), OV - OV.mean(1, keepdim=True)


def _brute_force(QKc, OVc, k):
    score = QKc.T.clamp_min(0)[:, :, None] * OVc.clamp_min(0)[:, None, :]  # [src, dest, out]
    return torch.topk(score.flatten(), k).values


@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=1, n_heads=2, d_model=16, d_head=4, d_vocab=60, dtype=torch.float32)


def test_top_triples_equal_brute_force_with_scores_and_strings(model):
    QKc, OVc = _dense_centred(model, 0, 1)
    result = skip_trigrams(model, 0, 1, k=25)
    assert len(result) == 25
    torch.testing.assert_close(torch.tensor([r.score for r in result]), _brute_force(QKc, OVc, 25))
    for r in result:
        assert r.qk == pytest.approx(float(QKc[r.destination, r.source]), rel=1e-4, abs=1e-4)
        assert r.ov == pytest.approx(float(OVc[r.source, r.out]), rel=1e-4, abs=1e-4)
        assert r.qk > 0 and r.ov > 0 and r.score == pytest.approx(r.qk * r.ov, rel=1e-4)
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
    dense = (q @ kk.T).T.clamp_min(0)[:, :, None] * (v @ u).clamp_min(0)[:, None, :]
    torch.testing.assert_close(score, torch.topk(dense.flatten(), k).values)
    torch.testing.assert_close(dense[idx[:, 0], idx[:, 1], idx[:, 2]], score)


def test_fewer_positive_triples_than_k_returns_them_all():
    q = torch.tensor([[1.0], [-1.0]])
    score, idx, _ = top_skip_trigrams(q, q.clone(), q.clone(), q.T.clone(), 50)
    # qk[d, s] = q_d k_s and ov[s, o] = v_s u_o: positive pairs need d = s sign-wise and o = s
    assert score.tolist() == [1.0, 1.0] and sorted(idx[:, 0].tolist()) == [0, 1]


def test_queries_read_rows_and_columns_of_the_centred_circuits(model):
    QKc, OVc = _dense_centred(model, 0, 0)
    cases = {"attends_to": QKc[7], "attended_by": QKc[:, 7], "copies_to": OVc[7]}
    for mode, row in cases.items():
        got = circuit_query(model, 0, 0, 7, mode, k=5)
        values, ids = torch.topk(row, 5)
        assert [g[0] for g in got] == ids.tolist()
        torch.testing.assert_close(torch.tensor([g[2] for g in got]), values, rtol=1e-4, atol=1e-4)
        assert got[0][1] == f"t{ids[0]}"
    with pytest.raises(ValueError, match="mode must be one of"):
        circuit_query(model, 0, 0, 7, "writes_to")
    with pytest.raises(ValueError, match="vocab id"):
        circuit_query(model, 0, 0, 60, "copies_to")


def test_deeper_models_are_refused_unless_approximate_and_rotary_ones_read_at_an_offset():
    deep = paper_model(n_layers=2, d_vocab=30, dtype=torch.float32)
    with pytest.raises(ValueError, match="approximate=True"):
        skip_trigrams(deep, 1, 0)
    QKc, OVc = _dense_centred(deep, 1, 0)
    approx = skip_trigrams(deep, 1, 0, k=5, approximate=True)
    torch.testing.assert_close(torch.tensor([r.score for r in approx]), _brute_force(QKc, OVc, 5))
    # rotary at offset 0 is the position-free circuit (R(0) = I); other offsets: tests/test_rotary_circuits.py
    at_zero = skip_trigrams(custom_model(n_layers=1, positional="rotary"), 0, 0, k=5, offset=0)
    plain = skip_trigrams(custom_model(n_layers=1, positional="none"), 0, 0, k=5)
    assert [(r.source, r.destination, r.out, r.offset) for r in at_zero] == [(r.source, r.destination, r.out, 0) for r in plain]
    with pytest.raises(ValueError, match="out of range"):
        skip_trigrams(deep, 2, 0, approximate=True)


def test_centred_factors_reproduce_the_centred_circuits(model):
    q, k, v, u = centred_factors(model, 0, 1)
    QKc, OVc = _dense_centred(model, 0, 1)
    torch.testing.assert_close(q @ k.T, QKc, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v @ u, OVc, rtol=1e-4, atol=1e-4)


def test_vocab_subset_equals_the_model_restricted_to_those_tokens(model):
    ids = torch.tensor([3, 8, 9, 15, 22, 40, 41, 57])
    sub = skip_trigrams(model, 0, 0, k=10, vocab=ids)
    # the head reads each token's embedding divided by its layer-norm scale (one-layer model: exact)
    E = torch.nn.functional.layer_norm(model.W_E, (model.cfg.d_model,), eps=model.cfg.eps)[ids]
    U = model.W_U[:, ids]
    QK = E @ model.W_Q[0, 0] @ model.W_K[0, 0].T @ E.T
    OV = E @ model.W_V[0, 0] @ model.W_O[0, 0] @ U
    expected = _brute_force(QK - QK.mean(1, keepdim=True), OV - OV.mean(1, keepdim=True), 10)
    torch.testing.assert_close(torch.tensor([r.score for r in sub]), expected, rtol=1e-4, atol=1e-5)
    assert all(r.source in ids and r.destination in ids and r.out in ids for r in sub)
    with pytest.raises(ValueError, match="vocab must be"):
        skip_trigrams(model, 0, 0, vocab=[70])


@pytest.fixture(params=screen.exact_routes())
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
    torch.testing.assert_close(score.double(), _brute_force(QK, OV, 60), rtol=1e-6, atol=0)
    s, d, o = idx.unbind(1)
    torch.testing.assert_close(QK[d, s] * OV[s, o], score.double(), rtol=1e-6, atol=0)


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
    torch.testing.assert_close(score.double(), _brute_force(QKmax, OV, 60), rtol=1e-6, atol=0)
    s, d, o = idx.unbind(1)
    torch.testing.assert_close(QK[at, d, s] * OV[s, o], score.double(), rtol=1e-6, atol=0)
    assert (QK[at, d, s] >= QKmax[d, s] * (1 - 1e-6)).all()  # each triple at its strongest map
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
    QKc, OVc = _dense_centred(model, 0, 1)
    idx = torch.tensor([[3, 7, 11], [0, 0, 0], [59, 1, 30], [12, 12, 59]])  # (src, dest, out)
    qk, ov = triple_entries(*centred_factors(model, 0, 1), idx)
    torch.testing.assert_close(qk, QKc[idx[:, 1], idx[:, 0]], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ov, OVc[idx[:, 0], idx[:, 2]], rtol=1e-4, atol=1e-4)
