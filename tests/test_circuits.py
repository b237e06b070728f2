"""Circuits against explicit dense products and against quantities read off a forward pass."""

import numpy as np
import pytest
import torch

from pycircuits_widgets.analysis import (
    TensorProductTerm,
    direct_path,
    full_ov_circuit,
    full_qk_circuit,
    full_virtual_ov_circuit,
    head_mlp_circuit,
    k_composition_circuit,
    mlp_in_circuit,
    mlp_out_circuit,
    ov,
    positional_qk_circuit,
    q_composition_circuit,
    qk,
    skip_trigrams,
    virtual_head_ov,
)
from random_models import custom_model, paper_model


@pytest.fixture(scope="module")
def model():
    return paper_model(n_layers=2)


def test_direct_path_is_the_bigram_table(model):
    torch.testing.assert_close(direct_path(model).dense(), model.W_E @ model.W_U)


def read_embedding(model, layer):
    """What a head of ``layer`` reads of a token: layer 0 (the stream is the embedding alone) the
    layer-normed ``W_E`` (torch's ``F.layer_norm``), later layers the raw ``W_E``."""
    if layer == 0:
        return torch.nn.functional.layer_norm(model.W_E, (model.cfg.d_model,), eps=model.cfg.eps)
    return model.W_E


def test_full_circuits_match_dense_products_for_every_head(model):
    U = model.W_U
    ov_all, qk_all = full_ov_circuit(model).dense(), full_qk_circuit(model).dense()
    assert ov_all.shape == qk_all.shape == (2, 3, 40, 40)
    for l in range(2):
        for h in range(3):
            Q, K, V, O = model.W_Q[l, h], model.W_K[l, h], model.W_V[l, h], model.W_O[l, h]
            E = read_embedding(model, l)
            torch.testing.assert_close(full_ov_circuit(model, l, h).dense(), E @ V @ O @ U)
            torch.testing.assert_close(full_qk_circuit(model, l, h).dense(), E @ Q @ K.T @ E.T)
            torch.testing.assert_close(ov_all[l, h], E @ V @ O @ U)
            torch.testing.assert_close(qk_all[l, h], E @ Q @ K.T @ E.T)
            torch.testing.assert_close(ov(model, l, h).dense(), V @ O)
            torch.testing.assert_close(qk(model, l, h).dense(), Q @ K.T)
    assert full_ov_circuit(model, 0, 1).rank == model.cfg.d_head  # split at d_head, not dense


def test_full_qk_circuit_is_the_token_part_of_the_attention_scores():
    # no positions: the pre-softmax score of dest i on src j is x_i QK x_j^T / (s_i s_j attn_scale),
    # and the full QK circuit already holds the per-token division by s (exact in layer 0)
    m = paper_model(n_layers=1)
    m.cfg.positional, m.W_pos = "none", None
    tokens = torch.tensor([[3, 17, 5, 3, 29, 8, 17]])
    _, cache = m.run_with_cache(tokens)
    t = tokens[0]
    for h in range(3):
        F = full_qk_circuit(m, 0, h).dense()[t][:, t] / m.cfg.attn_scale
        logp = cache.patterns[0, 0, h].log()
        for i in range(1, len(t)):  # softmax is shift invariant: compare differences to src 0
            # both sides float64 (paper_model): their chains' roundings (~1e-13 of these O(1) scores,
            # chain_tol in float64) sit far below this margin, while a wrong circuit is off by O(1)
            torch.testing.assert_close(logp[i, : i + 1] - logp[i, 0], F[i, : i + 1] - F[i, 0], atol=1e-6, rtol=1e-6)


def test_k_and_q_composition_circuits_match_the_forward_pass_term(model):
    # layer-1 head h2's score between dest i and src j has a term where the key side reads
    # head h1's output: (x_i / s_i) QK2 (head_out1_j / s_j)^T, and head_out1_j = sum_m A1[j, m]
    # (x_m / s1_m) OV1, so the term is sum_m A1[j, m] K[t_i, t_m] / (s1_m s_i s_j)
    tokens = torch.tensor([[1, 7, 22, 7, 1, 30, 22, 9]])
    _, cache = model.run_with_cache(tokens)
    t, x, s1, s2 = tokens[0], cache.embed[0], cache.ln_scale[0, 0], cache.ln_scale[0, 1]
    for h1, h2 in [((0, 0), (1, 2)), ((0, 2), (1, 1))]:
        QK2 = model.W_Q[h2] @ model.W_K[h2].T
        moved = cache.head_out[0, h1[0], h1[1]] / s2[:, None]  # h1's output as layer 1 reads it
        A1 = cache.patterns[0, 0, h1[1]] / s1[None, :]
        K = k_composition_circuit(model, h1, h2).dense()
        torch.testing.assert_close((x / s2[:, None]) @ QK2 @ moved.T, K[t][:, t] @ A1.T / s2[:, None] / s2[None, :])
        Q = q_composition_circuit(model, h1, h2).dense()
        torch.testing.assert_close(moved @ QK2 @ (x / s2[:, None]).T, A1 @ Q[t][:, t] / s2[:, None] / s2[None, :])


