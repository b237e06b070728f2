"""Composition scores against dense norms and TransformerLens's composition_scores, same weights.

Oracles: dense float64 products of explicitly projected weights (``P = I - 11^T / d``: layer norm
never reads the all-ones direction), TransformerLens's ``composition_scores`` on those weights and
its own folded ``TransformerBridge``, the model's own forward (function-preserving changes,
rotary scores), and a complex-number rotation written here.

Tolerances: most comparisons run in float64 (``random_models`` builds float64 models): there a score,
a ratio of Frobenius norms of products of at most 768 x 768 matrices, carries relative rounding of
order ``factorization_tol(d_model, 1, float64)`` (~1e-13 here), far below the fixed float64 margins
(1e-10 and assert_close's float64 defaults, 1e-7). Float32 scores are held to the relative error
``composition_scores`` states and guards, ``FALLBACK_RELATIVE_ERROR`` (its probabilistic estimate of the
Gram route's error recomputes any pair that could exceed it); TransformerLens's float32 SVD norms to
``factorization_tol``; the forward's float32 rotary tables to ``rotary_table_tol``.
"""

import itertools

import pytest
import torch
from transformer_lens.FactoredMatrix import FactoredMatrix as TLFactoredMatrix
from transformer_lens.utilities.matrix import composition_scores as tl_composition_scores

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import composition as composition_module
from pycircuits_widgets.analysis import composition_detail, composition_scores, random_baseline
from pycircuits_widgets.analysis.composition import composition_baseline, rotation
from pycircuits_widgets.analysis.rotary import matmul_rotation, rotation_matmul, rotation_parts, rotations
from random_models import custom_model, paper_model
from test_adapters import SHAPE, native_bridge
from tolerance import assert_within, factorization_tol, product_tol, rotary_table_tol


@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=3, n_heads=4, d_model=32, d_head=4, d_vocab=30)


def _visible(model):
    """(W_Q, W_K, W_V, W_O) as a layer-normed stream sees them: readers P @ W, writers W @ P."""
    d = model.cfg.d_model
    P = torch.eye(d, dtype=model.W_Q.dtype) - torch.full((d, d), 1.0 / d, dtype=model.W_Q.dtype)
    if model.cfg.normalization != "layernorm":
        P = torch.eye(d, dtype=model.W_Q.dtype)
    return P @ model.W_Q, P @ model.W_K, P @ model.W_V, model.W_O @ P


def _dense_composed(model, kind, h1, h2):
    """The composed [d_model, d_model] matrix in the row convention, from explicit products."""
    W_Q, W_K, W_V, W_O = _visible(model)
    OV1 = W_V[h1] @ W_O[h1]
    QK2 = W_Q[h2] @ W_K[h2].T
    second = {"Q": QK2, "K": QK2.T, "V": W_V[h2] @ W_O[h2]}[kind]
    return OV1, second, OV1 @ second


def _tl_scores(model, kind):
    # exactly what TransformerBridge.all_composition_scores builds, then its [l1 < l2] mask
    W_Q, W_K, W_V, W_O = _visible(model)
    left = TLFactoredMatrix(W_V, W_O)
    qk = TLFactoredMatrix(W_Q, W_K.mT)
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
    rtol = composition_module.FALLBACK_RELATIVE_ERROR  # the float32 route's guarded error; float64's is far below
    torch.testing.assert_close(ours32.double(), ours64, rtol=rtol, atol=0, equal_nan=True)


def _paper_factors(model, kind, h1, h2):
    """The paper's (column-convention) product X1 X2 X3 X4, each factor transposed from our weights:
    Q: W_K^T W_Q W_O W_V, K: W_Q^T W_K W_O W_V, V: W_O^{h2} W_V^{h2} W_O^{h1} W_V^{h1}."""
    W_Q, W_K, W_V, W_O = _visible(model)
    V1, O1 = W_V[h1].T, W_O[h1].T  # paper shapes [d_head, d_model], [d_model, d_head]
    Q2, K2, V2, O2 = W_Q[h2].T, W_K[h2].T, W_V[h2].T, W_O[h2].T
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
        assert torch.allclose(torch.trace(rotated), torch.trace(truth))  # same trace (float64) ...
        assert abs(float(rotated.norm() - truth.norm())) > 1e-3 * float(truth.norm())  # ... not the same norm
        torch.testing.assert_close(erratum[h1 + h2], rotated.norm() / (n1.norm() * n2.norm()))


