"""Rotary QK circuits at a query - key offset, on tiny random LlamaForCausalLM models (GQA, gated MLP,
one with linear RoPE scaling) loaded through ``pcw.from_hf``.

Oracles are built from the Hugging Face modules themselves, in float64: the layer's own RMSNorm,
q/k/v/o projections and its own rotary embedding (``apply_rotary_pos_emb`` with the query at
position ``offset`` and the key at 0), dense ``d_vocab x d_vocab`` circuits, brute force over all
``d_vocab^3`` skip-trigram triples, and ``torch.linalg.eigvals`` of the dense token circuits.

Tolerances: the oracles run in float64 throughout (HF's rotary module and RMSNorm compute in float32
whatever the model's dtype, so the oracle forms its angles and norms itself, in float64). Our circuits
of a float64 model are float64, but skip-trigram and induction tables multiply float32 factors
(``centred_product_tol`` of each circuit's chain of factors) and positivities are returned in float32
(``POSITIVITY_TOL``).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import composition_detail, composition_scores, induction_pair
from pycircuits_widgets.analysis.circuits import full_qk_circuit
from pycircuits_widgets.analysis.eigen import eigenvalue_positivity_offsets
from pycircuits_widgets.analysis.induction import k_composition_positivity
from pycircuits_widgets.analysis.rotary import DEFAULT_OFFSETS, describe
from pycircuits_widgets.models.rotary import rotary_frequencies
from test_adapters_hf import randomize
from tolerance import POSITIVITY_TOL, assert_within, centred_product_tol, gamma, product_tol, score_tol

V, H, KV, DH = 48, 4, 2, 8
OFFSETS = (1, 5)
CONFIGS = {
    "llama_gqa": {},
    "llama_linear_rope": {"rope_scaling": {"type": "linear", "factor": 2.0}},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def llama(request):
    config = transformers.LlamaConfig(vocab_size=V, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=H, num_key_value_heads=KV, intermediate_size=48,
                                      **CONFIGS[request.param])
    hf = randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"), seed=3).double()
    model = pcw.from_hf(hf)
    # the oracle's angles use HF's frequencies, ours ours: the same float32 expression on the same
    # inputs, so equal bit for bit (were they not, the angles would differ by offset x that gap)
    assert torch.equal(rotary_frequencies(model.cfg, 0)[0].double(), hf.model.rotary_emb.inv_freq.double())
    return hf, model


def _rotate(hf, x, position):
    """``x [V, heads, d_head]`` as HF rotates it at ``position``: ``apply_rotary_pos_emb`` with its rotary
    module's ``inv_freq`` and ``attention_scaling``, the angles ``position * inv_freq`` in float64. (The
    module's forward forms them in float32, whatever the model's dtype: their rounding, up to
    ``position x 6e-8``, would be the comparisons' largest error, and float32 cos/sin kernels differ
    between CPUs. ``inv_freq`` is the forward's own, bit for bit: see the fixture.)"""
    rotary = hf.model.rotary_emb
    angle = position * rotary.inv_freq.double()
    emb = torch.cat([angle, angle]).expand(1, x.shape[0], -1)  # [1, V, d_head]
    cos, sin = emb.cos() * rotary.attention_scaling, emb.sin() * rotary.attention_scaling
    q = x.transpose(0, 1)[None]  # [1, heads, V, d_head]
    rotated, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return rotated[0].transpose(0, 1)


def _heads(proj, x, n):
    return proj(x).view(x.shape[0], n, DH)


