"""Positional attention by offset: the positional QK term and the rotary rule against loops over
positions, the measured curve against the patterns, and the shipped previous-token head.

Tolerances: the analyses take float64 products (the random models are float64), then average and divide
in float32: ``gamma`` of those few roundings, of the averaged terms' size; the rotary rule's oracle
rotates by float64 frequencies where ours are the forward's float32 ones (``frequency_error``)."""

import math

import pytest
import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import head_scores, run
from pycircuits_widgets.analysis.positional import attention_by_offset, positional_scores_by_offset
from random_models import custom_model, paper_model
from tolerance import gamma, unit_roundoff


def frequency_error(base: float) -> float:
    """Relative error of a float32 rotary frequency ``1 / base^(2j / r)`` against the exact one: the
    exponent's rounding (``u``, amplified by ``ln(base)`` through the power), the power's (1 ulp, 2u)
    and the reciprocal's (u)."""
    return (math.log(base) + 3) * unit_roundoff(torch.float32)


def test_table_rule_is_the_mean_subdiagonal_of_w_pos_qk_w_pos():
    m = paper_model(n_layers=2, n_ctx=16)
    got = positional_scores_by_offset(m, 12, 5)
    assert got.shape == (2, 3, 6)
    for layer, head in [(0, 0), (1, 2)]:
        P = m.W_pos[:12] @ m.W_Q[layer, head] @ m.W_K[layer, head].T @ m.W_pos[:12].T / m.cfg.attn_scale
        for k in range(6):
            ref = sum(float(P[i, i - k]) for i in range(k, 12)) / (12 - k)
            size = sum(abs(float(P[i, i - k])) for i in range(k, 12)) / (12 - k)
            # float32: each entry's copy, the mean's 12 - k terms and division, the scale's division
            assert abs(float(got[layer, head, k]) - ref) <= gamma(12 - k + 3) * size


def rotate_pairs(x, k, cfg):
    """GPT-NeoX rotary by k positions, written as 2-D rotations of the pairs (j, j + r/2)."""
    r = cfg.rotary_dim
    out = x.clone()
    for j in range(r // 2):
        theta = k * cfg.rotary_base ** (-2 * j / r)
        a, b = x[..., j], x[..., j + r // 2]
        out[..., j] = a * math.cos(theta) - b * math.sin(theta)
        out[..., j + r // 2] = b * math.cos(theta) + a * math.sin(theta)
    return out


def test_rotary_rule_rotates_the_mean_query_against_the_mean_key():
    m = custom_model(positional="rotary", normalization="layernorm", n_ctx=16)
    tokens = torch.arange(10) % m.cfg.d_vocab
    out = run(m, tokens)
    got = positional_scores_by_offset(m, 10, 4, cache=out.cache)
    cache = out.cache
    for layer, head in [(0, 1), (1, 0)]:
        x = cache.resid[0, layer]
        x = (x - x.mean(-1, keepdim=True)) / cache.ln_scale[0, layer, :, None]
        q, kk = (x @ m.W_Q[layer, head]).mean(0), (x @ m.W_K[layer, head]).mean(0)
        size = float(q.norm() * kk.norm()) / m.cfg.attn_scale
        for k in range(5):
            ref = float(rotate_pairs(q, k, m.cfg) @ kk) / m.cfg.attn_scale
            # angles k theta off by k frequency_error at most (theta <= 1): two rotations that far apart
            # differ by at most that in norm; then float32's copy and division
            tol = (k * frequency_error(m.cfg.rotary_base) + gamma(16, torch.float64)) * size + gamma(2) * abs(ref)
            assert abs(float(got[layer, head, k]) - ref) <= tol
    with pytest.raises(ValueError, match="activation cache"):
        positional_scores_by_offset(m, 10, 4)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="no positional information"):
        positional_scores_by_offset(custom_model(positional="none"), 8, 2)
    with pytest.raises(ValueError, match="max_offset"):
        positional_scores_by_offset(paper_model(), 8, 8)
    with pytest.raises(ValueError, match=r"\[L, H, n, n\]"):
        attention_by_offset(torch.zeros(2, 3, 4, 5), 1)


def test_measured_curve_is_the_mean_subdiagonal_of_each_pattern():
    m = paper_model(n_layers=2)
    out = run(m, torch.arange(12) % m.cfg.d_vocab)
    got = attention_by_offset(out.patterns[0], 3)
    A = out.patterns[0, 1, 2]
    for k in range(4):
        # float32 copies of nonnegative float64 entries, averaged: gamma of the copy, 12 - k terms, division
        ref = float(sum(A[i, i - k] for i in range(k, 12)) / (12 - k))
        assert got[1, 2, k] == pytest.approx(ref, rel=gamma(12 - k + 2))


def test_shipped_previous_token_head_peaks_at_offset_one_in_weights_and_behaviour():
    m = pcw.load_pretrained("attn-only-2l")
    prev = int(head_scores(m)["previous_token"][0].argmax())
    from pycircuits_widgets.demo import SAMPLE_TEXT
    out = run(m, SAMPLE_TEXT)
    n = out.tokens.shape[-1]
    assert int(positional_scores_by_offset(m, n, 8)[0, prev].argmax()) == 1
    assert int(attention_by_offset(out.patterns[0], 8)[0, prev].argmax()) == 1