def test_the_ambiguous_erratum_name_is_refused_naming_both_forms(model):
    with pytest.raises(ValueError, match="erratum_left.*erratum_right"):
        composition_scores(model, "K", norm="erratum")


def test_baseline_is_the_mean_score_of_random_heads_and_is_subtracted(model):
    with_baseline = composition_scores(model, "V")
    without = composition_scores(model, "V", baseline=False)
    b = random_baseline(model.cfg.d_model - 1, model.cfg.d_head)  # layer norm: d_model - 1 directions
    assert composition_baseline(model) == b
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
        assert d.positivity == pytest.approx(float(ev.sum().real / ev.abs().sum()), abs=1e-6)  # float64 spectra


def test_bad_arguments_are_named(model):
    with pytest.raises(ValueError, match="kind must be one of"):
        composition_scores(model, "O")
    with pytest.raises(ValueError, match="norm must be one of"):
        composition_scores(model, "Q", norm="cyclic")
    with pytest.raises(ValueError, match="earlier layer"):
        composition_detail(model, "K", (1, 0), (1, 1))


def _shifted(model, seed=3):
    """``model`` with ``1 v^T`` added to every reader and ``u 1^T`` to every writer of heads: a
    change layer norm cannot see (it centres what it reads)."""
    g = torch.Generator().manual_seed(seed)
    L, H, dh = model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_head
    weights = {n: getattr(model, n) for n in ("W_E", "W_U", "W_pos", "W_in", "W_out")}
    for name in ("W_Q", "W_K", "W_V"):
        weights[name] = getattr(model, name) + torch.randn(L, H, 1, dh, generator=g, dtype=model.W_Q.dtype)
    weights["W_O"] = model.W_O + torch.randn(L, H, dh, 1, generator=g, dtype=model.W_Q.dtype)
    return pcw.models.CircuitModel(model.cfg, tokenizer=model.tokenizer, **weights)


def test_a_function_preserving_reader_shift_leaves_every_score_unchanged():
    model = custom_model(n_layers=3, n_heads=3, d_model=24, d_head=6, positional="learned")
    shifted = _shifted(model)
    tokens = torch.arange(12) % 40
    torch.testing.assert_close(shifted(tokens), model(tokens))  # the model computes the same function
    for kind in "QKV":
        for norm in composition_module.NORMS:
            before = composition_scores(model, kind, baseline=False, norm=norm)
            after = composition_scores(shifted, kind, baseline=False, norm=norm)
            torch.testing.assert_close(after, before, rtol=1e-10, atol=1e-12, equal_nan=True)
    # the raw weights did change, and the shift is not invisible without layer norm
    assert (shifted.W_Q - model.W_Q).abs().min() > 0
    rms = custom_model(n_layers=3, n_heads=3, d_model=24, d_head=6, positional="learned", normalization="rmsnorm")
    assert not torch.allclose(composition_scores(_shifted(rms), "K", False), composition_scores(rms, "K", False),
                              equal_nan=True)


@pytest.mark.parametrize("kind", ["Q", "K", "V"])
def test_agrees_with_transformer_lens_folded_bridge(kind):
    """TransformerLens 4.3 folds and centres the weights itself (enable_compatibility_mode); we adapt
    the unprocessed twin. Layer norm with learned scale and bias, learned positions, MLPs."""
    options = {"act_fn": "gelu", "normalization_type": "LN"}
    ours = composition_scores(pcw.from_transformer_lens(native_bridge(seed=4, **options)), kind, baseline=False)
    folded = native_bridge(seed=4, **options)
    folded.enable_compatibility_mode(disable_warnings=True)
    theirs = torch.as_tensor(folded.all_composition_scores(kind).scores)
    defined = ~ours.isnan()
    # both float32: ours within its guarded relative error; theirs, norms from SVDs, within three
    # factorization bounds of a score <= 1 (the folded weights' own roundings are far smaller)
    atol = factorization_tol(SHAPE["d_model"], 1.0, torch.float32, computations=3)
    torch.testing.assert_close(ours[defined], theirs[defined].to(ours.dtype),
                               rtol=composition_module.FALLBACK_RELATIVE_ERROR, atol=atol)