def _dense_qk(hf, layer, head, offset, query_in, key_in):
    """``[dest token, src token]`` raw QK scores of one head (no 1/sqrt(d_head)): query at ``offset``, key at 0."""
    attn = hf.model.layers[layer].self_attn
    q = _rotate(hf, _heads(attn.q_proj, query_in, H), offset)[:, head]
    k = _rotate(hf, _heads(attn.k_proj, key_in, KV), 0)[:, head // (H // KV)]
    return q @ k.T


def _rotation(hf, offset):
    """``R(offset) [d_head, d_head]``: HF's rotation of a query at ``offset`` as a matrix (rows: the basis rotated)."""
    return _rotate(hf, torch.eye(DH, dtype=torch.float64)[:, None], offset)[:, 0]


def _qk_chain(hf, layer, head, R, query_in, key_in):
    """``_dense_qk``'s factors ``(query_in, W_Q, R, W_K^T, key_in^T)`` (the key at position 0 is not rotated):
    what our float32 QK tables multiply, for ``centred_product_tol``."""
    attn, kv = hf.model.layers[layer].self_attn, head // (H // KV)
    W_Q = attn.q_proj.weight[head * DH:(head + 1) * DH].T
    W_K = attn.k_proj.weight[kv * DH:(kv + 1) * DH].T
    return query_in, W_Q, R, W_K.T, key_in.T


def _head_out(hf, layer, head, x):
    """``[V, d_model]``: what head ``head`` of ``layer`` writes when every position reads ``x``."""
    attn = hf.model.layers[layer].self_attn
    v = _heads(attn.v_proj, x, KV)[:, head // (H // KV)]
    return v @ attn.o_proj.weight[:, head * DH:(head + 1) * DH].T


def _layer0_in(hf):
    """``W_E`` through layer 0's RMSNorm (its weight and epsilon), in float64: HF's module normalizes in
    float32 whatever the model's dtype."""
    norm, E = hf.model.layers[0].input_layernorm, hf.model.embed_tokens.weight
    return E / (E.square().mean(-1, keepdim=True) + norm.variance_epsilon).sqrt() * norm.weight


def _dense_skip_trigram_scores(hf, head, offset):
    """``([src, dest, out] skip-trigram scores of a layer-0 head by brute force, [src, dest, out] bound on ours)``.

    Ours multiplies float32 factors: its centred QK and OV entries are within ``centred_product_tol`` of
    their chains (``x W_Q R W_K^T x^T``, ``x W_V W_O W_U``); a score ``qk+ ov+`` then within
    ``dqk ov+ + qk+ dov + dqk dov`` and its own product's rounding."""
    x = _layer0_in(hf)
    qk = _dense_qk(hf, 0, head, offset, x, x)
    qk = qk - qk.mean(1, keepdim=True)
    ov = (_head_out(hf, 0, head, x) * hf.model.norm.weight) @ hf.lm_head.weight.T
    ov = ov - ov.mean(1, keepdim=True)
    attn, kv = hf.model.layers[0].self_attn, head // (H // KV)
    W_V = attn.v_proj.weight[kv * DH:(kv + 1) * DH].T
    W_O = attn.o_proj.weight[:, head * DH:(head + 1) * DH].T
    W_U = hf.model.norm.weight[:, None] * hf.lm_head.weight.T
    dqk = centred_product_tol(*_qk_chain(hf, 0, head, _rotation(hf, offset), x, x)).T[:, :, None]
    dov = centred_product_tol(x, W_V, W_O, W_U)[:, None, :]
    qk, ov = qk.T[:, :, None], ov[:, None, :]
    return qk.clamp_min(0) * ov.clamp_min(0), score_tol(qk, ov, dqk, dov)


def _assert_top(rows, scores, bound, k):
    """``rows`` (ours) are the top ``k`` of ``scores`` in order, each score within ``bound``. The order is
    compared exactly: the test first checks that neighbours among the top ``k + 1`` scores lie further
    apart than their two bounds (so no CPU's rounding can swap them)."""
    values, triples = _top(scores, k + 1)
    bounds = torch.stack([bound[t] for t in triples])
    assert bool((values[:-1] - values[1:] > bounds[:-1] + bounds[1:]).all()), "near-tied top scores: order undecided"
    assert [(r.source, r.destination, r.out) for r in rows] == triples[:k]
    assert_within(torch.tensor([r.score for r in rows], dtype=torch.float64), values[:k], bounds[:k])
    return triples[:k]


def _top(scores, k):
    values, flat = torch.topk(scores.flatten(), k)
    return values, [tuple(int(i) for i in torch.unravel_index(f, scores.shape)) for f in flat]


@torch.no_grad()
def test_skip_trigrams_at_an_offset_and_over_a_window_match_brute_force(llama):
    hf, model = llama
    dense = {o: _dense_skip_trigram_scores(hf, 2, o) for o in (*OFFSETS, *range(0, 8))}
    for offset in OFFSETS:
        rows = pcw.skip_trigrams(model, 0, 2, k=12, approximate=True, offset=offset)
        _assert_top(rows, *dense[offset], 12)
        assert {r.offset for r in rows} == {offset}
    # two offsets give different tables: the rotary QK circuit really moves with the offset
    assert [(r.source, r.destination) for r in pcw.skip_trigrams(model, 0, 2, k=12, approximate=True, offset=1)] != \
        [(r.source, r.destination) for r in pcw.skip_trigrams(model, 0, 2, k=12, approximate=True, offset=5)]
    window = torch.stack([dense[o][0] for o in range(0, 8)])
    best, at = window.max(0)
    # a maximum over offsets moves by at most the largest of its entries' bounds
    bound = torch.stack([dense[o][1] for o in range(0, 8)]).amax(0)
    rows = pcw.skip_trigrams(model, 0, 2, k=12, approximate=True, offset=range(0, 8))
    triples = _assert_top(rows, best, bound, 12)
    # each triple's strongest offset: the oracle's, or (where another offset scores within both bounds of
    # it, as happens here with linear scaling) one that rounding could rank first on some CPU
    for r, t in zip(rows, triples):
        assert r.offset == int(at[t]) or float(window[r.offset][t]) >= float(best[t]) - 2 * float(bound[t])


@torch.no_grad()
def test_skip_trigram_mean_reads_the_window_averaged_qk_circuit(llama):
    hf, model = llama
    x = _layer0_in(hf)
    qk = torch.stack([_dense_qk(hf, 0, 1, o, x, x) for o in range(3, 9)]).mean(0)
    qk = qk - qk.mean(1, keepdim=True)
    # ours: float32 factors with the window's mean rotation between them
    mean_rotation = torch.stack([_rotation(hf, o) for o in range(3, 9)]).mean(0)
    bound = centred_product_tol(*_qk_chain(hf, 0, 1, mean_rotation, x, x))
    rows = pcw.skip_trigrams(model, 0, 1, k=5, approximate=True, offset=range(3, 9), reduce="mean")
    for r in rows:
        assert r.offset is None
        assert abs(r.qk - float(qk[r.destination, r.source])) <= float(bound[r.destination, r.source])
    query = pcw.analysis.circuit_query(model, 0, 1, rows[0].destination, "attends_to", k=3, approximate=True,
                                       offset=range(3, 9), reduce="mean")
    assert [i for i, _, _ in query] == torch.topk(qk[rows[0].destination], 3).indices.tolist()


@torch.no_grad()
def test_qk_eigenvalue_positivity_at_offsets(llama):
    hf, model = llama
    x = _layer0_in(hf)
    raw = hf.model.embed_tokens.weight * hf.model.layers[1].input_layernorm.weight  # layer 1 reads the raw W_E
    for offset in OFFSETS:
        ours = pcw.eigenvalue_positivity(model, "QK", offset=offset)
        for layer, reads in ((0, x), (1, raw)):
            for head in range(H):
                eigs = torch.linalg.eigvals(_dense_qk(hf, layer, head, offset, reads, reads))
                expected = eigs.real.sum() / eigs.abs().sum()
                assert abs(float(ours[layer, head]) - float(expected)) <= POSITIVITY_TOL
    by_offset = torch.stack([pcw.eigenvalue_positivity(model, "QK", offset=o) for o in DEFAULT_OFFSETS])
    best, at = eigenvalue_positivity_offsets(model, "QK")
    assert_within(best, by_offset.amax(0), 2 * POSITIVITY_TOL)  # two routes, each within it of float64's
    assert torch.equal(by_offset.argmax(0), at)  # offsets start at 0: index == offset
    torch.testing.assert_close(pcw.eigenvalue_positivity(model, "QK", reduce="mean"), by_offset.mean(0))


@torch.no_grad()
def test_k_composition_term_and_induction_pair_at_an_offset(llama):
    hf, model = llama
    E = hf.model.embed_tokens.weight
    g0, g1 = hf.model.layers[0].input_layernorm.weight, hf.model.layers[1].input_layernorm.weight
    positivities = {o: k_composition_positivity(model, offset=o) for o in OFFSETS}
    for offset in OFFSETS:
        for h1, h2 in ((0, 1), (3, 2)):
            # h2's query reads a token, its key reads what h1 moved (both through layer 1's norm scale)
            M = _dense_qk(hf, 1, h2, offset, E * g1, _head_out(hf, 0, h1, E * g0) * g1)
            eigs = torch.linalg.eigvals(M)
            expected = float(eigs.real.sum() / eigs.abs().sum())
            assert abs(float(positivities[offset][0, h1, 1, h2]) - expected) <= POSITIVITY_TOL
            pair = induction_pair(model, (0, h1), (1, h2), k=6, offset=offset)
            assert pair.offset == offset
            assert abs(pair.qk_positivity - expected) <= POSITIVITY_TOL
            centred = M - M.mean(1, keepdim=True)
            values, flat = torch.topk(centred.flatten(), 6)
            # ours: the circuit's two float64 factors rounded to float32, multiplied and centred there
            query = _rotate(hf, _heads(hf.model.layers[1].self_attn.q_proj, E * g1, H), offset)[:, h2]
            key = _rotate(hf, _heads(hf.model.layers[1].self_attn.k_proj, _head_out(hf, 0, h1, E * g0) * g1, KV),
                          0)[:, h2 // (H // KV)]
            bound = centred_product_tol(query, key.T).flatten()
            values7, flat7 = torch.topk(centred.flatten(), 7)  # the order is decided: neighbours lie apart
            assert bool((values7[:-1] - values7[1:] > bound[flat7][:-1] + bound[flat7][1:]).all())
            assert_within(pair.top_values, values, bound[flat])
            assert pair.top_dest.tolist() == (flat // V).tolist() and pair.top_src.tolist() == (flat % V).tolist()
    # over the default window: the offset where the pair's positivity is largest, and every number there
    pair = induction_pair(model, (0, 3), (1, 2), k=6)
    window = torch.stack([k_composition_positivity(model, offset=o)[0, 3, 1, 2] for o in DEFAULT_OFFSETS])
    # (the same float64 positivities, each rounded to float32 once or twice)
    assert pair.offset == int(window.argmax()) and abs(pair.qk_positivity - float(window.max())) <= 2 * POSITIVITY_TOL
    assert abs(float(k_composition_positivity(model)[0, 3, 1, 2]) - float(window.max())) <= 2 * POSITIVITY_TOL


@torch.no_grad()
def test_composition_detail_defaults_to_a_stated_window_and_matches_the_scores(llama):
    _, model = llama
    scores = composition_scores(model, "K", baseline=False, offsets=DEFAULT_OFFSETS)  # [n, L, H, L, H]
    detail = composition_detail(model, "K", (0, 1), (1, 3))
    by_offset = scores[:, 0, 1, 1, 3].double()
    # both float64 (a float64 model's scores): the routes' rounding is ~1e-14 relative, 1e-6 a float64 margin
    torch.testing.assert_close(detail.scores_by_offset, by_offset, rtol=1e-6, atol=1e-9)
    assert detail.offset == int(by_offset.argmax()) and detail.score == pytest.approx(float(by_offset.max()), rel=1e-6)
    assert detail.offset_note == f"at query - key offset {detail.offset} (the largest score of offsets 0..32)"
    q_scores = composition_scores(model, "Q", baseline=False, offsets=DEFAULT_OFFSETS)  # the rotation on h2's query
    torch.testing.assert_close(composition_detail(model, "Q", (0, 2), (1, 1)).scores_by_offset,
                               q_scores[:, 0, 2, 1, 1].double(), rtol=1e-6, atol=1e-9)
    assert composition_detail(model, "Q", (0, 1), (1, 3), offset=4).offset == 4
    assert composition_detail(model, "V", (0, 1), (1, 3)).offset is None  # V-composition has no offset


@torch.no_grad()
def test_full_qk_circuit_at_an_offset_and_offsets_refused_where_positions_are_not_rotary(llama):
    hf, model = llama
    x = _layer0_in(hf)
    dense = _dense_qk(hf, 0, 3, 5, x, x)
    # two float64 evaluations of the same chain of factors
    assert_within(full_qk_circuit(model, 0, 3, offset=5).AB, dense,
                  product_tol(*_qk_chain(hf, 0, 3, _rotation(hf, 5), x, x)))
    assert describe([5]) == "at query - key offset 5"
    assert describe(list(range(0, 8))) == "at the strongest of query - key offsets 0..7"
    assert describe([1, 4], "mean") == "averaged over query - key offsets 1, 4"
    gpt2 = pcw.from_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval())
    for call in (lambda: pcw.skip_trigrams(gpt2, 0, 0, approximate=True, offset=1),
                 lambda: pcw.eigenvalue_positivity(gpt2, "QK", offset=[0, 1])):
        with pytest.raises(ValueError, match="offset only applies to rotary models"):
            call()
    with pytest.raises(ValueError, match=r"offset must be an int >= 0 .*got -1"):
        pcw.skip_trigrams(model, 0, 0, approximate=True, offset=-1)
    with pytest.raises(ValueError, match="reduce must be one of"):
        pcw.eigenvalue_positivity(model, "QK", reduce="median")


@torch.no_grad()
def test_skip_trigram_view_offset_control_recomputes_the_table_for_the_new_window(llama):
    _, model = llama
    w = pcw.SkipTrigramTable(model, layer=0, head=2, k=6, offsets=range(0, 4))
    assert w.offsets == [0, 1, 2, 3] and "offsets 0..3" in w.offset_note

    def shown():
        t = w.trigrams
        return list(zip(*(t[c].tolist() for c in ("src", "dest", "out", "offset"))))

    expected = [(r.source, r.destination, r.out, r.offset)
                for r in pcw.skip_trigrams(model, 0, 2, k=6, approximate=True, offset=range(0, 4))]
    assert shown() == expected
    w.set_state({"offsets": [5, 6, 7]})  # the view's control
    assert w.wait(30) and not w.error and "offsets 5..7" in w.offset_note
    expected = [(r.source, r.destination, r.out, r.offset)
                for r in pcw.skip_trigrams(model, 0, 2, k=6, approximate=True, offset=[5, 6, 7])]
    assert shown() == expected
    for bad in ([], [-1], [0, 64]):  # n_ctx is 64
        w.set_state({"offsets": bad})
        assert "offsets must be" in w.error and w.offsets == [5, 6, 7]


@torch.no_grad()
def test_composition_eigenvalue_and_induction_views_recompute_for_a_new_window(llama):
    _, model = llama
    comp = pcw.CompositionMatrix(model, offsets=range(0, 3), selected_pair=[0, 1, 1, 3])
    eig = pcw.EigenvaluePlot(model, offsets=range(0, 3), scores={})
    ind = pcw.InductionMechanism(model, offsets=range(0, 3), n_tables=1)
    for view in (comp, eig, ind):
        assert view.wait(60) and not view.error
        view.set_state({"offsets": [4, 5, 6, 7]})  # the views' offset control
        assert view.wait(60) and not view.error and "offsets 4..7" in view.offset_note
    window = [4, 5, 6, 7]
    # the views hold float32 copies of the same float64 numbers: one rounding each (u relative), the
    # float64 routes' differences far below it
    copy = gamma(2)
    np.testing.assert_allclose(comp.scores["K"]["correct"],
                               composition_scores(model, "K", baseline=False, offsets=window).amax(0).numpy(),
                               rtol=copy, equal_nan=True)
    assert comp.detail["offset"] in window
    by_offset = torch.stack([pcw.eigenvalue_positivity(model, "QK", offset=o) for o in window])
    np.testing.assert_allclose(eig.qk_positivity, by_offset.amax(0).numpy(), rtol=copy)
    positivity = k_composition_positivity(model, offset=window)
    for key, info in ind.pairs.items():
        l1, h1, l2, h2 = map(int, key.split(","))
        assert info["offset"] in window
        assert info["qk_positivity"] == pytest.approx(float(positivity[l1, h1, l2, h2]), rel=copy)
    assert set(ind.tables) <= set(ind.pairs) and ind.tables