def test_virtual_head_is_the_product_of_the_two_ov_matrices(model):
    OV = model.W_V @ model.W_O
    torch.testing.assert_close(virtual_head_ov(model, (0, 1), (1, 2)).dense(), OV[0, 1] @ OV[1, 2])
    torch.testing.assert_close(full_virtual_ov_circuit(model, (0, 1), (1, 2)).dense(),
                               model.W_E @ OV[0, 1] @ OV[1, 2] @ model.W_U)
    with pytest.raises(ValueError, match="earlier layer"):
        virtual_head_ov(model, (1, 0), (1, 2))
    with pytest.raises(ValueError, match="out of range"):
        k_composition_circuit(model, (0, 3), (1, 0))


def test_mlp_path_terms_match_dense_and_attention_only_models_refuse(model):
    m = custom_model(attn_only=False, d_mlp=10, act_fn="relu")
    torch.testing.assert_close(mlp_in_circuit(m, 1).dense(), m.W_E @ m.W_in[1])
    torch.testing.assert_close(head_mlp_circuit(m, (0, 2), 1).dense(), m.W_E @ m.W_V[0, 2] @ m.W_O[0, 2] @ m.W_in[1])
    torch.testing.assert_close(mlp_out_circuit(m, 0).dense(), m.W_out[0] @ m.W_U)
    with pytest.raises(ValueError, match="attention-only"):
        mlp_in_circuit(model, 0)
    with pytest.raises(ValueError, match="reads before"):
        head_mlp_circuit(m, (1, 0), 0)


def test_positional_qk_circuit_and_rotary_refusals(model):
    torch.testing.assert_close(positional_qk_circuit(model, 1, 0).dense(),
                               model.W_pos @ model.W_Q[1, 0] @ model.W_K[1, 0].T @ model.W_pos.T)
    rotary = custom_model(positional="rotary")
    with pytest.raises(ValueError, match="rotary"):
        positional_qk_circuit(rotary, 0, 0)
    # rotary: the full QK circuit at an offset; offset 0 is the position-free product (R(0) = I)
    torch.testing.assert_close(full_qk_circuit(rotary, 0, 0, offset=0).dense(),
                               full_qk_circuit(custom_model(positional="none"), 0, 0).dense())
    with pytest.raises(ValueError, match="W_pos"):
        positional_qk_circuit(custom_model(positional="none"), 0, 0)


def test_tensor_product_term_is_a_at_x_at_w_and_the_kronecker_reading():
    g = torch.Generator().manual_seed(1)
    A, W, x = (torch.randn(*s, generator=g, dtype=torch.float64) for s in [(5, 5), (4, 3), (5, 4)])
    term = TensorProductTerm(A, W)
    torch.testing.assert_close(term(x), A @ x @ W)
    torch.testing.assert_close(term.kron() @ x.flatten(), (A @ x @ W).flatten())
    # composing two terms = applying them one after the other
    A2, W2 = torch.randn(5, 5, generator=g, dtype=torch.float64), torch.randn(3, 2, generator=g, dtype=torch.float64)
    second = TensorProductTerm(A2, W2)
    torch.testing.assert_close(term.then(second)(x), second(term(x)))
    with pytest.raises(ValueError, match="needs x"):
        term(torch.zeros(5, 3, dtype=torch.float64))


@pytest.mark.parametrize("call, error, message", [
    (lambda m: skip_trigrams(m, 0.0, 1, approximate=True), TypeError, r"^layer must be an int in 0\.\.1, got 0\.0 \(float\)$"),
    (lambda m: skip_trigrams(m, "1", 1, approximate=True), TypeError, r"^layer must be an int in 0\.\.1, got '1' \(str\)$"),
    (lambda m: skip_trigrams(m, True, 1, approximate=True), TypeError, r"^layer must be an int in 0\.\.1, got True \(bool\)$"),
    (lambda m: skip_trigrams(m, 0, 1, k=True, approximate=True), ValueError, r"^k must be a positive int, got True$"),
    (lambda m: full_ov_circuit(m, 1.0, 0), TypeError, r"^layer must be an int in 0\.\.1, got 1\.0 \(float\)$"),
    (lambda m: full_qk_circuit(m, 0, 3), ValueError, r"^head must be in 0\.\.2, got 3 \(out of range\)$"),
    (lambda m: k_composition_circuit(m, (0, 1), (1.5, 0)), TypeError, r"^h2 layer must be an int in 0\.\.1, got 1\.5"),
    (lambda m: virtual_head_ov(m, 0, (1, 0)), TypeError, r"^h1 must be a \(layer, head\) pair of ints, got 0$"),
])
def test_layer_head_and_k_must_be_ints_and_the_error_says_so(model, call, error, message):
    with pytest.raises(error, match=message):
        call(model)


def test_numpy_and_tensor_integer_indices_are_accepted(model):
    torch.testing.assert_close(full_ov_circuit(model, np.int64(1), torch.tensor(2)).dense(),
                               full_ov_circuit(model, 1, 2).dense())