def test_shipped_two_layer_model_matches_transformer_lens_on_centred_weights():
    model = pcw.load_pretrained("attn-only-2l").to(torch.float64)
    for kind in "QKV":
        ours = composition_scores(model, kind, baseline=False)
        theirs, defined = _tl_scores(model, kind)
        torch.testing.assert_close(ours[defined], theirs[defined], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("shape", [{"n_layers": 4, "n_heads": 3, "d_model": 40, "d_head": 5},
                                   {"n_layers": 5, "n_heads": 7, "d_model": 37, "d_head": 3}])
@pytest.mark.parametrize("kind", ["Q", "K", "V"])
def test_gram_route_equals_dense_float64_products(monkeypatch, shape, kind):
    """Small tiles and one-layer row chunks, so every tile (diagonal, off-diagonal, ragged) and
    chunk boundary of the Gram route is exercised against dense d_model x d_model products."""
    model = custom_model(**shape, positional="learned")
    default = composition_scores(model, kind, baseline=False)
    monkeypatch.setattr(composition_module, "TILE", 8)
    monkeypatch.setattr(composition_module, "MIN_CHUNK_ROWS", 1)
    tiled = composition_scores(model, kind, baseline=False)
    W_Q, W_K, W_V, W_O = _visible(model)
    OV, QK = W_V @ W_O, W_Q @ W_K.mT  # [L, H, d_model, d_model], dense
    second = {"Q": QK, "K": QK.mT, "V": OV}[kind]
    composed = torch.einsum("ahij,bgjk->ahbgik", OV, second).square().sum((-2, -1)).sqrt()
    expected = composed / (OV.norm(dim=(-2, -1))[:, :, None, None] * second.norm(dim=(-2, -1)))
    L = shape["n_layers"]
    later = (torch.arange(L)[:, None, None, None] < torch.arange(L)[None, None, :, None]).expand_as(expected)
    for scores in (default, tiled):
        assert scores[~later].isnan().all()
        torch.testing.assert_close(scores[later], expected[later], rtol=1e-10, atol=0)


def _exact_float64(model, kind, offset=None):
    """All pairs in float64 by the QR route (||R_A (B C) R_D^T||), written here independently
    (``offset``: h2's queries rotated at that offset, ``rotation``: checked against the forward)."""
    W_Q, W_K, W_V, W_O = (w.double() for w in _visible(model))
    if offset is not None:
        R = torch.stack([rotation(model.cfg, offset, layer=layer) for layer in range(model.cfg.n_layers)])
        W_Q = W_Q @ R[:, None]
    second = {"Q": (W_Q, W_K.mT), "K": (W_K, W_Q.mT), "V": (W_V, W_O)}[kind]
    R1 = torch.linalg.qr(W_V, mode="r").R
    R2 = torch.linalg.qr(second[1].mT, mode="r").R
    left, right = R1 @ W_O, second[0] @ R2.mT  # [L, H, r, d], [L, H, d, r]
    num = torch.einsum("ahrd,bgds->ahbgrs", left, right).square().sum((-2, -1)).sqrt()
    return num / (left.square().sum((-2, -1)).sqrt()[:, :, None, None] * right.square().sum((-2, -1)).sqrt())


def test_float32_error_bound_at_a_realistic_shape():
    """GPT-2-small head shapes (d_model 768, d_head 64), 3 layers x 12 heads, float32 against the
    float64 QR route: within the stated FALLBACK_RELATIVE_ERROR of every score."""
    model = custom_model(n_layers=3, n_heads=12, d_model=768, d_head=64, positional="learned")
    exact = _exact_float64(model, "K")
    ours = composition_scores(model.to(torch.float32), "K", baseline=False).double()
    defined = ~ours.isnan()
    relative = ((ours - exact).abs() / exact)[defined]
    print(f"\nfloat32 Gram route, max relative error {relative.max():.2e}")
    assert relative.max() < composition_module.FALLBACK_RELATIVE_ERROR


def test_near_zero_compositions_fall_back_to_the_exact_route():
    """Layer-0 heads write into dims 0..7 only; layer-1 heads read those dims with weight 1e-4, so
    ||A B C D|| << ||A B|| ||C D|| and the float32 Gram inner product alone would be mostly
    rounding error. The guard recomputes those pairs: relative error stays below the bound."""
    model = custom_model(n_layers=2, n_heads=4, d_model=64, d_head=8, positional="learned", normalization=None)
    model.W_O[0, :, :, 8:] = 0
    model.W_Q[1, :, :8] *= 1e-4
    model.W_K[1, :, :8] *= 1e-4
    model.W_V[1, :, :8] *= 1e-4
    for kind in "QKV":
        exact = _exact_float64(model, kind)
        assert exact[0, :, 1].max() < 1e-3
        ours = composition_scores(model.to(torch.float32), kind, baseline=False).double()
        relative = ((ours - exact).abs() / exact)[0, :, 1]
        assert relative.max() < composition_module.FALLBACK_RELATIVE_ERROR, (kind, relative.max())


def _rotary_model(**kw):
    return custom_model(n_layers=2, n_heads=2, d_model=16, d_head=8, positional="rotary", rotary_dim=6, **kw)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 4}


@pytest.mark.parametrize("kw, layer", [({}, 0), ({}, 1), ({"rope": LLAMA3}, 1),
                                       ({"rotary_layers": [True, False]}, 0), ({"rotary_layers": [True, False]}, 1)])
def test_rotation_is_the_map_between_rotated_queries_and_keys_in_the_forward(kw, layer):
    # per layer, under the forward's own frequency rule (llama3 rescaling, a layer that does not rotate)
    model = _rotary_model(**kw)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 12, 8, generator=g, dtype=torch.float64), torch.randn(1, 1, 12, 8, generator=g,
                                                                                   dtype=torch.float64)
    scores = model._rotate(q, layer)[0, 0] @ model._rotate(k, layer)[0, 0].T  # what the forward computes
    for t, s in [(5, 5), (7, 2), (11, 0)]:
        expected = q[0, 0, t] @ rotation(model.cfg, t - s, layer=layer) @ k[0, 0, s]
        # the forward's tables are float32 (rotary_table_tol); the rest float64
        tol = 2 * (rotary_table_tol(t) + rotary_table_tol(s)) * float(q[0, 0, t].norm() * k[0, 0, s].norm())
        assert abs(float(scores[t, s] - expected)) <= tol
    if kw.get("rotary_layers") and layer == 1:
        torch.testing.assert_close(rotation(model.cfg, 7, layer=layer), torch.eye(8, dtype=torch.float64))
    if "rope" in kw:  # the rule changes the map: the default frequencies would not match
        assert not torch.allclose(rotation(model.cfg, 7, layer=layer), rotation(_rotary_model().cfg, 7, layer=layer))


@pytest.mark.parametrize("kw, layer", [({}, 0), ({"rope": LLAMA3}, 1), ({"rotary_layers": [True, False]}, 1)])
def test_rotation_products_from_its_two_nonzeros_per_row_equal_the_dense_products(kw, layer):
    model = _rotary_model(**kw)
    offsets = [0, 3, 11]
    R = rotations(model.cfg, offsets, layer=layer)  # [3, 8, 8]
    diagonal, paired, partner = rotation_parts(model.cfg, offsets, layer=layer)
    parts = (diagonal[:, None], paired[:, None], partner)  # broadcast over a batch of 4 matrices
    M = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # float64 both ways: two evaluations of the same product
    assert_within(rotation_matmul(parts, M), R[:, None] @ M, product_tol(R[:, None], M))
    assert_within(matmul_rotation(M, parts), M @ R[:, None], product_tol(M, R[:, None]))
    assert int((R != 0).sum(-1).max()) <= 2  # the structure the parts describe


def test_rotary_qk_composition_needs_offsets_and_is_scored_at_each():
    model = _rotary_model()
    for kind in "QK":
        with pytest.raises(ValueError, match=f"{kind}-composition of a rotary model depends on the relative position"):
            composition_scores(model, kind)
    composition_scores(model, "V")  # V-composition is defined without offsets
    with pytest.raises(ValueError, match="V-composition never depends on position"):
        composition_scores(model, "V", offsets=[0])
    with pytest.raises(ValueError, match="not rotary"):
        composition_scores(custom_model(), "K", offsets=[0, 1])
    scores = composition_scores(model, "K", baseline=False, offsets=range(0, 6))
    assert scores.shape == (6, 2, 2, 2, 2)
    # oracle: queries rotated as complex numbers (dims i and i + 3 of the 6 rotary dims)
    W_Q, W_K, W_V, W_O = _visible(model)
    theta = model.cfg.rotary_base ** (-torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    for offset in range(6):
        z = torch.complex(W_Q[1, 1][:, :3], W_Q[1, 1][:, 3:6]) * torch.exp(1j * offset * theta)
        Q_rot = torch.cat([z.real, z.imag, W_Q[1, 1][:, 6:]], -1)
        QK = Q_rot @ W_K[1, 1].T
        OV = W_V[0, 0] @ W_O[0, 0]
        expected = (OV @ QK.T).norm() / (OV.norm() * QK.norm())
        torch.testing.assert_close(scores[offset, 0, 0, 1, 1], expected)
    spread = scores[:, 0, :, 1, :].amax(0) - scores[:, 0, :, 1, :].amin(0)
    assert spread.min() > 1e-4  # the score really moves with the offset


def _exact_rotary_float64(model, kind, offsets):
    """``[n_offsets, L, H, L, H]``: ``_exact_float64`` at each offset, NaN where ``l1 >= l2``."""
    L = model.cfg.n_layers
    defined = torch.arange(L)[:, None, None, None] < torch.arange(L)[None, None, :, None]
    return torch.stack([_exact_float64(model, kind, o).masked_fill(~defined, float("nan")) for o in offsets])


@pytest.mark.parametrize("kw", [{}, {"rope": LLAMA3}, {"rotary_layers": [True, False, True]},
                                {"normalization": "rmsnorm"}])
@pytest.mark.parametrize("kind", ["Q", "K"])
def test_window_route_equals_every_offset_scored_alone(kind, kw):
    """The window route (the offset-free Z = X1^T W2 once, then d_head^2 per pair and offset) against the
    float64 QR route at each offset, and against the Gram route it replaces, on layer norm (centred
    readers and writers), llama3 frequencies and a layer that does not rotate."""
    model = custom_model(n_layers=3, n_heads=2, d_model=24, d_head=8, positional="rotary", rotary_dim=6, **kw)
    offsets = [0, 1, 5, 12, 15]
    window = composition_module._window_correct_scores(model, kind, offsets)
    torch.testing.assert_close(window, _exact_rotary_float64(model, kind, offsets), equal_nan=True)
    each = torch.stack([composition_module._correct_scores(model, kind, o) for o in offsets])
    torch.testing.assert_close(window, each, equal_nan=True)
    assert window.isnan().sum() == len(offsets) * 2 * 2 * (3 * 3 - 3)  # l1 >= l2 only
    if not kw.get("rotary_layers"):  # the scores move with the offset (a layer that does not rotate stays)
        assert float((window.nan_to_num().amax(0) - window.nan_to_num().amin(0)).max()) > 1e-3


@pytest.mark.parametrize("kind", ["Q", "K"])
def test_rotary_erratum_scores_at_each_offset_of_a_window(kind):
    """The left erratum (the view's panel) is taken once for a window: each offset's entry equals the
    pair's own products at that offset (``_pair_scores`` on dense factors); the right erratum, whose
    rotation sits between factors, is scored at each offset and moves with it."""
    model = _rotary_model(rope=LLAMA3)
    offsets = [0, 2, 9]
    for norm in ("erratum_left", "erratum_right"):
        table = composition_scores(model, kind, baseline=False, norm=norm, offsets=offsets)
        for i, offset in enumerate(offsets):
            for h1, h2 in [(0, 1), (1, 0)]:
                A1, B1, C2, D2 = composition_module._pair_factors(model, kind, 0, h1, 1, h2, offset)
                expected = composition_module._pair_scores(A1, B1, C2, D2, norm)
                torch.testing.assert_close(table[i, 0, h1, 1, h2], expected)
        moves = float((table.nan_to_num().amax(0) - table.nan_to_num().amin(0)).max())
        assert (moves > 1e-4) == (norm == "erratum_right")


def _dense_erratum_right(model, kind, offsets):
    """``[n_offsets, L, H, L, H]`` right-erratum scores from explicit products of the visible weights,
    h2's queries rotated by the dense ``rotation``: Q ``||W_O1 W_Q R W_K^T W_V1||``, K ``||W_O1 W_K (W_Q
    R)^T W_V1||``, each over ``||W_O1 W_V1||`` and the norm of h2's own ``D2 C2``; NaN where ``l1 >= l2``."""
    W_Q, W_K, W_V, W_O = (w.double() for w in _visible(model))
    L, H = model.cfg.n_layers, model.cfg.n_heads
    out = torch.full((len(offsets), L, H, L, H), float("nan"), dtype=torch.float64)
    for i, offset in enumerate(offsets):
        for l1, h1, l2, h2 in itertools.product(range(L), range(H), range(L), range(H)):
            if l1 >= l2:
                continue
            Q_rot = W_Q[l2, h2] @ rotation(model.cfg, offset, layer=l2)
            C2, D2 = (Q_rot, W_K[l2, h2].T) if kind == "Q" else (W_K[l2, h2], Q_rot.T)
            num = (W_O[l1, h1] @ C2 @ D2 @ W_V[l1, h1]).norm()
            out[i, l1, h1, l2, h2] = num / ((W_O[l1, h1] @ W_V[l1, h1]).norm() * (D2 @ C2).norm())
    return out


@pytest.mark.parametrize("kw", [{}, {"rope": LLAMA3}, {"rotary_layers": [True, False, True]},
                                {"normalization": "rmsnorm"}])
@pytest.mark.parametrize("kind", ["Q", "K"])
def test_right_erratum_over_a_window_equals_every_offset_scored_alone(kind, kw):
    """The right erratum over a window (``P = X W_Q``, ``Q = W_K^T Y`` and their Grams once per pair, then a
    quadratic form in each offset's rotation) against explicit products at each offset and against the
    per-offset route it replaces; rotary_dim 6 of d_head 8 leaves two dims that do not rotate."""
    model = custom_model(n_layers=3, n_heads=2, d_model=24, d_head=8, positional="rotary", rotary_dim=6, **kw)
    offsets = [0, 1, 5, 12, 15]
    window = composition_module._window_erratum_right_scores(model, kind, offsets)
    torch.testing.assert_close(window, _dense_erratum_right(model, kind, offsets), equal_nan=True)
    each = torch.stack([composition_module._erratum_scores(*composition_module._model_factors(model, kind, o),
                                                           "erratum_right") for o in offsets])
    torch.testing.assert_close(window, each, equal_nan=True)
    if not kw.get("rotary_layers"):  # it moves with the offset
        assert float((window.nan_to_num().amax(0) - window.nan_to_num().amin(0)).max()) > 1e-3


@pytest.mark.parametrize("route, oracle", [("_window_correct_scores", _exact_rotary_float64),
                                           ("_window_erratum_right_scores", _dense_erratum_right)])
def test_window_routes_fall_back_to_the_direct_product_where_their_inner_product_may_cancel(monkeypatch, route,
                                                                                          oracle):
    """With no error allowed every entry takes the fallback (correct: ``||Z P(o)||_F^2``; right erratum:
    ``||(P R) Q||_F^2``): the same scores, so the fallback is right wherever the guard sends an entry."""
    model = custom_model(n_layers=3, n_heads=2, d_model=24, d_head=8, positional="rotary", rotary_dim=8)
    offsets = list(range(0, 16, 3))
    scores = getattr(composition_module, route)
    for kind in "QK":
        inner = scores(model, kind, offsets)
        monkeypatch.setattr(composition_module, "FALLBACK_RELATIVE_ERROR", 0.0)
        direct = scores(model, kind, offsets)
        monkeypatch.undo()
        torch.testing.assert_close(direct, inner, equal_nan=True)
        torch.testing.assert_close(direct, oracle(model, kind, offsets), equal_nan=True)


@pytest.mark.parametrize("route, kind, norm, short, oracle", [
    ("_window_correct_scores", "K", "correct", [7], _exact_rotary_float64),
    ("_window_erratum_right_scores", "Q", "erratum_right", [3, 7], _dense_erratum_right)])
def test_a_long_window_takes_the_window_route_and_a_short_one_each_offset(monkeypatch, route, kind, norm, short,
                                                                           oracle):
    """``composition_scores`` picks the route with fewer operations: a 100-offset window of a 12 x 4
    float32 model goes through the window route (both within the error the route states and guards, of
    the float64 oracle), a short one through the per-offset route."""
    model = custom_model(n_layers=12, n_heads=4, d_model=64, d_head=16, positional="rotary", rotary_dim=16,
                         n_ctx=128, normalization="rmsnorm").to(torch.float32)
    calls = []
    window_route = getattr(composition_module, route)
    monkeypatch.setattr(composition_module, route, lambda *args: calls.append(len(args[2])) or window_route(*args))
    scores = composition_scores(model, kind, baseline=False, norm=norm, offsets=range(100))
    composition_scores(model, kind, baseline=False, norm=norm, offsets=short)
    assert calls == [100]
    exact = oracle(model, kind, [0, 37, 99])
    relative = (scores[[0, 37, 99]].double() - exact).abs() / exact
    assert float(relative.nan_to_num().max()) < composition_module.FALLBACK_RELATIVE_ERROR


def test_rank_deficient_heads_are_scored_too():
    """A head whose W_V has rank 1 (Cholesky of its Gram fails) and an all-zero head: scores stay
    equal to the dense products, and the zero head's are NaN (0 / 0), not a plausible number."""
    model = custom_model(n_layers=2, n_heads=3, d_model=24, d_head=6, positional="learned")
    model.W_V[0, 0] = torch.outer(model.W_V[0, 0, :, 0], torch.ones(6, dtype=torch.float64))
    model.W_O[0, 1] = 0
    scores = composition_scores(model, "V", baseline=False)
    for h2 in range(3):
        OV1, second, composed = _dense_composed(model, "V", (0, 0), (1, h2))
        torch.testing.assert_close(scores[0, 0, 1, h2], composed.norm() / (OV1.norm() * second.norm()))
    assert scores[0, 1, 1].isnan().all()


def test_float32_thin_factors_of_rank_deficient_and_off_centre_heads():
    """The float32 path of ``_thin_factors``: Grams multiplied in float32, writers and readers
    centred after the product. A rank-1 W_V (its float32 Gram is singular up to rounding) and heads
    whose weights carry a large all-ones component (removed by layer norm, so the centring cancels
    it after rounding) stay within the stated error of the float64 QR route."""
    model = custom_model(n_layers=3, n_heads=4, d_model=96, d_head=8, positional="learned")
    model.W_V[0, 0] = torch.outer(model.W_V[0, 0, :, 0], torch.ones(8, dtype=torch.float64))
    model.W_O[0, 1] += 3.0  # every output gains 3 * 1: a mean the stream never sees
    model.W_Q[1, 2] += 3.0
    model.W_K[2, 0] -= 3.0
    model.W_V[1, 3] += 3.0
    for kind in "QKV":
        exact = _exact_float64(model, kind)
        ours = composition_scores(model.to(torch.float32), kind, baseline=False).double()
        defined = ~exact.isnan() & (torch.arange(3)[:, None, None, None] < torch.arange(3)[None, None, :, None])
        relative = ((ours - exact).abs() / exact)[defined]
        assert relative.max() < composition_module.FALLBACK_RELATIVE_ERROR, (kind, relative.max())


@pytest.mark.parametrize("d_model, d_head", [(32, 4), (6, 8)])
def test_baseline_sampler_matches_dense_gaussian_heads(d_model, d_head):
    """The correct-score baseline is drawn through d_head-sized factors (Bartlett); its samples
    must have the distribution of dense Gaussian heads' scores: mean and spread within a few
    standard errors of 20000 dense draws (d_model < d_head: the factors are the matrices)."""
    n = 20000
    sampled = composition_module._random_correct_scores(d_model, d_head, n, seed=3)
    g = torch.Generator().manual_seed(11)
    A1, C2 = (torch.randn(n, d_model, d_head, generator=g, dtype=torch.float64) for _ in range(2))
    B1, D2 = (torch.randn(n, d_head, d_model, generator=g, dtype=torch.float64) for _ in range(2))
    AB, CD = A1 @ B1, C2 @ D2  # dense [d_model, d_model]
    dense = (AB @ CD).norm(dim=(-2, -1)) / (AB.norm(dim=(-2, -1)) * CD.norm(dim=(-2, -1)))
    se = (sampled.var() / n + dense.var() / n).sqrt()
    assert abs(sampled.mean() - dense.mean()) < 4 * se
    assert abs(sampled.std() / dense.std() - 1) < 0.05
